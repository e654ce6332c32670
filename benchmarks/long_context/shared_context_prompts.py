"""How many facts SmolLM2-135M-Instruct keeps apart in one context, and in which format: the
shared-context task on the original model over a grid of formats and needle counts K, multi-
request mode. Writes docs/results/shared-context-prompts.json and .md; the chosen cell (the
largest K at which the best format answers at least 75% at the searched length) gives
`recurformer.evaluate.shared_context`'s `BEST_FORMAT` and `NEEDLES`. Cells already in the JSON
are kept, so an interrupted search resumes.

    OMP_NUM_THREADS=1 python -m benchmarks.long_context.shared_context_prompts \\
        --context 4096 --contexts 4 --needles 8,10,12 --formats plain,chat
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from recurformer.evaluate.ruler import digest
from recurformer.evaluate.shared_context import answer_contexts, shared_problems, summarize
from recurformer.files import write_json_atomic, write_text_atomic
from recurformer.loading import load_model
from recurformer.tasks.shared_context import FORMATS

from benchmarks.common import HELD_OUT, RESULTS

TARGET = 75.0  # the original must answer at least this share (%) at the chosen K
OUT = RESULTS / "shared-context-prompts.json"


def chosen(cells: dict) -> dict | None:
    """The cell of the largest K that reaches TARGET; among its formats the best."""
    passing = [c for c in cells.values() if c["exact"] >= TARGET]
    return max(passing, key=lambda c: (c["needles"], c["exact"])) if passing else None


def render(summary: dict) -> str:
    cells = summary["cells"]
    formats = sorted({c["format"] for c in cells.values()})
    counts = sorted({c["needles"] for c in cells.values()})
    lines = ["# Shared-context task: formats and needle counts on the original model", "",
             (f"Model `{summary['model']}`, haystack `{summary['haystack']}`, contexts of {summary['context']:,} "
              f"tokens, {summary['contexts']} contexts per cell (seed 0), every needle asked once, multi-request "
              "mode (each question from a copy of the prefilled cache), greedy, exact match (0-100; in brackets "
              "the 90% interval over contexts). Written by `benchmarks/long_context/shared_context_prompts.py`; "
              "the formats are described in `src/recurformer/tasks/shared_context.py`."), "",
             "| needles K | " + " | ".join(formats) + " |", "|---|" + "---|" * len(formats)]
    for k in counts:
        row = []
        for fmt in formats:
            cell = cells.get(f"{fmt}-{k}")
            row.append("" if cell is None else f"{cell['exact']:.1f} ({cell['low']:.0f}-{cell['high']:.0f})")
        lines.append(f"| {k} | " + " | ".join(row) + " |")
    best = chosen(cells)
    lines += ["", f"Chosen (the largest K with at least {TARGET:.0f}%): " + (
        f"format `{best['format']}`, K = {best['needles']} ({best['exact']:.1f})." if best else "none reaches it.")]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default=str(HELD_OUT))
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--contexts", type=int, default=4)
    parser.add_argument("--needles", default="8,10,12", help="comma-separated needle counts")
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer, _ = load_model(args.model, progress=False)
    summary = json.loads(OUT.read_text()) if OUT.exists() else {"cells": {}}
    if summary["cells"] and (summary["context"], summary["contexts"]) != (args.context, args.contexts):
        raise SystemExit(f"error: {OUT} holds a search at another --context/--contexts; move it away first")
    summary.update(model=args.model, haystack=HELD_OUT.name, context=args.context, contexts=args.contexts, seed=0,
                   threads=1)
    for fmt in args.formats.split(","):
        for k in map(int, args.needles.split(",")):
            if f"{fmt}-{k}" in summary["cells"]:
                continue
            start = time.time()
            problems = shared_problems(tokenizer, [args.data], args.contexts, args.context, k, k, 0, fmt)
            contexts = answer_contexts(model, tokenizer, problems, ("multi-request",), progress=False)
            exact = summarize(contexts)["multi-request"]["exact"]
            summary["cells"][f"{fmt}-{k}"] = {"format": fmt, "needles": k, "exact": exact["mean"], "low": exact["low"],
                                              "high": exact["high"], "digest": digest(problems),
                                              "seconds": time.time() - start, "records": contexts}
            print(f"{fmt} K={k}: {exact['mean']:.1f} ({time.time() - start:.0f} s)", flush=True)
            write_json_atomic(OUT, summary)
    write_text_atomic(OUT.with_suffix(".md"), render(summary))
    print(render(summary))


if __name__ == "__main__":
    main()
