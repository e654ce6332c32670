"""The problem set of the shared-context comparison at equal bytes (docs/results/long-context.md,
"Shared context: one prefill, many questions"): token ids that every row reads, ours
(`shared_ours.py`) and kvpress's (`kvpress_eval.py --shared`, another virtual environment that
cannot import recurformer).

Our `shared-context` task's contexts (`tasks/shared_context.py`: held-out WikiText-2 text,
its default format and needle count, seed 0), `--contexts` of `--context` tokens. Each context
is `ids` (what a press may compress), and per asked needle its question as the first turn
(`questions`) and as a later turn (`later`), its gold answer (`golds`, with the space before
the value), the index of the gold's first visible token (`starts`), the needle's kind, depth
and value. `eos` are the ids that end an answer; an answer also ends at a line break.

The set can grow: context `i` depends on the seed and `i` alone, so the first 40 contexts of an
80-context set are the 40 of the 40-context set. When `--out` already holds a set whose contexts
are the new set's first ones, the new set records its digest (and those it grew from) in
`extends`; rows made on such a prefix stay valid, and a row answers the new contexts
when it is run again.

    OMP_NUM_THREADS=1 python -m benchmarks.peers.shared_problems [--contexts 80]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from recurformer.evaluate.ruler import eos_ids
from recurformer.evaluate.shared_context import BEST_FORMAT, NEEDLES, context_ids, shared_problems, value_start
from recurformer.files import write_json_atomic
from recurformer.loading import load_model
from recurformer.tasks.shared_context import FORMATS

from benchmarks.common import HELD_OUT, ROOT
from benchmarks.peers.ruler_problems import digest

SCHEMA = "recurformer-shared-context-problems/1"
PROBLEMS = ROOT / "runs" / "shared-context-problems.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(PROBLEMS))
    parser.add_argument("--model", default="smollm2-135m", help="whose tokenizer makes the ids")
    parser.add_argument("--context", type=int, default=4096, help="tokens of each context")
    parser.add_argument("--contexts", type=int, default=40)
    parser.add_argument("--needles", type=int, default=NEEDLES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", default=BEST_FORMAT, choices=FORMATS)
    args = parser.parse_args()
    model, tokenizer, _ = load_model(args.model, progress=False)
    contexts = []
    for problem in shared_problems(tokenizer, [str(HELD_OUT)], args.contexts, args.context, args.needles,
                                   args.needles, args.seed, args.format):
        ids = context_ids(tokenizer, problem)
        contexts.append({"ids": ids.context, "questions": ids.questions, "later": ids.later, "golds": ids.golds,
                         "starts": [value_start(tokenizer, g) for g in ids.golds],
                         "needles": [{"kind": problem.needles[i].kind, "depth": problem.needles[i].depth,
                                      "value": problem.needles[i].value} for i in problem.asked]})
    problems = {"schema": SCHEMA, "model": args.model, "format": args.format, "haystack": HELD_OUT.name,
                "seed": args.seed, "context": args.context, "needles": args.needles,
                "eos": sorted(eos_ids(model, tokenizer)), "contexts": contexts}
    problems["digest"] = digest(problems)
    problems["extends"] = grown_from(Path(args.out), problems)
    write_json_atomic(args.out, problems)
    grown = f", grown from {', '.join(problems['extends'])}" if problems["extends"] else ""
    print(f"wrote {args.out}: {len(contexts)} contexts of {args.context:,} tokens, {args.needles} questions each, "
          f"digest {problems['digest']}{grown}")


def digests(problems: dict) -> tuple[str, ...]:
    """The problem sets whose rows are valid for `problems`: itself and the sets it grew from."""
    return (problems["digest"], *problems.get("extends", ()))


def grown_from(path: Path, problems: dict) -> list[str]:
    """The digests of the sets at `path` that `problems` extends: the set there and the sets it
    extends, when its contexts are `problems`' first ones and all else is equal; else none (no
    file, another set, or not a set at all: the new set replaces it)."""
    try:
        old = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):  # none there, or not a set: it is replaced
        return []
    same = isinstance(old, dict) and "digest" in old and all(
        old.get(key) == value for key, value in problems.items() if key not in ("contexts", "digest"))
    if not same or not old.get("contexts") or old["contexts"] != problems["contexts"][:len(old["contexts"])]:
        return []
    return list(dict.fromkeys(d for d in (old["digest"], *old.get("extends", ())) if d != problems["digest"]))


if __name__ == "__main__":
    main()
