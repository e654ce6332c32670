"""Shared context at equal cache bytes: our rows (docs/results/long-context.md, "Shared context:
one prefill, many questions").

Every row answers the problem set of `shared_problems.py`: each context is prefilled once into
the row's cache (a press on our kept heads compresses it then), then every question is asked in
both modes of `recurformer.evaluate.conversation.ask` (multi-request: each from a copy of that
cache; multi-turn: one conversation). Stored per question: the completion, each gold token's
log-probability and whether it was the greedy one; `shared_table.py` scores them.

Rows and budgets are `ruler_ours.py`'s (`--budget NAME=DIR`, rows `KIND@BUDGET`), held to the
budget's bytes at the problem set's context length. Another training of a budget's model is a
budget of its own, named `NAME~sN` (`--budget 0.5~s1=runs/demo-s1/final`); the table pools a
row's trainings (`conversion@0.5`, `conversion@0.5~s1`, ...) into one row whose interval
resamples them. Contexts already answered in `--out` are kept: an interrupted run resumes, and
a row made before the problem set grew (`shared_problems.py`) answers only the new contexts.

    OMP_NUM_THREADS=1 python -m benchmarks.peers.shared_ours --budget 0.5=runs/demo/final \\
        --rows original,conversion@0.5,window@0.5
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from recurformer.cache import CACHE_ARGUMENT
from recurformer.evaluate.conversation import ask
from recurformer.evaluate.shared_context import ends_answer
from recurformer.files import write_json_atomic
from recurformer.loading import load_model

from benchmarks.common import RESULTS as ALL_RESULTS
from benchmarks.peers.ruler_ours import Rows, beta_of, load_results, parse_row
from benchmarks.peers.ruler_table import TableError, split_budget
from benchmarks.peers.shared_problems import PROBLEMS, digests

RESULTS = ALL_RESULTS / "long-context"
SCHEMA = "recurformer-shared-context-rows/1"


def training_of(name: str) -> tuple[str, str]:
    """'0.5~s1' -> ('0.5', 's1'); '0.5' -> ('0.5', '')."""
    budget, _, training = name.partition("~")
    return budget, training


def problem_index(problems: dict) -> list[dict]:
    """What the table needs of each context to score its answers (no token ids)."""
    return [{"needles": c["needles"], "starts": c["starts"]} for c in problems["contexts"]]


def save(path: Path, problems: dict, name: str, row: dict, budgets: dict) -> None:
    """Write `row` into the results at `path`, read again just before (other runs' rows are kept)."""
    results = load_results(path, problems["digest"], SCHEMA, digests(problems))
    results["rows"][name] = row
    results["budgets"] = {**results.get("budgets", {}), **budgets}
    results["index"] = problem_index(problems)
    results["context"] = problems["context"]
    results["extends"] = problems.get("extends", [])
    write_json_atomic(path, results)


@torch.no_grad()
def answer_context(model, tokenizer, context: dict, eos: set[int], compress=None) -> dict:
    """One context: prefilled (and compressed) once, every question in both modes."""
    prefill = model(input_ids=torch.tensor([context["ids"]]), use_cache=True, logits_to_keep=1)
    cache = prefill[CACHE_ARGUMENT]
    if compress is not None:
        compress(cache, len(context["ids"]))
    answered = ask(model, cache, len(context["ids"]), context["questions"], context["later"], context["golds"], eos,
                   ends_answer(tokenizer), cache_key=CACHE_ARGUMENT)
    return {mode: [{"completion": tokenizer.decode(r["answer"], skip_special_tokens=True),
                    "logprobs": [round(v, 5) for v in r["logprobs"]], "argmax": r["argmax"]} for r in records]
            for mode, records in answered.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default=str(PROBLEMS))
    parser.add_argument("--budget", action="append", default=[], metavar="NAME=DIR", help="a converted model")
    parser.add_argument("--rows", required=True, help="comma-separated rows (ruler_ours.py's)")
    parser.add_argument("--compose-base", help="the budget whose model the compose-* rows compress")
    parser.add_argument("--ablation-scores", default=str(ALL_RESULTS / "smollm2-135m-ablation-2048-scores.json"))
    parser.add_argument("--retrieval-scores", help="scores with `ablation_retrieval` costs, for duo-retrieval rows")
    parser.add_argument("--contexts", type=int, help="answer only the first N contexts (default: all)")
    parser.add_argument("--out", default=str(RESULTS / "shared-ours.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    budgets = dict(item.split("=", 1) for item in args.budget if "=" in item)
    if len(budgets) != len(args.budget):
        raise SystemExit(f"error: --budget takes NAME=DIR, got {args.budget}")
    for name, folder in budgets.items():
        try:
            split_budget(training_of(name)[0])
        except TableError as error:
            raise SystemExit(f"error: --{error}") from None
        if not (Path(folder) / "config.json").is_file():
            raise SystemExit(f"error: --budget {folder}: not a model folder (no config.json)")
    rows = [(name, *parse_row(name, budgets, args.compose_base)) for name in args.rows.split(",") if name]
    if args.retrieval_scores is None and any(kind == "duo-retrieval" for _, kind, _ in rows):
        raise SystemExit("error: duo-retrieval rows need --retrieval-scores")
    if not Path(args.problems).is_file():
        raise SystemExit(f"error: no problem set at {args.problems}; run python -m benchmarks.peers.shared_problems")
    problems = json.loads(Path(args.problems).read_text())
    contexts = problems["contexts"][:args.contexts]
    length = problems["context"]
    out = Path(args.out)
    original, tokenizer, _ = load_model(problems["model"], progress=False)
    builder = Rows(original, tokenizer, budgets, args.ablation_scores, args.compose_base, args.retrieval_scores)
    budget_record = {name: {"model": folder, "beta": beta_of(builder.models[name]),
                            "groups": sorted(map(list, builder.models[name].config.replacement["groups"])),
                            "bytes": builder.budget_bytes(name, length),
                            "line": list(builder.lines[name])} for name, folder in budgets.items()}
    eos = set(problems["eos"])
    for name, kind, budget in rows:
        model, label, size, compress = builder.build(kind, budget, length)
        rows_made = load_results(out, problems["digest"], SCHEMA, digests(problems))["rows"]
        row = rows_made.get(name, {"budget": budget, "kind": kind, "contexts": {}, "seconds": 0.0})
        row.update(label=label, cache=size, full=builder.full_per_token * length)
        todo = [i for i in range(len(contexts)) if str(i) not in row["contexts"]]
        print(f"{name}: {len(todo)} of {len(contexts)} contexts to answer", flush=True)
        for index in todo:
            start = time.time()
            row["contexts"][str(index)] = answer_context(model, tokenizer, contexts[index], eos, compress)
            row["seconds"] += time.time() - start
            save(out, problems, name, row, budget_record)
            right = sum(r["completion"].strip().startswith(n["value"])
                        for r, n in zip(row["contexts"][str(index)]["multi-request"], contexts[index]["needles"]))
            print(f"  context {index}: {right}/{len(contexts[index]['needles'])} ({time.time() - start:.0f} s)",
                  flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
