"""Mamba-1 selective scan: one entry point, several backends with one signature.

Backends (`ops/backends.py`): `naive` (fp32 loop, the oracle), `torch` (the chunked
scan, fast CPU PyTorch, autograd), `compiled` (our C++ kernel, CPU, built on first use:
`ops/kernels.py`), `cuda` (mamba-ssm's kernel, only when it imports and the tensors are on
a GPU). `auto` picks `cuda` when usable, else `compiled` when it is built and takes the
tensors (CPU, fp32 or bf16), else `torch`.
"""

from __future__ import annotations

from torch import Tensor

from ..backends import BACKENDS, pick_backend
from .chunked import selective_scan_chunked
from .compiled import selective_scan_compiled
from .cuda import cuda_available, selective_scan_cuda
from .naive import selective_scan_naive


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
    backend = pick_backend("selective scan", backend, u, delta, A, B, C, D, z, initial_state,
                           cuda=u.is_cuda and initial_state is None and cuda_available())
    kernel = {
        "naive": selective_scan_naive,
        "torch": selective_scan_chunked,
        "compiled": selective_scan_compiled,
        "cuda": selective_scan_cuda,
    }[backend]
    return kernel(u, delta, A, B, C, D, z, initial_state, return_final_state)


__all__ = [
    "BACKENDS",
    "selective_scan",
    "selective_scan_chunked",
    "selective_scan_compiled",
    "selective_scan_cuda",
    "selective_scan_naive",
]
