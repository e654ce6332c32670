"""Speed of the CPU scans against their naive loops: the chunked (eager PyTorch) and
compiled (C++, `ops/kernels.py`) Mamba-1 selective scan (with two reference bounds for the
chunked one) and Mamba-2 SSD.

Batch 1, d_inner 384, d_state 16 (a Mamba-1 block of a ~135M model), T in 256, 1024, 4096:
forward, and forward + backward (gradients w.r.t. u, delta, A, B, C), median of a few
repeats after a warm-up. Two estimates, both from rates measured in the same run
(docs/scan.md explains them):

* matmul bound: the FLOPs of the scan written as chunked matmuls (the log-space form, 16
  steps per chunk) at this machine's sgemm rate: the time if it were matmul-bound and
  its elementwise work (exp, products, sums) were free;
* pass floor: the number of full elementwise passes over the [T, N, D] state values
  that chunked.py makes, times the measured time of one multiply pass: the time if
  eager PyTorch had no per-op overhead.

SSD (`--parts ssd`): batch 1, 9 heads x head dim 64 x state 64, B shared by groups of three
heads (3 groups, C per head): the mamba2 mixer of a fully replaced SmolLM2-135M layer
(9 query heads, 3 KV heads, head_dim 64); chunk 64; forward, and forward + backward
(gradients w.r.t. x, dt, A, B, C). Its matmul bound counts the chunked form's four
matmuls per chunk (the backward as twice the forward).

Writes docs/results/scan.json (the selective scan at the top level, the SSD under "ssd")
and docs/results/scan.png; parts not measured in a run are kept from the existing file.

The compiled kernels are built (or found in the build cache) before anything is timed;
without them (no compiler, or RECURFORMER_KERNELS=torch) the compiled columns are left out.

    python -m benchmarks.speed.scan [--parts selective,ssd] [--lengths 256,1024,4096] [--repeats 5] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from recurformer.files import write_json_atomic
from recurformer.ops import kernels
from recurformer.ops.selective_scan import chunked as chunked_module
from recurformer.ops.selective_scan import (
    selective_scan_chunked,
    selective_scan_compiled,
    selective_scan_naive,
)
from recurformer.ops.ssd import ssd_chunked, ssd_compiled, ssd_naive
from recurformer.ops.ssd.chunked import DEFAULT_CHUNK as SSD_CHUNK

from benchmarks.common import RESULTS

CHANNELS, N_STATE = 384, 16

SSD_HEADS, SSD_GROUPS, SSD_HEAD_DIM, SSD_STATE = 9, 3, 64, 64

KEYS = {
    "length": "sequence length T (batch 1, d_inner 384, d_state 16)",
    "naive_fwd_ms": "selective_scan_naive forward, median wall time in ms",
    "chunked_fwd_ms": "selective_scan_chunked forward, median wall time in ms",
    "naive_fwdbwd_ms": "naive forward + backward (grads of u, delta, A, B, C), median ms",
    "chunked_fwdbwd_ms": "chunked forward + backward, median ms",
    "naive_fwdbwd_repeats": "timed repeats behind naive_fwdbwd_ms (1 when it is slow)",
    "fwd_speedup": "naive_fwd_ms / chunked_fwd_ms",
    "fwdbwd_speedup": "naive_fwdbwd_ms / chunked_fwdbwd_ms",
    "matmul_gflop_fwd": "FLOPs of the scan as chunked matmuls (log-space form, 16-step chunks), forward",
    "matmul_gflop_fwdbwd": "the same for forward + backward",
    "matmul_bound_fwd_ms": "matmul_gflop_fwd at sgemm_gflops: the matmul-bound estimate of the forward",
    "matmul_bound_fwdbwd_ms": "matmul_gflop_fwdbwd at sgemm_gflops",
    "pass_floor_fwd_ms": "FWD_PASSES full passes over [T, N, D] at multiply_pass_ns per element",
    "pass_floor_fwdbwd_ms": "(FWD_PASSES + BWD_PASSES) passes, likewise",
    "fwd_over_matmul_bound": "chunked_fwd_ms / matmul_bound_fwd_ms (the target was <= 3)",
    "fwdbwd_over_matmul_bound": "chunked_fwdbwd_ms / matmul_bound_fwdbwd_ms",
    "fwd_over_pass_floor": "chunked_fwd_ms / pass_floor_fwd_ms",
    
        "compiled_fwd_ms": "selective_scan_compiled forward (C++ kernel), median wall time in ms",
        "compiled_fwdbwd_ms": "compiled forward + backward, median ms",
        "compiled_fwd_speedup": "naive_fwd_ms / compiled_fwd_ms (the target was >= 20)",
        "compiled_fwdbwd_speedup": "naive_fwdbwd_ms / compiled_fwdbwd_ms",
        "compiled_over_chunked_fwd": "chunked_fwd_ms / compiled_fwd_ms",
        "compiled_over_chunked_fwdbwd": "chunked_fwdbwd_ms / compiled_fwdbwd_ms"
    ,
}


SSD_KEYS = {
    "length": "sequence length T (batch 1, 9 heads, head dim 64, state 64, B in 3 groups)",
    "naive_fwd_ms": "ssd_naive forward, median wall time in ms",
    "chunked_fwd_ms": "ssd_chunked forward (chunk 64), median wall time in ms",
    "naive_fwdbwd_ms": "naive forward + backward (grads of x, dt, A, B, C), median ms",
    "chunked_fwdbwd_ms": "chunked forward + backward, median ms",
    "naive_fwdbwd_repeats": "timed repeats behind naive_fwdbwd_ms (1 when it is slow)",
    "fwd_speedup": "naive_fwd_ms / chunked_fwd_ms",
    "fwdbwd_speedup": "naive_fwdbwd_ms / chunked_fwdbwd_ms",
    "matmul_gflop_fwd": "FLOPs of the chunked form's matmuls, forward",
    "matmul_bound_fwd_ms": "matmul_gflop_fwd at sgemm_gflops",
    "fwd_over_matmul_bound": "chunked_fwd_ms / matmul_bound_fwd_ms",
    "compiled_fwd_ms": "ssd_compiled forward (C++ kernel), median wall time in ms",
    "compiled_fwdbwd_ms": "compiled forward + backward (states saved every 64 steps), median ms",
    "compiled_fwd_speedup": "naive_fwd_ms / compiled_fwd_ms",
    "compiled_fwdbwd_speedup": "naive_fwdbwd_ms / compiled_fwdbwd_ms",
    "compiled_over_chunked_fwd": "chunked_fwd_ms / compiled_fwd_ms",
    "compiled_over_chunked_fwdbwd": "chunked_fwdbwd_ms / compiled_fwdbwd_ms",
}


def inputs(length: int, requires_grad: bool = False) -> list[torch.Tensor]:
    """Mamba-1 style inputs: A = -(1..N) per channel (S4D-real init), delta ~ softplus, dt in [1e-3, 0.1]."""
    g = torch.Generator().manual_seed(0)
    dt = torch.exp(math.log(1e-3) + torch.rand(CHANNELS, generator=g) * math.log(100.0))
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus: softplus(dt_bias) = dt
    u = torch.randn(1, length, CHANNELS, generator=g)
    delta = F.softplus(0.5 * torch.randn(1, length, CHANNELS, generator=g) + dt_bias)
    A = -torch.arange(1, N_STATE + 1, dtype=torch.float32).repeat(CHANNELS, 1)
    B = torch.randn(1, length, N_STATE, generator=g)
    C = torch.randn(1, length, N_STATE, generator=g)
    return [t.requires_grad_(requires_grad) for t in (u, delta, A, B, C)]


def ssd_inputs(length: int, requires_grad: bool = False) -> list[torch.Tensor]:
    """Mamba-2 style inputs: A = -uniform(1, 16) per head, dt ~ softplus around a log-uniform dt in [1e-3, 0.1]."""
    g = torch.Generator().manual_seed(0)
    dt = torch.exp(math.log(1e-3) + torch.rand(SSD_HEADS, generator=g) * math.log(100.0))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    x = torch.randn(1, length, SSD_HEADS, SSD_HEAD_DIM, generator=g)
    delta = F.softplus(0.5 * torch.randn(1, length, SSD_HEADS, generator=g) + dt_bias)
    A = -(1.0 + 15.0 * torch.rand(SSD_HEADS, generator=g))
    B = torch.randn(1, length, SSD_GROUPS, SSD_STATE, generator=g)
    C = torch.randn(1, length, SSD_HEADS, SSD_STATE, generator=g)
    return [t.requires_grad_(requires_grad) for t in (x, delta, A, B, C)]


def ssd_matmul_gflop(length: int, chunk: int = SSD_CHUNK) -> float:
    """Forward FLOPs of the chunked SSD's matmuls, per head and chunk of l steps: C B^T
    (2 l^2 N), its masked product with dt x (2 l^2 P), the chunk state (2 l P N) and the
    inter-chunk output (2 l N P)."""
    per_step = 2 * chunk * SSD_STATE + 2 * chunk * SSD_HEAD_DIM + 4 * SSD_HEAD_DIM * SSD_STATE
    return per_step * length * SSD_HEADS / 1e9


def median_ms(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def forward(scan, length: int, make_inputs=inputs):
    args = make_inputs(length)

    def run():
        with torch.no_grad():
            scan(*args)

    return run


def forward_backward(scan, length: int, make_inputs=inputs):
    args = make_inputs(length, requires_grad=True)
    weight = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(1))  # y has the shape of u / x

    def run():
        y = scan(*args)
        torch.autograd.grad((y * weight).sum(), args)

    return run


def sgemm_gflops(size: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / (median_ms(lambda: a @ b, repeats, warmup=2) * 1e-3) / 1e9


def matmul_gflop(length: int, chunk: int = 16) -> tuple[float, float]:
    """FLOPs of the scan as chunked matmuls (forward, forward + backward), in GFLOP.

    The log-space chunked form (docs/scan.md): per chunk of l steps and per state, one
    (l+1) x (l+1) @ (l+1) x D lower-triangular product; the backward needs three more of
    the same size (recomputation, adjoint, dL/dB). Everything else is elementwise.
    """
    per_element = 2 * (chunk + 1) ** 2 / chunk  # per element of the [T, N, D] states
    fwd = per_element * length * N_STATE * CHANNELS
    return fwd / 1e9, 4 * fwd / 1e9


# Full passes over [T, N, D] values made by chunked.py (docs/scan.md counts them):
# forward: delta*A, exp, B*du, chunk end states, states, y = C.h;
# backward: those four again, C*gy, dL/dC, two adjoint sweeps, dL/dB, dL/ddu,
# g*a*h_prev (2), dL/dA (2) and dL/ddelta (2).
FWD_PASSES, BWD_PASSES = 6, 16


def multiply_pass_ns() -> float:
    """Nanoseconds per element of one out-of-place multiply over block-sized fp32 buffers."""
    block = chunked_module._BLOCK_ELEMENTS
    a, b, out = torch.rand(block), torch.rand(block), torch.empty(block)
    return median_ms(lambda: torch.mul(a, b, out=out), 20, warmup=3) * 1e6 / block


def plot(data: dict, path: Path) -> None:
    """One row of panels (time, speed-up) per scan present in `data`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = []
    if "results" in data:
        title = f"selective scan, B 1, d_inner {CHANNELS}, d_state {N_STATE}, {data['threads']} threads"
        parts.append((data["results"], title, True))
    if "ssd" in data:
        title = f"SSD, B 1, {SSD_HEADS} heads x P {SSD_HEAD_DIM} x N {SSD_STATE}, {data['ssd']['threads']} thread(s)"
        parts.append((data["ssd"]["results"], title, False))
    fig, axes = plt.subplots(len(parts), 2, figsize=(12, 4.4 * len(parts)), squeeze=False)
    for (rows, title, pass_floor), (left, right) in zip(parts, axes):
        plot_part(rows, title, pass_floor, left, right)
    fig.suptitle("CPU, fp32, median wall time; the VM is shared, so timings are noisy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_part(rows: list[dict], title: str, pass_floor: bool, left, right) -> None:
    import matplotlib.ticker

    lengths = [r["length"] for r in rows]
    curves = [
        ("naive_fwd_ms", "naive forward", "o--"),
        ("chunked_fwd_ms", "chunked forward", "o-"),
        ("naive_fwdbwd_ms", "naive fwd+bwd", "s--"),
        ("chunked_fwdbwd_ms", "chunked fwd+bwd", "s-"),
        ("compiled_fwd_ms", "compiled forward", "D-"),
        ("compiled_fwdbwd_ms", "compiled fwd+bwd", "P-"),
        ("matmul_bound_fwd_ms", "matmul bound (fwd)", "^:"),
    ]
    if pass_floor:
        curves.append(("pass_floor_fwd_ms", "elementwise pass floor (fwd)", "v:"))
    for key, label, style in curves:
        if all(key in r for r in rows):
            left.plot(lengths, [r[key] for r in rows], style, label=label)
    left.set(xscale="log", yscale="log", xlabel="sequence length T", ylabel="ms (median)", title=title)
    left.title.set_fontsize(9)
    left.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    left.set_xticks(lengths, [str(t) for t in lengths])
    left.legend(fontsize=8)
    bars = [("fwd_speedup", "chunked forward"), ("fwdbwd_speedup", "chunked fwd+bwd"),
            ("compiled_fwd_speedup", "compiled forward"), ("compiled_fwdbwd_speedup", "compiled fwd+bwd")]
    bars = [(key, label) for key, label in bars if all(key in r for r in rows)]
    width = 0.8 / len(bars)
    xs = range(len(rows))
    for i, (key, label) in enumerate(bars):
        offset = (i - (len(bars) - 1) / 2) * width
        drawn = right.bar([x + offset for x in xs], [r[key] for r in rows], width, label=label)
        right.bar_label(drawn, fmt="%.0fx", fontsize=7)
    if pass_floor:
        right.axhline(20, color="gray", linestyle=":", label="20x target")
    right.set(yscale="log", xlabel="sequence length T", ylabel="naive / this scan (log)", title="speed-up over naive")
    right.set_yticks([1, 2, 5, 10, 20, 50, 100, 200, 500], ["1", "2", "5", "10", "20", "50", "100", "200", "500"])
    right.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    right.set_xticks(list(xs), [str(t) for t in lengths])
    right.legend(fontsize=8)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def timings(naive, chunked, compiled, length: int, make_inputs, args) -> dict:
    """Median forward and forward + backward times of the scans at one length (`compiled`
    is None when the kernels are unavailable)."""
    row = {"length": length}
    row["naive_fwd_ms"] = median_ms(forward(naive, length, make_inputs), args.repeats)
    row["chunked_fwd_ms"] = median_ms(forward(chunked, length, make_inputs), args.repeats)
    naive_fb = forward_backward(naive, length, make_inputs)
    first = median_ms(naive_fb, 1, warmup=0)  # doubles as the warm-up
    slow = first > args.slow_ms
    row["naive_fwdbwd_ms"] = first if slow else median_ms(naive_fb, args.repeats, warmup=0)
    row["naive_fwdbwd_repeats"] = 1 if slow else args.repeats
    row["chunked_fwdbwd_ms"] = median_ms(forward_backward(chunked, length, make_inputs), args.repeats)
    row["fwd_speedup"] = row["naive_fwd_ms"] / row["chunked_fwd_ms"]
    row["fwdbwd_speedup"] = row["naive_fwdbwd_ms"] / row["chunked_fwdbwd_ms"]
    if compiled is not None:
        row["compiled_fwd_ms"] = median_ms(forward(compiled, length, make_inputs), args.repeats)
        row["compiled_fwdbwd_ms"] = median_ms(forward_backward(compiled, length, make_inputs), args.repeats)
        for kind in ("fwd", "fwdbwd"):
            row[f"compiled_{kind}_speedup"] = row[f"naive_{kind}_ms"] / row[f"compiled_{kind}_ms"]
            row[f"compiled_over_chunked_{kind}"] = row[f"chunked_{kind}_ms"] / row[f"compiled_{kind}_ms"]
    return row


def show(row: dict) -> None:
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


def selective_part(lengths: list[int], args, gflops: float) -> dict:
    """The selective-scan measurements: the file's top-level fields."""
    load_before = os.getloadavg()[0]
    pass_ns = multiply_pass_ns()
    rows = []
    for length in lengths:
        compiled = selective_scan_compiled if kernels.library() is not None else None
        row = timings(selective_scan_naive, selective_scan_chunked, compiled, length, inputs, args)
        row["matmul_gflop_fwd"], row["matmul_gflop_fwdbwd"] = matmul_gflop(length)
        row["matmul_bound_fwd_ms"] = row["matmul_gflop_fwd"] / gflops * 1e3
        row["matmul_bound_fwdbwd_ms"] = row["matmul_gflop_fwdbwd"] / gflops * 1e3
        elements = length * N_STATE * CHANNELS
        row["pass_floor_fwd_ms"] = FWD_PASSES * elements * pass_ns / 1e6
        row["pass_floor_fwdbwd_ms"] = (FWD_PASSES + BWD_PASSES) * elements * pass_ns / 1e6
        row["fwd_over_matmul_bound"] = row["chunked_fwd_ms"] / row["matmul_bound_fwd_ms"]
        row["fwdbwd_over_matmul_bound"] = row["chunked_fwdbwd_ms"] / row["matmul_bound_fwdbwd_ms"]
        row["fwd_over_pass_floor"] = row["chunked_fwd_ms"] / row["pass_floor_fwd_ms"]
        rows.append(row)
        show(row)
    return {
        "description": "selective scan: naive loop vs chunked and compiled (CPU, fp32), batch 1, d_inner 384, "
                       "d_state 16",
        "keys": KEYS,
        "threads": torch.get_num_threads(),
        "chunk_size": chunked_module._DEFAULT_CHUNK,
        "sgemm_gflops": gflops,
        "sgemm_note": "median of 2048 x 2048 fp32 torch.mm, same process, same threads",
        "multiply_pass_ns": pass_ns,
        "multiply_pass_note": "ns per element of torch.mul(out=) over fp32 buffers of _BLOCK_ELEMENTS",
        "fwd_passes": FWD_PASSES,
        "bwd_passes": BWD_PASSES,
        "loadavg_1min_before": load_before,
        "loadavg_1min_after": os.getloadavg()[0],
        "results": rows,
    }


def ssd_part(lengths: list[int], args, gflops: float) -> dict:
    """The SSD measurements: the file's "ssd" field."""
    load_before = os.getloadavg()[0]
    rows = []
    for length in lengths:
        compiled = ssd_compiled if kernels.library() is not None else None
        row = timings(ssd_naive, ssd_chunked, compiled, length, ssd_inputs, args)
        row["matmul_gflop_fwd"] = ssd_matmul_gflop(length)
        row["matmul_bound_fwd_ms"] = row["matmul_gflop_fwd"] / gflops * 1e3
        row["fwd_over_matmul_bound"] = row["chunked_fwd_ms"] / row["matmul_bound_fwd_ms"]
        rows.append(row)
        show(row)
    return {
        "description": f"SSD (Mamba-2): naive loop vs chunked and compiled (CPU, fp32), batch 1, {SSD_HEADS} heads, "
                       "head dim "
                       f"{SSD_HEAD_DIM}, state {SSD_STATE}, B in {SSD_GROUPS} groups, chunk {SSD_CHUNK}",
        "keys": SSD_KEYS,
        "threads": torch.get_num_threads(),
        "chunk_size": SSD_CHUNK,
        "sgemm_gflops": gflops,
        "loadavg_1min_before": load_before,
        "loadavg_1min_after": os.getloadavg()[0],
        "results": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="selective,ssd", help="comma-separated: selective, ssd")
    parser.add_argument("--lengths", default="256,1024,4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--slow-ms", type=float, default=3000.0,
                        help="time naive fwd+bwd once only when one run takes longer than this")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", default=str(RESULTS / "scan.json"))
    args = parser.parse_args()
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - {"selective", "ssd"}:
        parser.error(f"--parts: expected selective and/or ssd, got {args.parts!r}")
    lengths = [int(t) for t in args.lengths.split(",")]
    torch.set_num_threads(args.threads or torch.get_num_threads())
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {}
    kernels.library()  # build or load the compiled kernels before anything is timed
    gflops = sgemm_gflops()
    if "selective" in parts:
        data.update(selective_part(lengths, args, gflops))
    if "ssd" in parts:
        data["ssd"] = ssd_part(lengths, args, gflops)
    data.update(torch_version=torch.__version__, cpu=cpu_name(), cpu_count=os.cpu_count(),
                compiled_kernels=kernels.library() is not None)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, data)
    plot(data, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
