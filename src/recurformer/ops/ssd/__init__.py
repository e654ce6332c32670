"""Mamba-2 SSD scan: one entry point, several backends with one signature.

Backends (`ops/backends.py`): `naive` (fp32 loop, the oracle), `torch` (the chunked,
matmul-based PyTorch scan, autograd), `compiled` (our C++ kernel, CPU, built on first use:
`ops/kernels.py`), `cuda` (mamba-ssm's kernel, else flash-linear-attention's, only when one imports and
the tensors are on a GPU). `auto` picks `cuda` when usable, else `compiled` when it is built and takes the
tensors (CPU, fp32 or bf16), else `torch`.
"""

from __future__ import annotations

from torch import Tensor

from ..backends import BACKENDS, pick_backend
from .chunked import DEFAULT_CHUNK, ssd_chunked
from .compiled import ssd_compiled
from .cuda import cuda_available, gpu_kernel, gradients_flow, ssd_cuda
from .naive import per_head, ssd_naive


def ssd(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    initial_state: Tensor | None = None,
    return_final_state: bool = False,
    backend: str = "auto",
    chunk_size: int = DEFAULT_CHUNK,
) -> Tensor | tuple[Tensor, Tensor]:
    """SSD with shapes as in `ssd_naive`; `backend` picks the kernel, `chunk_size` the
    chunk length of the chunked kernels (for `compiled`: the steps between the states it
    saves for the backward pass; the naive loop has none)."""
    tensors = (x, dt, A, B, C, D, initial_state)
    backend = pick_backend("ssd", backend, *tensors, cuda=x.is_cuda and cuda_available(x, B, gradients_flow(*tensors)))
    if backend == "naive":
        return ssd_naive(x, dt, A, B, C, D, initial_state, return_final_state)
    kernel = {"torch": ssd_chunked, "compiled": ssd_compiled, "cuda": ssd_cuda}[backend]
    return kernel(x, dt, A, B, C, D, initial_state, return_final_state, chunk_size=chunk_size)


__all__ = ["BACKENDS", "cuda_available", "gpu_kernel", "per_head", "ssd", "ssd_chunked", "ssd_compiled", "ssd_cuda", "ssd_naive"]
