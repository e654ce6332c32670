"""The oracle: windowed softmax attention as one masked softmax over every key, in fp32.

Query `i` (a real token at position `p_i` among its row's real tokens) attends to the keys
at positions

    { p_j <= p_i :  p_i - p_j < window  or  p_j < sinks }

(the last `window` tokens including itself, and the row's first `sinks` tokens). The keys
are the tokens of the call and, optionally, earlier tokens (`past`: keys, values and their
positions, e.g. a ring buffer; slots at position -1 are empty). Padding tokens
(`mask` 0) take no position and no query sees them; a padding query's output is zero.
Several query heads share a key/value head (GQA): head `h` reads group `h // (H / G)`.

Slow on purpose: a `[B, H, T, S + T]` score matrix, easy to trust.
"""

from __future__ import annotations

import torch
from torch import Tensor

Past = tuple[Tensor, Tensor, Tensor]  # keys [B, S, G, D], values [B, S, G, D], index [B, S]


def token_positions(mask: Tensor | None, past_index: Tensor | None, batch: int, length: int, device=None) -> Tensor:
    """Positions `[B, T]` (int64) of a call's tokens among their row's real tokens, -1 for
    padding: the real tokens are numbered on from the past's, `max(past_index) + 1`."""
    device = device if mask is None else mask.device
    real = torch.ones(batch, length, dtype=torch.bool, device=device) if mask is None else mask.bool()
    seen = 0 if past_index is None else past_index.max(dim=-1).values[:, None] + 1  # real tokens before, [B, 1]
    return torch.where(real, seen + real.cumsum(dim=1) - 1, -1)


def visible(query_position: Tensor, key_position: Tensor, window: int, sinks: int) -> Tensor:
    """Whether a query at `query_position` sees a key at `key_position` (broadcasting; -1: none)."""
    return ((query_position >= 0) & (key_position >= 0) & (key_position <= query_position)
            & ((query_position - key_position < window) | (key_position < sinks)))


def window_attention_naive(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    sinks: int,
    scale: float | None = None,
    mask: Tensor | None = None,
    past: Past | None = None,
) -> Tensor:
    """Windowed attention with an explicit mask, in fp32.

    Args:
        q: queries `[B, T, H, D]` (RoPE applied).
        k, v: keys and values `[B, T, G, D]`, G dividing H.
        window: tokens each query sees back, itself included (>= 1).
        sinks: first tokens of the row every query also sees (>= 0).
        scale: score scale, `D ** -0.5` if None.
        mask: `[B, T]`, nonzero for tokens, 0 for padding; None: no padding.
        past: earlier tokens `(keys [B, S, G, D], values [B, S, G, D], index [B, S])`,
            index the position of each slot's token (-1: empty); None: no earlier tokens.

    Returns:
        `[B, T, H, D]` in the dtype of q; zero at padding queries.
    """
    batch, length, heads, dim = q.shape
    groups = k.shape[2]
    scale = dim**-0.5 if scale is None else scale
    position = token_positions(mask, None if past is None else past[2], batch, length, q.device)
    keys, values, key_position = k.float(), v.float(), position
    if past is not None:
        keys = torch.cat([past[0].float(), keys], dim=1)
        values = torch.cat([past[1].float(), values], dim=1)
        key_position = torch.cat([past[2], position], dim=1)
    keys = keys.repeat_interleave(heads // groups, dim=2).transpose(1, 2)  # [B, H, S + T, D]
    values = values.repeat_interleave(heads // groups, dim=2).transpose(1, 2)
    allowed = visible(position[:, :, None], key_position[:, None, :], window, sinks)[:, None]  # [B, 1, T, S + T]
    scores = (q.float().transpose(1, 2) @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    # a padding query sees nothing: a row of -inf would give NaN, so its (zeroed) row is uniform
    scores = torch.where(allowed.any(dim=-1, keepdim=True), scores, 0.0)
    weights = scores.softmax(dim=-1) * allowed
    return (weights @ values).transpose(1, 2).to(q.dtype)
