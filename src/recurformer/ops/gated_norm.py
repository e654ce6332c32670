"""Mamba-2's output gate: `y * silu(z)`, then an RMSNorm over each head's channels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def gated_rms_norm(y: Tensor, z: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """y `[..., H, P]`, z `[..., H*P]`, weight `[H*P]` -> `[..., H*P]`: each head's
    `g = y * silu(z)` normalized by its own root mean square and scaled by `weight`;
    without `weight`, the gated `g` alone."""
    heads, head_dim = y.shape[-2:]
    g = y * F.silu(z).unflatten(-1, (heads, head_dim))
    if weight is None:
        return g.flatten(-2)
    g = g * torch.rsqrt(g.square().mean(-1, keepdim=True) + eps)
    return g.flatten(-2) * weight
