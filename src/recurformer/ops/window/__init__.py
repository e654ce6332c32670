"""Windowed softmax attention (the `window` mixers' and the ablation scorer's): one entry
point, several backends with one signature.

Backends (`ops/backends.py`): `naive` (one masked softmax over every key in fp32, the
oracle), `torch` (blocks of `window` queries in one SDPA call, autograd), `compiled` (our C++ kernel
with a hand-written backward pass, CPU, built on first use: `ops/kernels.py`), `cuda` (the
`torch` blocks, whose SDPA runs the GPU's attention kernels). `auto` picks `cuda` for GPU
tensors, else `compiled` when it is built and takes the tensors (CPU, fp32 or bf16), else
`torch`.
"""

from __future__ import annotations

from torch import Tensor

from ..backends import BACKENDS, pick_backend
from .blockwise import window_attention_blockwise
from .compiled import window_attention_compiled
from .naive import Past, token_positions, visible, window_attention_naive


def window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    sinks: int,
    scale: float | None = None,
    mask: Tensor | None = None,
    past: Past | None = None,
    backend: str = "auto",
) -> Tensor:
    """Windowed attention with shapes as in `window_attention_naive`: q `[B, T, H, D]`, k and
    v `[B, T, G, D]`, mask `[B, T]` or None, past (keys, values `[B, S, G, D]`, index
    `[B, S]`) or None -> `[B, T, H, D]`; `backend` picks the kernel."""
    tensors = (q, k, v) if past is None else (q, k, v, past[0], past[1])
    backend = pick_backend("window attention", backend, *tensors, cuda=q.is_cuda)
    kernel = {"naive": window_attention_naive, "torch": window_attention_blockwise, "cuda": window_attention_blockwise,
              "compiled": window_attention_compiled}[backend]
    return kernel(q, k, v, window, sinks, scale, mask, past)


__all__ = ["BACKENDS", "Past", "token_positions", "visible", "window_attention", "window_attention_blockwise",
           "window_attention_compiled", "window_attention_naive"]
