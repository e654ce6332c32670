"""What limits the decode speed-up: the bytes a decode step reads, original against conversion.

A decode step of a small model on a CPU reads every weight once and every cached key and
value once, and does little arithmetic per byte, so its time follows the bytes it moves.
If it followed them exactly, the speed-up of a conversion over its original at B sequences
of C tokens would be the bytes ratio

    bytes_ratio(C, B) = (weights_original + B * cache_original(C)) / (weights_converted + B * cache_converted(C))

(weights: every parameter, the tied embedding read once as the output projection; cache: the
K/V held and the mixers' state, per sequence). The replaced heads' mixers add weights (the
tail's projections) and take away K/V, so a conversion gains little while the weights
dominate (short contexts, batch 1) and approaches the cache ratio when the cache dominates
(long contexts, large batches). This script computes the bytes ratio from the models and the cache
bytes `bench.py` measured, beside the speed-up `bench.py` measured (docs/results/bench.md,
"What limits the speed-up"). No timing: the numbers are bytes.

    python -m benchmarks.speed.bytes_per_step [--bench docs/results/bench.json] [--batch 1,16]
        [--out docs/results/bytes-per-step.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from recurformer import HeadScores, MixerConfig, convert
from recurformer.bench import parse_batches
from recurformer.checks import read_json
from recurformer.errors import RecurformerError
from recurformer.files import write_json_atomic
from recurformer.loading import load_model
from recurformer.scoring import SelectionConfig

from benchmarks.common import RESULTS
from benchmarks.speed.bench import parse_variant, variant_folder

BASELINE = "original+static-cache"


def weight_bytes(model) -> int:
    """Bytes of every parameter a decode step reads: all of them, a tied embedding once (as the
    output projection; the input lookup reads one row), an untied input embedding not at all."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    if embedding is not model.get_output_embeddings().weight:
        total -= embedding.numel() * embedding.element_size()
    return total


def measured_cache(bench: dict, model: str, context: int) -> tuple[int, int]:
    """(K/V bytes, state bytes) of one sequence of `model` at `context` in bench.json."""
    rows = [m for m in bench["measurements"] if m["model"] == model and m["context"] == context]
    row = min(rows, key=lambda m: m["batch"])
    return row["kv_bytes"] // row["batch"], row["state_bytes"] // row["batch"]


def measured_speedup(bench: dict, model: str, context: int, batch: int) -> float | None:
    for ratio in bench["ratios"]:
        if (ratio["model"], ratio["baseline"], ratio["context"], ratio.get("batch", 1)) == (model, BASELINE, context, batch):
            return ratio["decode_speedup"]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", default=str(RESULTS / "bench.json"), help="bench.py's results (cache bytes, speed-ups)")
    parser.add_argument("--scores", default=str(RESULTS / "example-run" / "scores.json"))
    parser.add_argument("--scorer", default="ablation", help="how --scores selects the groups, as bench.py's --scorer")
    parser.add_argument("--variants", default="window+mamba2:0.5,window+mamba2:0.75,window:0.5,mamba:0.5",
                        help="mixer:beta,... as bench.py's; each must be in --bench (by its folder's name)")
    parser.add_argument("--batch", default="1,16", type=parse_batches)
    parser.add_argument("--out", default=str(RESULTS / "bytes-per-step.json"))
    args = parser.parse_args()
    try:
        bench = read_json(args.bench)
        scores = HeadScores.load(args.scores)
    except RecurformerError as error:
        raise SystemExit(f"bytes_per_step.py: {error}") from None
    original, _, _ = load_model("smollm2-135m", progress=False)
    models = {m["model"] for m in bench["measurements"]}
    rows, weights = [], {"original": weight_bytes(original)}
    for variant in args.variants.split(","):
        mixer, beta, shape = parse_variant(variant)
        name = next((m for m in models if Path(m).name == variant_folder(mixer, beta, shape)), None)
        if name is None:
            raise SystemExit(f"bytes_per_step.py: {variant} is not in {args.bench}")
        selection = SelectionConfig(beta=beta, scorer=args.scorer).select(scores)
        converted = convert(original, selection, MixerConfig(kind=mixer, **shape), init="random")
        weights[variant] = weight_bytes(converted)
        for context in bench["contexts"]:
            kv_o, state_o = measured_cache(bench, "original", context)
            kv_c, state_c = measured_cache(bench, name, context)
            for batch in args.batch:
                top = weights["original"] + batch * (kv_o + state_o)
                bottom = weights[variant] + batch * (kv_c + state_c)
                rows.append({"variant": variant, "context": context, "batch": batch,
                             "bytes_original": top, "bytes_converted": bottom, "bytes_ratio": top / bottom,
                             "measured": measured_speedup(bench, name, context, batch)})
    write_json_atomic(args.out, {"bench": Path(args.bench).name, "baseline": BASELINE, "weight_bytes": weights,
                                 "rows": rows})
    print("weights read per step (MB): " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in weights.items()))
    print("| variant | context | batch | bytes per step, original (MB) | conversion (MB) | bytes ratio | measured |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        measured = f"{r['measured']:.2f}x" if r["measured"] is not None else "-"
        print(f"| {r['variant']} | {r['context']:,} | {r['batch']} | {r['bytes_original'] / 1e6:.0f} | "
              f"{r['bytes_converted'] / 1e6:.0f} | {r['bytes_ratio']:.2f}x | {measured} |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
