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
`docs/results/bench.md`, "The original in llama.cpp". `--recurformer FILE`: a `recurformer
bench` JSON of the conversion taken in the same idle window, whose static-cache original and
conversion join the table (each llama.cpp row divided by the conversion's speed).
"""

from __future__ import annotations

import argparse
import json
import os
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


CONVERSION = "conversion, recurformer (fp32, beta 0.5)"


def ours_of(bench: dict) -> list[dict]:
    """From a `recurformer bench` JSON: the static-cache original and the conversion, per context."""
    names = {"original+static-cache": "original, transformers with a static cache (fp32)"}
    rows = []
    for m in bench["measurements"]:
        if m["model"] in names or not m["model"].startswith("original"):
            rows.append({"model": names.get(m["model"], CONVERSION), "context": m["context"],
                         "decode_tokens_per_s": m["decode_tokens_per_s"], "prefill_s": m["prefill_s"]})
    return rows


def markdown(rows: list[dict], ours: list[dict] = ()) -> str:
    """llama.cpp's rows, then ours; with ours, each row's decode speed over the conversion's."""
    conversion = {r["context"]: r["decode_tokens_per_s"] for r in ours if r["model"] == CONVERSION}
    lines = ["| engine, weights | context | decode tokens/s | x the conversion | prefill s |", "|---|---|---|---|---|"]
    for r in sorted([*rows, *ours], key=lambda r: r["context"]):
        spread = f" (sd {r['decode_tokens_per_s_stddev']:.1f})" if "decode_tokens_per_s_stddev" in r else ""
        ratio = f"{r['decode_tokens_per_s'] / conversion[r['context']]:.2f}" if r["context"] in conversion else ""
        prefill = "" if r["prefill_s"] is None else f"{r['prefill_s']:.2f}"
        name = r["model"] if r in ours else f"original, llama.cpp {r['model']}"
        lines.append(f"| {name} | {r['context']:,} | {r['decode_tokens_per_s']:.1f}{spread} | {ratio} | {prefill} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bench", help="the llama-bench binary")
    parser.add_argument("--model", action="append", default=[], metavar="NAME=GGUF",
                        help="a GGUF of the original, named by its type (F32=..., Q8_0=...)")
    parser.add_argument("--contexts", default="512,2048,8150")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode", type=int, default=32, help="tokens generated after each context")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "llama-cpp.json")
    parser.add_argument("--recurformer", type=Path, help="a `recurformer bench` JSON from the same idle window")
    parser.add_argument("--rows", type=Path, help="print the table of this llama-cpp.json and stop (no timing)")
    args = parser.parse_args()
    if args.rows:
        data = json.loads(args.rows.read_text())
        print(markdown(data["rows"], data.get("recurformer", [])))
        return
    if not args.llama_bench or not args.model:
        parser.error("give --llama-bench and at least one --model NAME=GGUF (or --rows FILE)")
    if not (Path(args.llama_bench).is_file() and os.access(args.llama_bench, os.X_OK)):
        parser.error(f"--llama-bench {args.llama_bench}: not an executable file (benchmarks/speed/build_llama_cpp.sh builds it)")
    if any("=" not in spec for spec in args.model):
        parser.error(f"--model takes NAME=GGUF, got {args.model}")
    models = dict(spec.split("=", 1) for spec in args.model)
    missing = [path for path in models.values() if not Path(path).is_file()]
    if missing:
        parser.error(f"--model: no such file {missing[0]}")
    rows, build = [], None
    for name, path in models.items():
        prefill = llama_bench(args.llama_bench, path, args.threads, args.repetitions, "-p", args.contexts, "-n", "0")
        decode = llama_bench(args.llama_bench, path, args.threads, args.repetitions, "-p", "0", "-n", str(args.decode),
                             "-d", args.contexts)
        build = build or {k: decode[0].get(k) for k in ("build_commit", "build_number", "cpu_info", "backends")}
        rows += rows_of(name, prefill, decode)
    ours = ours_of(json.loads(args.recurformer.read_text())) if args.recurformer else []
    write_json_atomic(args.out, {"llama_cpp": build, "threads": args.threads, "repetitions": args.repetitions,
                                 "rows": rows, "recurformer": ours})
    print(markdown(rows, ours))


if __name__ == "__main__":
    main()
