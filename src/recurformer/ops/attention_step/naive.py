"""The kept heads' decode step in plain PyTorch, one row and one head at a time: the oracle
of `attention_step/compiled.py`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..head_projections import HeadProjections
from ..rope import rotate


@dataclass(frozen=True)
class AttentionWeights(HeadProjections):
    """The kept heads' projections (`HeadProjections`), their scores scaled by `scaling`."""

    scaling: float


def attention_step_naive(x: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, length: int,
                         weights: AttentionWeights, starts: Tensor | None = None) -> Tensor:
    """One token through the kept heads.

    Args:
        x: the layer's normalized hidden state `[B, d_in]`.
        cos, sin: the token's rotary embedding `[B or 1, D]`.
        keys, values: the K/V cache buffers `[B, G, capacity, D]` (activations' dtype); the
            token's rotated key and its value are written to slot `length - 1`, and the
            query attends over slots `[0, length)`.
        weights: the projections.
        starts: None, or `[B]` slots from which each row attends instead of 0 (left padding).

    Returns:
        The heads' attention output `[B, H D]` in the dtype of `x`.
    """
    batch, heads, groups, dim = x.shape[0], weights.heads, weights.kv_heads, weights.head_dim
    q = rotate(F.linear(x, weights.q_weight, weights.q_bias).view(batch, heads, dim), cos, sin)
    k = rotate(F.linear(x, weights.k_weight, weights.k_bias).view(batch, groups, dim), cos, sin)
    v = F.linear(x, weights.v_weight, weights.v_bias).view(batch, groups, dim)
    keys[:, :, length - 1], values[:, :, length - 1] = k.to(keys.dtype), v.to(values.dtype)
    out = torch.empty(batch, heads, dim, dtype=torch.float32)
    for b in range(batch):
        for h in range(heads):
            g = h // (heads // groups)
            start = 0 if starts is None else int(starts[b])
            scores = (keys[b, g, start:length].float() @ q[b, h].float()) * weights.scaling
            out[b, h] = scores.softmax(-1) @ values[b, g, start:length].float()
    return out.reshape(batch, heads * dim).to(x.dtype)
