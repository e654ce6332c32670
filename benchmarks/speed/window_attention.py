"""Speed of the windowed attention (`ops/window`): the blockwise PyTorch path and the
compiled kernel, against the causal SDPA over the whole sequence that the heads computed
before they were windowed (and the naive oracle where its `[T, T]` scores fit).

The heads of a fully replaced SmolLM2-135M layer (9 query heads, 3 KV heads, head_dim 64),
`run`'s window (141 tokens + 4 sinks), fp32: batch 1 at 8150 tokens (a long prefill) and
batch 4 at 512 and 1024 tokens (the lm and tail training shapes); forward (no autograd)
and forward + backward (gradients of q, k, v), median of `--repeats` after a warm-up.

Writes docs/results/window_attention.json (`--out`: elsewhere).

    python -m benchmarks.speed.window_attention [--shapes 1x8150,4x512,4x1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from recurformer.files import write_json_atomic
from recurformer.ops import kernels
from recurformer.ops.window import window_attention

from benchmarks.common import RESULTS

HEADS, GROUPS, DIM, WINDOW, SINKS = 9, 3, 64, 141, 4
NAIVE_MAX_SCORES = 200_000_000  # B H T^2 above this: the oracle's score matrix is not built


def median_ms(function, repeats: int) -> float:
    function()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def causal_sdpa(q, k, v):
    """What the heads computed unwindowed: causal attention over the whole sequence, `[B, T, H, D]` in and out."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                          enable_gqa=True).transpose(1, 2)


def measure(batch: int, length: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, length, HEADS, DIM, generator=g)
    k, v = (torch.randn(batch, length, GROUPS, DIM, generator=g) for _ in range(2))
    contenders = {"causal_sdpa": causal_sdpa}
    for backend in ("naive", "torch", "compiled"):
        if backend == "naive" and batch * HEADS * length**2 > NAIVE_MAX_SCORES:
            continue
        if backend == "compiled" and kernels.library() is None:
            continue
        contenders[backend] = lambda q, k, v, backend=backend: window_attention(q, k, v, WINDOW, SINKS, backend=backend)
    row = {"batch": batch, "length": length}
    for name, attention in contenders.items():
        with torch.no_grad():
            row[f"{name}_forward_ms"] = median_ms(lambda: attention(q, k, v), repeats)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        row[f"{name}_forward_backward_ms"] = median_ms(lambda: attention(*leaves).sum().backward(), repeats)
        print(f"B {batch} T {length} {name}: forward {row[f'{name}_forward_ms']:.1f} ms, "
              f"forward + backward {row[f'{name}_forward_backward_ms']:.1f} ms", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x8150,4x512,4x1024", help="batch x length, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "window_attention.json"))
    args = parser.parse_args()
    kernels.library()  # built before anything is timed
    rows = [measure(*map(int, shape.split("x")), args.repeats) for shape in args.shapes.split(",")]
    write_json_atomic(Path(args.out), {
        "heads": HEADS, "groups": GROUPS, "head_dim": DIM, "window": WINDOW, "sinks": SINKS, "dtype": "float32",
        "repeats": args.repeats, "threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows,
    })


if __name__ == "__main__":
    main()
