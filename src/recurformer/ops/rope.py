"""Rotary position embedding of one token, as transformers' `apply_rotary_pos_emb` applies
it: in PyTorch (`rotate`: the oracles of the fused decode steps, and the decode steps off
the GPU), and inside our Triton decode kernels (`rotate_in_kernel`), which rotate a query
or key as they load it, so that a GPU step launches no kernels of its own for RoPE."""

from __future__ import annotations

import torch
from torch import Tensor

from .triton_kernels import triton

if triton is not None:
    import triton.language as tl

Rotary = tuple[Tensor, Tensor]  # one token's (cos, sin), each `[B or 1, D]`


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x `[B, heads, D]`, cos and sin `[B or 1, D]` -> x cos + rotate_half(x) sin, with
    rotate_half(x) = (-x[D/2:], x[:D/2])."""
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None]


def row_stride(rotary: Rotary) -> int:
    """How far apart two rows' (cos, sin) lie: 0 where one row serves the whole batch. Both
    must be contiguous rows of `D`, as the kernels read them."""
    cos, sin = rotary
    if cos.shape != sin.shape or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError(f"rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be alike rows of D")
    return 0 if cos.shape[0] == 1 else cos.stride(0)


if triton is not None:

    @triton.jit
    def rotate_in_kernel(x, partner, d, dim, cos_ptr, sin_ptr, mask):
        """x rotated (fp32): `x` the values at head offsets `d` (any shape), `partner` those at
        `(d + dim / 2) % dim` of the same heads, cos and sin pointing at the row's `[D]`."""
        cos = tl.load(cos_ptr + d, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + d, mask=mask, other=0.0).to(tl.float32)
        half_turn = tl.where(d < dim // 2, -partner.to(tl.float32), partner.to(tl.float32))
        return x.to(tl.float32) * cos + half_turn * sin
