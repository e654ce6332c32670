"""The original model in llama.cpp, as a CPU user who wants fast decoding would run it (issue 46).

llama.cpp runs no head-level hybrid, so the conversion cannot run there; what it gives the
unconverted model is the speed a person compares recurformer with. `llama-bench` (built from
the llama.cpp vendored in the `llama-cpp-python` sdist, in a folder of its own: docs/benchmarks.md)
times the original GGUF in F32 and Q8_0 at `bench.py`'s contexts and threads: decode
tokens/s of `--decode` tokens generated after a cache of each context (`-d`), and the
prefill of each context (`-p`), `--repetitions` times each, its defaults otherwise.

    python -m benchmarks.speed.llama_cpp --llama-bench PATH --model F32=smollm2-f32.gguf \\
        --model Q8_0=smollm2-q8_0.gguf [--contexts 512,2048,8150] [--threads 2] [--out docs/results/llama-cpp.json]

Writes the rows and the llama.cpp build as JSON, and prints the markdown table of
`docs/results/bench.md`, "The original in llama.cpp".
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from recurformer.files import write_json_atomic

from benchmarks.common import RESULTS


def llama_bench(binary: str, model: str, threads: int, repetitions: int, *args: str) -> list[dict]:
    """`llama-bench`'s JSON records of one invocation (`args`: the -p/-n/-d lists)."""
    command = [binary, "-m", model, "-t", str(threads), "-r", str(repetitions), "-o", "json", *args]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def rows_of(name: str, prefill: list[dict], decode: list[dict]) -> list[dict]:
    """One row per context: prefill seconds (`n_prompt` / its tokens/s) and decode tokens/s
    at that depth, each with the spread over the repetitions."""
    by_prompt = {r["n_prompt"]: r for r in prefill if r["n_gen"] == 0}
    rows = []
    for r in decode:
        if r["n_prompt"] != 0:
            continue
        context = r["n_depth"]
        p = by_prompt.get(context)
        rows.append({
            "model": name, "context": context, "decode_tokens": r["n_gen"], "threads": r["n_threads"],
            "decode_tokens_per_s": r["avg_ts"], "decode_tokens_per_s_stddev": r["stddev_ts"],
            "prefill_s": None if p is None else context / p["avg_ts"],
            "prefill_tokens_per_s": None if p is None else p["avg_ts"],
        })
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| llama.cpp | context | decode tokens/s | prefill s |", "|---|---|---|---|"]
    for r in rows:
        prefill = "" if r["prefill_s"] is None else f"{r['prefill_s']:.2f}"
        lines.append(f"| {r['model']} | {r['context']:,} | {r['decode_tokens_per_s']:.1f} "
                     f"(sd {r['decode_tokens_per_s_stddev']:.1f}) | {prefill} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bench", required=True, help="the llama-bench binary")
    parser.add_argument("--model", action="append", required=True, metavar="NAME=GGUF",
                        help="a GGUF of the original, named by its type (F32=..., Q8_0=...)")
    parser.add_argument("--contexts", default="512,2048,8150")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode", type=int, default=32, help="tokens generated after each context")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "llama-cpp.json")
    args = parser.parse_args()
    models = dict(spec.split("=", 1) for spec in args.model)
    rows, build = [], None
    for name, path in models.items():
        prefill = llama_bench(args.llama_bench, path, args.threads, args.repetitions, "-p", args.contexts, "-n", "0")
        decode = llama_bench(args.llama_bench, path, args.threads, args.repetitions, "-p", "0", "-n", str(args.decode),
                             "-d", args.contexts)
        build = build or {k: decode[0].get(k) for k in ("build_commit", "build_number", "cpu_info", "backends")}
        rows += rows_of(name, prefill, decode)
    write_json_atomic(args.out, {"llama_cpp": build, "threads": args.threads, "repetitions": args.repetitions,
                                 "rows": rows})
    print(markdown(rows))


if __name__ == "__main__":
    main()
