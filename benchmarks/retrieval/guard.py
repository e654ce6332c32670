"""The guard of issue 44: what a retrieval-aware training costs on text. Held-out and
out-of-domain perplexity (the first 16,384 tokens of each, windows of 2,048: `run`'s
evaluation) of the original and of trained conversions, each against the original and against
the conversions trained the plain way (rows named `plain` or `plain~sN`, pooled as their
mean). The target: a model trained on the retrieval mix pays at most 0.5% of held-out
perplexity over the plain training. `--window NAME` adds the rival at equal bytes: the
training-free `window` on the groups model NAME replaced, its ring buffer holding that model's
state bytes (`recurformer.equal_cache.window_baseline`), as row `window`.

Writes docs/results/retrieval-guard.json (resumable: a model already scored is kept) and
docs/results/retrieval-guard.md.

    OMP_NUM_THREADS=1 python -m benchmarks.retrieval.guard --model plain=runs/demo/final \\
        --model plain~s1=runs/demo-s1/final --model retrieval25=runs/demo-r25/final --window plain
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import RESULTS, TEXTS
from recurformer.commands import eval_command
from recurformer.checks import require_finite
from recurformer.equal_cache import window_baseline
from recurformer.evaluate import lookup_task, make_options
from recurformer.files import write_json_atomic, write_text_atomic
from recurformer.loading import load_any

OUT = RESULTS / "retrieval-guard.json"
SIZES = dict(context=2048, max_tokens=16384)
TARGET = 1.005  # issue 44: at most 0.5% of held-out perplexity for the retrieval mix


def table(scores: dict[str, dict[str, float]]) -> str:
    """The markdown table: each row's perplexities, x the original, x the plain trainings' mean."""
    plain = {text: [s[text] for name, s in scores.items() if name.split("~")[0] == "plain"] for text in TEXTS}
    lines = ["| model | held-out ppl | x original | x plain | out-of-domain ppl | x original | x plain |",
             "|---|---|---|---|---|---|---|"]
    order = {"original": 0, "plain": 1, "window": 3}  # the retrieval trainings (2) between the plain ones and the window
    for name, s in sorted(scores.items(), key=lambda item: order.get(item[0].split("~")[0], 2)):
        cells = [name]
        for text in TEXTS:
            base = sum(plain[text]) / len(plain[text]) if plain[text] else float("nan")
            cells += [f"{s[text]:.3f}", f"{s[text] / scores['original'][text]:.4f}x",
                      "-" if name == "original" else f"{s[text] / base:.4f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def window_perplexities(original: str, converted: str) -> tuple[dict[str, float], int]:
    """({text: perplexity}, window) of the training-free `window` at `converted`'s bytes."""
    teacher, tokenizer = load_any(original)
    model, window = window_baseline(teacher, load_any(converted)[0])
    task, _ = lookup_task("ppl")
    scores = {text: task.measure(model.eval(), tokenizer, make_options(task, {"data": [str(path)], **SIZES}))["ppl"]
              for text, path in TEXTS.items()}
    for text, ppl in scores.items():  # as eval_command checks the models' perplexities
        require_finite(ppl, f"the window's {text} perplexity")
    return scores, window


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--original", default="smollm2-135m")
    parser.add_argument("--model", action="append", default=[], metavar="NAME=DIR", help="a trained conversion")
    parser.add_argument("--window", metavar="NAME", help="add the training-free window at model NAME's bytes")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    models = dict(item.split("=", 1) for item in args.model if "=" in item)
    if len(models) != len(args.model) or {"original", "window"} & set(models):
        raise SystemExit(f"error: --model takes NAME=DIR (NAME not 'original' or 'window'), got {args.model}")
    if args.window is not None and args.window not in models:
        raise SystemExit(f"error: --window {args.window}: not one of --model's names ({', '.join(models) or 'none'})")
    for name, folder in models.items():
        if not (Path(folder) / "config.json").is_file():
            raise SystemExit(f"error: --model {name}={folder}: not a model folder (no config.json)")
    torch.set_num_threads(1)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {"sizes": SIZES, "models": {}, "scores": {}}
    for name, model in {"original": args.original, **models}.items():
        if name in results["scores"] and results["models"].get(name) == model:
            continue
        scores = {text: eval_command(model, "ppl", data=[str(path)], **SIZES)["ppl"] for text, path in TEXTS.items()}
        results["models"][name], results["scores"][name] = model, scores
        write_json_atomic(out, results)
        print(f"{name}: " + ", ".join(f"{text} {ppl:.3f}" for text, ppl in scores.items()), flush=True)
    if args.window is not None and results["models"].get("window") != f"window at {models[args.window]}":
        scores, window = window_perplexities(args.original, models[args.window])
        results["models"]["window"], results["scores"]["window"] = f"window at {models[args.window]}", scores
        results["window"] = window
        write_json_atomic(out, results)
        print(f"window {window} + sinks: " + ", ".join(f"{text} {ppl:.3f}" for text, ppl in scores.items()), flush=True)
    text = ("# The guard of issue 44: text perplexity of retrieval-aware trainings\n\n"
            f"Written by `benchmarks/retrieval/guard.py`; the first {SIZES['max_tokens']:,} tokens of each text in windows "
            f"of {SIZES['context']:,}. Target: a retrieval-aware training at most {TARGET:.3f}x the plain training's "
            "held-out perplexity."
            + (f" `window`: the training-free window of {results['window']} tokens + sinks on the same groups, at the "
               f"bytes of {results['models']['window'].removeprefix('window at ')}: the rival at equal bytes."
               if "window" in results["scores"] else "")
            + "\n\n" + table(results["scores"]) + "\n")
    write_text_atomic(out.with_suffix(".md"), text)
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
