"""Mamba-2's output gate: `y * silu(z)`, then an RMSNorm over each head's channels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def gated_rms_norm(y: Tensor, z: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """y `[..., H, P]`, z `[..., H*P]`, weight `[H*P]` -> `[..., H*P]`: each head's
    `g = y * silu(z)` normalized by its own root mean square and scaled by `weight`;
    without `weight`, the gated `g` alone.

    Computed in fp32 and rounded once to y's dtype (as Mamba-2's gated RMSNorm): in bf16,
    torch's rsqrt rounds differently for a sequence and for one token, so a decode step
    would differ from the prefill in a quarter of the channels."""
    heads, head_dim = y.shape[-2:]
    g = y.float() * F.silu(z.float()).unflatten(-1, (heads, head_dim))
    if weight is not None:
        g = g * torch.rsqrt(g.square().mean(-1, keepdim=True) + eps) * weight.float().unflatten(-1, (heads, head_dim))
    return g.flatten(-2).to(y.dtype)
