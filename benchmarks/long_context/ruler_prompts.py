"""Which RULER prompt format SmolLM2-135M-Instruct answers best: every format of
`recurformer.tasks.ruler.FORMATS` on the original model, every task. Writes
docs/results/ruler-prompts.json and docs/results/ruler-prompts.md; the best format (the highest
mean over the tasks) becomes `recurformer.evaluate.ruler.BEST_FORMAT`.

One torch thread (the machine is shared; one thread decodes faster than two there):

    OMP_NUM_THREADS=1 python -m benchmarks.long_context.ruler_prompts --context 2048 --problems 2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from recurformer.evaluate.ruler import answer_problems, digest, ruler_problems
from recurformer.files import write_json_atomic, write_text_atomic
from recurformer.loading import load_model
from recurformer.tasks.ruler import FORMATS, TASKS, summarize

from benchmarks.common import HELD_OUT, RESULTS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default=str(HELD_OUT))
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--problems", type=int, default=2, help="problems per task")
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer, _ = load_model(args.model, progress=False)
    formats = args.formats.split(",")
    results = {}
    for fmt in formats:
        start = time.time()
        problems = ruler_problems(tokenizer, [args.data], tuple(TASKS), args.context, args.problems, 0, fmt)
        records = answer_problems(model, tokenizer, problems, progress=False)
        results[fmt] = {"digest": digest(problems), "seconds": time.time() - start, **summarize(records),
                        "records": records}
        print(f"{fmt:8s} mean {results[fmt]['mean']:.1f} ({results[fmt]['seconds'] / 60:.1f} min): "
              + ", ".join(f"{k} {v['score']:.0f}" for k, v in results[fmt]["tasks"].items()), flush=True)
    summary = {"model": args.model, "haystack": Path(args.data).name, "context": args.context,
               "problems_per_task": args.problems, "seed": 0, "threads": 1, "results": results}
    write_json_atomic(RESULTS / "ruler-prompts.json", summary)
    best = max(formats, key=lambda f: results[f]["mean"])
    lines = ["# RULER prompt formats on the original model", "",
             (f"Model `{args.model}`, haystack `{summary['haystack']}`, prompts of {args.context:,} tokens, "
              f"{args.problems} problems per task (seed 0), greedy after a prefill of the context, RULER's "
              "string match (0-100). Written by `benchmarks/long_context/ruler_prompts.py`; the formats are "
              "described in `src/recurformer/tasks/ruler.py`."), "",
             "| task | " + " | ".join(formats) + " |", "|---|" + "---|" * len(formats)]
    for task in TASKS:
        lines.append(f"| {task} | " + " | ".join(f"{results[f]['tasks'][task]['score']:.0f}" for f in formats) + " |")
    lines.append("| **mean** | " + " | ".join(f"**{results[f]['mean']:.1f}**" for f in formats) + " |")
    lines.append("| minutes | " + " | ".join(f"{results[f]['seconds'] / 60:.1f}" for f in formats) + " |")
    lines += ["", f"Best mean: `{best}`. Each cell is {args.problems} problems: one problem is "
              f"{100 / args.problems:.0f} points of a cell (less where a problem has several answers)."]
    write_text_atomic(RESULTS / "ruler-prompts.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
