"""Cache, prefill and decode speed of SmolLM2-135M against its conversions (mamba at beta 0.5
and 0.75, every other mixer kind at beta 0.5; untrained: speed and cache do not depend on
training), in one process.

Writes bench.json and bench.png to `--out` (default docs/results), and prints markdown tables.

    python -m benchmarks.speed.bench [--contexts 512,2048,8150] [--batch 1,4,16] [--decode-steps 32] [--rounds 3]
        [--variants mamba:0.5,window:0.5] [--scores FILE --scorer NAME] [--dtype bfloat16] [--compile]
        [--budget-gib 1] [--out DIR]

A variant is `mixer:beta`, optionally followed by `:window=W` and `:ssd_state=N` (`run`'s
default shape: `window+mamba2:0.5:window=141:ssd_state=16`). The groups come from `--scores`
by `--scorer` (default: the recency scores). Batched decode of the default conversion
against the original, compiled included (docs/benchmarks.md):

    python -m benchmarks.speed.bench --variants window+mamba2:0.5:window=141:ssd_state=16 \
        --scores docs/results/example-run/scores.json --scorer ablation --contexts 4096 --batch 1,4,16 \
        --compile --budget-gib 2 --out docs/results/bench-batch

`--prefill-once` prefills each model once per context and batch and decodes every round from a
copy of that cache: batch 16 at 4,096 tokens prefills 65,536 tokens, minutes per model, against
seconds of decoding (`docs/results/bench-batch16/`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from recurformer.bench import DTYPES, BenchConfig, median_measurements, parse_batches, parse_contexts
from recurformer.commands import bench_command, convert_command
from recurformer.mixers import MixerConfig
from recurformer.scoring import SelectionConfig

from benchmarks.common import RESULTS

VARIANTS = "mamba:0.5,mamba:0.75,mamba2:0.5,window:0.5,window+linear:0.5,window+mamba:0.5,window+mamba2:0.5"


def parse_variant(text: str) -> tuple[str, float, dict[str, int]]:
    """`mixer:beta[:window=W][:ssd_state=N]` -> (mixer, beta, the shape fields given)."""
    mixer, _, rest = text.partition(":")
    beta, *fields = rest.split(":")
    try:
        beta = float(beta)
    except ValueError:
        raise SystemExit(f"bench.py: bad variant {text!r}: expected mixer:beta, for example window:0.5") from None
    shape = {}
    for field in fields:
        key, _, value = field.partition("=")
        if key not in ("window", "ssd_state") or not value.isdigit():
            raise SystemExit(f"bench.py: bad variant field {field!r} in {text!r} (window=W or ssd_state=N)")
        shape[key] = int(value)
    return mixer, beta, shape


def variant_folder(mixer: str, beta: float, shape: dict[str, int]) -> str:
    """The name of a variant's conversion folder under `--work`: `window+mamba2-beta0.5-window141`."""
    return f"{mixer}-beta{beta}" + "".join(f"-{key}{value}" for key, value in shape.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--scores", default=str(RESULTS / "smollm2-135m-scores.json"))
    parser.add_argument("--scorer", default="recency", help="how --scores selects the groups (recurformer's scorers)")
    parser.add_argument("--contexts", default="512,2048,8150", type=parse_contexts)
    parser.add_argument("--batch", default="1", type=parse_batches, help="comma-separated batch sizes")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--compile", action="store_true", help="also time the original's static cache compiled")
    parser.add_argument("--budget-gib", type=float, default=1.0, help="cache budget for the longest context and largest batch")
    parser.add_argument("--variants", default=VARIANTS, help="mixer:beta[:window=W][:ssd_state=N],...")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="ratios are medians over rounds, with their range")
    parser.add_argument("--prefill-once", action="store_true",
                        help="each model prefills once; its rounds decode from copies of that cache (large batches)")
    # relative, so that bench.json names the models as the repository does, not by this machine's paths
    parser.add_argument("--work", default=str(Path("runs") / "bench"), help="where the conversions go (from the "
                        "repository root)")
    parser.add_argument("--out", default=str(RESULTS), help="folder for bench.json and bench.png")
    args = parser.parse_args()
    work = Path(args.work)
    if args.scorer != "recency" or Path(args.scores).name != "smollm2-135m-scores.json":
        work = work / f"{Path(args.scores).stem}-{args.scorer}"  # conversions of other groups in their own folder
    names = {}
    for variant in args.variants.split(","):
        mixer, beta, shape = parse_variant(variant)
        out = work / variant_folder(mixer, beta, shape)
        if not (out / "config.json").exists():
            convert_command(args.model, args.scores, str(out), SelectionConfig(beta=beta, scorer=args.scorer),
                            MixerConfig(kind=mixer, **shape), force=True)
        names[str(out)] = f"{mixer} beta {beta}" + "".join(f" {key} {value}" for key, value in shape.items())
    dirs = list(names)
    config = BenchConfig(contexts=args.contexts, batches=args.batch,
                         decode_steps=args.decode_steps, rounds=args.rounds, budget_gib=args.budget_gib, dtype=args.dtype,
                         compile=args.compile, prefill_once=args.prefill_once)
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    result = bench_command(dirs, str(folder / "bench.json"), config, plot=str(folder / "bench.png"))

    def spread(r: dict, key: str) -> str:
        if key not in r:
            return "not measured"
        return f"{r[key]:.2f}" + (f" ({r[key + '_min']:.2f}-{r[key + '_max']:.2f})" if key + "_min" in r else "")

    print(f"ratios: median over {args.rounds} round(s) (range)")
    print("| model | baseline | context | batch | cache ratio | decode speed-up | prefill time ratio | peak memory ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result["ratios"]:
        print(f"| {names.get(r['model'], r['model'])} | {r['baseline']} | {r['context']} | {r['batch']} | "
              f"{r['cache_bytes_ratio']:.3f} | {spread(r, 'decode_speedup')} | {spread(r, 'prefill_time_ratio')} | "
              f"{spread(r, 'peak_memory_ratio')} |")
    print("\ndecode tokens/s (median over rounds): per sequence / whole batch")
    print("| model | context | batch | per sequence | total |")
    print("|---|---|---|---|---|")
    for r in median_measurements(result):
        print(f"| {names.get(r['model'], r['model'])} | {r['context']} | {r['batch']} | {r['decode_tokens_per_s']:.2f} | "
              f"{r['decode_total_tokens_per_s']:.2f} |")
    print(f"\ncache budget {args.budget_gib:g} GiB at {max(config.contexts)} tokens")
    print("| model | cache per sequence (MiB) | longest context (1 sequence) | largest batch |")
    print("|---|---|---|---|")
    for b in result["cache_budget"]:
        print(f"| {names.get(b['model'], b['model'])} | {b['bytes_per_sequence'] / 2**20:.1f} | {b['max_context']:,} | "
              f"{b['max_batch']} |")
    if result["compile_s"] or result["skipped"]:
        print(json.dumps({"compile_s": result["compile_s"], "skipped": result["skipped"]}))


if __name__ == "__main__":
    main()
