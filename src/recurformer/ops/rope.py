"""Rotary position embedding of one token, as transformers' `apply_rotary_pos_emb` applies
it: the oracles of the fused decode steps use it."""

from __future__ import annotations

import torch
from torch import Tensor


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x `[B, heads, D]`, cos and sin `[B or 1, D]` -> x cos + rotate_half(x) sin, with
    rotate_half(x) = (-x[D/2:], x[:D/2])."""
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None]
