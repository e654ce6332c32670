"""Which passkey prompt format SmolLM2-135M-Instruct retrieves best: every format of
`recurformer.tasks.passkey.FORMATS` on the original model at 1K and 2K tokens. Writes
docs/results/passkey-prompts.json and docs/results/passkey-prompts.md; the best format
becomes `recurformer.evaluate.passkey.BEST_FORMAT`.

One torch thread (the machine is shared); a few minutes:

    python -m benchmarks.long_context.passkey_prompts
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from recurformer.data import load_documents, tokenize_documents
from recurformer.evaluate.passkey import passkey_accuracy
from recurformer.files import write_json_atomic, write_text_atomic
from recurformer.loading import load_model
from recurformer.tasks.passkey import FORMATS

from benchmarks.common import DATA, RESULTS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--haystack", default=str(DATA / "tinyshakespeare.txt"))
    parser.add_argument("--contexts", default="1024,2048")
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--problems", type=int, default=2, help="problems per depth")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer, _ = load_model(args.model)
    haystack = tokenize_documents(tokenizer, load_documents([args.haystack]))
    contexts = [int(c) for c in args.contexts.split(",")]
    depths = tuple(float(d) for d in args.depths.split(","))
    results = []
    for fmt in FORMATS:
        for context in contexts:
            result = passkey_accuracy(model, tokenizer, haystack, context, depths, args.problems, fmt=fmt,
                                      batch_size=1, progress=False)
            results.append(result)
            print(f"{fmt:9s} {context:5d} tokens: {result['accuracy']:.0%} of {result['n']}", flush=True)
    summary = {"model": args.model, "haystack": Path(args.haystack).name, "depths": list(depths),
               "problems_per_depth": args.problems, "threads": 1, "results": results}
    write_json_atomic(RESULTS / "passkey-prompts.json", summary)
    lines = ["# Passkey prompt formats on the original model", "",
             (f"Model `{args.model}`, haystack `{summary['haystack']}`, depths {', '.join(map(str, depths))}, "
              f"{args.problems} problems per depth (seed 0), greedy, exact match, 1 torch thread. Written by "
              "`benchmarks/long_context/passkey_prompts.py`; the formats are described in `src/recurformer/tasks/passkey.py`."), "",
             "| format | " + " | ".join(f"{c} tokens" for c in contexts) + " |",
             "|---|" + "---|" * len(contexts)]
    for fmt in FORMATS:
        row = [r for r in results if r["format"] == fmt]
        lines.append(f"| {fmt} | " + " | ".join(f"{r['accuracy']:.0%} ({r['n']})" for r in row) + " |")
    best = max(FORMATS, key=lambda f: sum(r["accuracy"] for r in results if r["format"] == f))
    lines += ["", f"Best over both lengths: `{best}` (the task's default format). Each cell is "
              f"{len(depths) * args.problems} problems: a difference of one or two is noise."]
    write_text_atomic(RESULTS / "passkey-prompts.md", "\n".join(lines) + "\n")
    print(json.dumps({r["format"] + f"@{r['context']}": r["accuracy"] for r in results}))


if __name__ == "__main__":
    main()
