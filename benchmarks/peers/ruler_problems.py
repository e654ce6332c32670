"""The shared problem set of the retrieval comparison at equal bytes (docs/results/long-context.md,
"Retrieval at equal cache bytes"): token ids that every row reads, ours (`ruler_ours.py`) and
kvpress's (`benchmarks/peers/kvpress_eval.py --ruler`, another virtual environment that cannot
import recurformer).

- RULER: our `ruler` task's problems (`tasks/ruler.py`, the format `--format`, default
  `recurformer.evaluate.ruler.BEST_FORMAT`, held-out WikiText-2 haystacks, seed 0), `--problems`
  per task at `--context` tokens;
- passkey: our `passkey` task's problems (`tasks/passkey.py`, its best format) in the same held-out
  text, at each of `--passkey-contexts`, `--passkey-problems` per depth.

Each problem is `ids` with `question_start`: `ids[:question_start]` is the context (a press may
compress it), the rest the question (fed uncompressed). Context and question are tokenized
apart, as kvpress's pipeline tokenizes them. `eos` are the ids that end an answer; an answer
also ends at a blank line (`recurformer.evaluate.ruler.ends_answer`) or after `max_new_tokens`.

    OMP_NUM_THREADS=1 python -m benchmarks.peers.ruler_problems
"""

from __future__ import annotations

import argparse
import hashlib
import json

from recurformer.data import load_documents, tokenize_documents
from recurformer.evaluate.passkey import BEST_FORMAT as PASSKEY_FORMAT
from recurformer.evaluate.ruler import BEST_FORMAT, eos_ids, problem_ids, ruler_problems
from recurformer.files import write_json_atomic
from recurformer.loading import load_model
from recurformer.tasks.passkey import FORMATS as PASSKEY_FORMATS
from recurformer.tasks.passkey import generate_passkey
from recurformer.tasks.ruler import FORMATS, TASKS, parse_tasks

from benchmarks.common import HELD_OUT as HAYSTACK, ROOT

SCHEMA = "recurformer-ruler-problems/1"
PASSKEY_TOKENS = 8


def passkey_problems(tokenizer, haystack: list[int], contexts: tuple[int, ...], depths: tuple[float, ...],
                     problems: int, seed: int) -> list[dict]:
    """Our passkey task's problems as ids split into context and question (the format's suffix)."""
    suffix = PASSKEY_FORMATS[PASSKEY_FORMAT].suffix
    out = []
    for context in contexts:
        for case in generate_passkey(tokenizer, haystack, context, depths, problems, seed=seed, fmt=PASSKEY_FORMAT):
            head = tokenizer.encode(case.prompt[:-len(suffix)])
            out.append({"kind": "passkey", "task": "passkey", "context": context, "depth": case.depth,
                        "answers": [case.answer], "ids": head + tokenizer.encode(suffix, add_special_tokens=False),
                        "question_start": len(head), "max_new_tokens": PASSKEY_TOKENS})
    return out


def digest(problems: dict) -> str:
    """A short fingerprint of a problem set: results made on different sets are not compared."""
    return hashlib.sha256(json.dumps(problems, sort_keys=True).encode()).hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "runs" / "ruler-problems.json"))
    parser.add_argument("--model", default="smollm2-135m", help="whose tokenizer makes the ids")
    parser.add_argument("--context", type=int, default=4096, help="RULER prompt tokens")
    parser.add_argument("--tasks", default="all")
    parser.add_argument("--problems", type=int, default=5, help="RULER problems per task")
    parser.add_argument("--passkey-contexts", default="1024,2048,4096")
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--passkey-problems", type=int, default=2, help="passkey problems per depth and context")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", default=BEST_FORMAT, choices=FORMATS, help="the RULER prompt format")
    args = parser.parse_args()
    model, tokenizer, _ = load_model(args.model, progress=False)
    tasks = parse_tasks(args.tasks)
    ruler = []
    for problem in ruler_problems(tokenizer, [str(HAYSTACK)], tasks, args.context, args.problems, args.seed,
                                  args.format):
        context, question = problem_ids(tokenizer, problem)
        ruler.append({"kind": "ruler", "task": problem.task, "context": args.context, "depth": None,
                      "answers": list(problem.answers), "ids": context + question, "question_start": len(context),
                      "max_new_tokens": problem.max_new_tokens})
    haystack = tokenize_documents(tokenizer, load_documents([HAYSTACK]))
    contexts = tuple(int(c) for c in args.passkey_contexts.split(",") if c)
    depths = tuple(float(d) for d in args.depths.split(","))
    problems = {
        "schema": SCHEMA, "model": args.model, "ruler_format": args.format, "passkey_format": PASSKEY_FORMAT,
        "haystack": HAYSTACK.name, "seed": args.seed, "eos": sorted(eos_ids(model, tokenizer)),
        "tasks": list(tasks), "problems": ruler + passkey_problems(tokenizer, haystack, contexts, depths,
                                                                   args.passkey_problems, args.seed),
    }
    problems["digest"] = digest(problems)
    write_json_atomic(args.out, problems)
    print(f"wrote {args.out}: {len(ruler)} RULER problems ({len(tasks)} tasks of {len(TASKS)}), "
          f"{len(problems['problems']) - len(ruler)} passkey problems, digest {problems['digest']}")


if __name__ == "__main__":
    main()
