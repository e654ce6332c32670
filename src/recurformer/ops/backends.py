"""[ours] The kernels' backends: one set of names for every op, and the one rule `auto` follows.

- `naive`: the plain PyTorch loop, fp32, the oracle the others are tested against;
- `torch`: the fast PyTorch path (the chunked scans, the window attention in SDPA blocks,
  the decode steps' PyTorch code), autograd, any device;
- `compiled`: our C++ kernels (`ops/kernels.py`), CPU fp32 / bf16;
- `cuda`: the GPU path (mamba-ssm's scans; the `torch` code where an op has no GPU kernel
  of its own, its matmuls and SDPA then run on the GPU).

`auto` picks `cuda` where the caller says the GPU path takes the tensors, else `compiled`
where the kernels are built and take them, else `torch`. `chunked`, the scans' name for
`torch` before the names were one set, is still read (configs saved with it).
"""

from __future__ import annotations

from torch import Tensor

from . import kernels

BACKENDS = ("auto", "naive", "torch", "compiled", "cuda")
ALIASES = {"chunked": "torch"}


def canonical(backend: str) -> str:
    """`backend` under its present name (`chunked` -> `torch`)."""
    return ALIASES.get(backend, backend)


def pick_backend(op: str, backend: str, *tensors: Tensor | None, fits: bool = True, cuda: bool = False) -> str:
    """The backend that runs `op` on `tensors`: `backend` itself unless it is `auto`; then
    `cuda` when `cuda` (the caller's test that its GPU path takes these tensors), else
    `compiled` when `fits` (the caller's own conditions) and the kernels are built and take
    the tensors (`kernels.usable`), else `torch`. ValueError (one line) for an unknown name."""
    backend = canonical(backend)
    if backend not in BACKENDS:
        raise ValueError(f"unknown {op} backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    if cuda:
        return "cuda"
    return "compiled" if fits and kernels.usable(*tensors) else "torch"
