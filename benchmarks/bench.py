"""Cache, prefill and decode speed of SmolLM2-135M against its conversions at beta 0.5 and
0.75 (untrained: speed and cache do not depend on training), in one process.

Writes docs/results/bench.json and docs/results/bench.png, and prints a markdown table.

    python benchmarks/bench.py [--contexts 512,2048,8192] [--decode-steps 32]
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
    parser.add_argument("--contexts", default="512,2048,8192")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--work", default=str(ROOT / "runs" / "bench"))
    args = parser.parse_args()
    work = Path(args.work)
    dirs = []
    for beta in (0.5, 0.75):
        out = work / f"beta{beta}"
        if not (out / "config.json").exists():
            convert_command(args.model, args.scores, beta, str(out), force=True)
        dirs.append(str(out))
    result = bench_command(dirs, parse_contexts(args.contexts), str(RESULTS / "bench.json"),
                           decode_steps=args.decode_steps, plot=str(RESULTS / "bench.png"))
    names = {d: f"beta {Path(d).name[4:]}" for d in dirs}
    print("| model | baseline | context | cache ratio | decode speed-up | prefill time ratio | peak memory ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in result["ratios"]:
        print(f"| {names.get(r['model'], r['model'])} | {r['baseline']} | {r['context']} | {r['cache_bytes_ratio']:.3f} | "
              f"{r['decode_speedup']:.2f} | {r['prefill_time_ratio']:.2f} | {r['peak_memory_ratio']:.2f} |")
    print(json.dumps(result["cache_budget"], indent=1))


if __name__ == "__main__":
    main()
