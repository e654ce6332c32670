"""Cache, prefill and decode speed of SmolLM2-135M against its conversions (mamba at beta 0.5
and 0.75, mamba2 and window at beta 0.5; untrained: speed and cache do not depend on
training), in one process.

Writes docs/results/bench.json and docs/results/bench.png, and prints a markdown table.

    python benchmarks/bench.py [--contexts 512,2048,8150] [--decode-steps 32] [--variants mamba:0.5,window:0.5]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from recurformer.pipeline import bench_command, convert_command, parse_contexts

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--scores", default=str(RESULTS / "smollm2-135m-scores.json"))
    parser.add_argument("--contexts", default="512,2048,8150")
    parser.add_argument("--variants", default="mamba:0.5,mamba:0.75,mamba2:0.5,window:0.5", help="mixer:beta,...")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--work", default=str(ROOT / "runs" / "bench"))
    args = parser.parse_args()
    work = Path(args.work)
    names = {}
    for variant in args.variants.split(","):
        mixer, beta = variant.split(":")
        out = work / f"{mixer}-beta{beta}"
        if not (out / "config.json").exists():
            convert_command(args.model, args.scores, float(beta), str(out), mixer=mixer, force=True)
        names[str(out)] = f"{mixer} beta {beta}"
    dirs = list(names)
    result = bench_command(dirs, parse_contexts(args.contexts), str(RESULTS / "bench.json"),
                           decode_steps=args.decode_steps, plot=str(RESULTS / "bench.png"))
    print("| model | baseline | context | cache ratio | decode speed-up | prefill time ratio | peak memory ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in result["ratios"]:
        print(f"| {names.get(r['model'], r['model'])} | {r['baseline']} | {r['context']} | {r['cache_bytes_ratio']:.3f} | "
              f"{r['decode_speedup']:.2f} | {r['prefill_time_ratio']:.2f} | {r['peak_memory_ratio']:.2f} |")
    print(json.dumps(result["cache_budget"], indent=1))


if __name__ == "__main__":
    main()
