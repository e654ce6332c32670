"""Mamba-1 selective scan: one entry point, several backends with one signature.

Backends: `naive` (fp32 loop, the oracle), `chunked` (fast CPU PyTorch, autograd),
`cuda` (mamba-ssm's kernel, only when it imports and the tensors are on a GPU).
`auto` picks `cuda` when usable, else `chunked`.
"""

from __future__ import annotations

from torch import Tensor

from .chunked import selective_scan_chunked
from .cuda import cuda_available, selective_scan_cuda
from .naive import selective_scan_naive

BACKENDS = ("auto", "naive", "chunked", "cuda")


def selective_scan(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    initial_state: Tensor | None = None,
    return_final_state: bool = False,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Selective scan with shapes as in `selective_scan_naive`; `backend` picks the kernel."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown scan backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "cuda" if u.is_cuda and initial_state is None and cuda_available() else "chunked"
    kernel = {
        "naive": selective_scan_naive,
        "chunked": selective_scan_chunked,
        "cuda": selective_scan_cuda,
    }[backend]
    return kernel(u, delta, A, B, C, D, z, initial_state, return_final_state)


__all__ = [
    "BACKENDS",
    "selective_scan",
    "selective_scan_naive",
    "selective_scan_chunked",
    "selective_scan_cuda",
]
