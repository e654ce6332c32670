"""The `window` baseline at equal cache bytes, training-free, on SmolLM2-135M at beta 0.5.

A `window+mamba2` mixer holds the window's ring buffer and a Mamba-2 state; the fair rival is
a plain `window` whose larger window holds the same bytes. This script finds that window
(`recurformer.equal_cache.equal_cache_window`) and measures held-out and
out-of-domain perplexity (16,384 tokens in windows of 1,024) of the
original, the default window (64 + 4 sinks) and the equal-bytes window, with the scores
given (default: a run's `scores.json`). Writes docs/results/window-equal-cache.json.

    python -m benchmarks.quality.window_equal_cache --scores runs/x/scores.json
"""

from __future__ import annotations

import argparse

import torch

from recurformer import HeadScores, MixerConfig, convert, make_scorer, select_heads
from recurformer.equal_cache import equal_cache_window, mixer_state_bytes
from recurformer.evaluate import lookup_task, make_options
from recurformer.files import write_json_atomic
from recurformer.loading import load_model

from benchmarks.common import RESULTS, TEXTS


# the shape this study measured: the library's first default (window 64 and, for window+mamba2, a full tail)
LIBRARY_SHAPE = {"window": 64, "ssd_state": "head_dim"}

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scores", default=str(RESULTS / "smollm2-135m-scores.json"))
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--kind", default="window+mamba2", help="the mixer whose state bytes the window matches")
    parser.add_argument("--out", default=str(RESULTS / "window-equal-cache.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer, _ = load_model("smollm2-135m")
    spec = select_heads(HeadScores.load(args.scores), beta=args.beta, scorer=make_scorer("recency"))
    rival = convert(model, spec, MixerConfig(kind=args.kind, **LIBRARY_SHAPE))
    target = mixer_state_bytes(rival)
    window = equal_cache_window(model, rival)
    del rival
    task, _ = lookup_task("ppl")
    result = {"scores": args.scores, "beta": args.beta, "kind": args.kind, "kind_state_bytes": target,
              "equal_window": window, "ppl": {}}
    models = {"original": model, "window64": convert(model, spec, MixerConfig(kind="window", window=64)),
              f"window{window}": convert(model, spec, MixerConfig(kind="window", window=window))}
    for name, candidate in models.items():
        for label, path in TEXTS.items():
            options = make_options(task, {"data": [str(path)], "context": 1024, "max_tokens": 16384})
            result["ppl"][f"{name}_{label}"] = task.evaluate(candidate.eval(), tokenizer, options)["ppl"]
            print(name, label, result["ppl"][f"{name}_{label}"], flush=True)
    write_json_atomic(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
