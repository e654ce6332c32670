"""Windowed attention in PyTorch, all blocks in one SDPA call: the `torch` backend.

Queries are cut into blocks of `block = window` steps. A query at step t of a row whose real
tokens are consecutive sees, among the call's tokens, only steps (t - window, t] and the
row's first `sinks` real tokens, so a block of queries [t0, t0 + block) needs only its own
steps, the block before it, the past and those sink tokens: each block's keys are laid out
as `[past and sinks, block before, own block]`, and one SDPA call over a batch of blocks
attends every query to at most `S + sinks + 2 block` keys, never the `[T, T]` score matrix.
The number of operations does not grow with the length (on a GPU each is a kernel launch).
Rows whose padding is not all on the left are first reordered (padding first, real tokens in
order), which changes no position, and put back after.
Autograd gives the backward pass; the arithmetic is SDPA's, in the inputs' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .naive import Past, token_positions, visible


def window_attention_blockwise(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    sinks: int,
    scale: float | None = None,
    mask: Tensor | None = None,
    past: Past | None = None,
) -> Tensor:
    """Windowed attention in blocks of `window` queries, one SDPA call for all; signature and
    results as `window_attention_naive` (q `[B, T, H, D]`, k and v `[B, T, G, D]` -> `[B, T, H, D]`)."""
    batch, length, _, dim = q.shape
    if length == 0:
        return q.new_zeros(q.shape)
    scale = dim**-0.5 if scale is None else scale
    order = None
    if mask is not None and not bool((mask[:, 1:].bool() >= mask[:, :-1].bool()).all()):
        order = torch.sort(mask.bool().int(), dim=1, stable=True).indices  # padding first, tokens in order
        q, k, v = (t.gather(1, order[:, :, None, None].expand_as(t)) for t in (q, k, v))
        mask = mask.gather(1, order)
    position = token_positions(mask, None if past is None else past[2], batch, length, q.device)
    block = window
    blocks = -(-length // block)
    tail = blocks * block - length  # steps added at the end: padding queries, dropped after

    def banded(t: Tensor, fill: float = 0.0) -> tuple[Tensor, Tensor]:
        """`[B, T, ...]` -> the block before each block and the block itself, each `[B, blocks, block, ...]`."""
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (block, tail), value=fill).unflatten(1, (blocks + 1, block))
        return t[:, :-1], t[:, 1:]

    keys, values, key_position = banded(k.to(q.dtype)), banded(v.to(q.dtype)), banded(position, -1)
    query_position = key_position[1]  # [B, n, b]
    fixed = _fixed_keys(k, v, position, sinks, past)  # the past and the call's sink tokens
    if fixed is not None:
        fixed_keys, fixed_values, fixed_position, fixed_step = fixed
        first = ((torch.arange(blocks, device=q.device) - 1) * block).clamp(min=0)  # each block's first key step
        fixed_position = fixed_position[:, None].masked_fill(fixed_step[:, None] >= first[:, None], -1)  # else twice
        fixed_keys, fixed_values = (t.to(q.dtype)[:, None].expand(-1, blocks, *t.shape[1:]) for t in (fixed_keys, fixed_values))
        keys, values = (fixed_keys, *keys), (fixed_values, *values)
        key_position = (fixed_position, *key_position)
    # Each block's keys: [past and sinks,] the block before, its own: [B, n, K, ...]
    keys, values, key_position = (torch.cat(parts, dim=2) for parts in (keys, values, key_position))
    padding = query_position < 0  # [B, n, b]
    allowed = visible(query_position[..., None], key_position[:, :, None], window, sinks)  # [B, n, b, K]
    # A padding query sees only its own key, so that its (zeroed) output stays finite.
    own = torch.zeros(block, key_position.shape[-1], dtype=torch.bool, device=q.device)
    own[:, -block:] = torch.eye(block, dtype=torch.bool, device=q.device)
    allowed = allowed | (own & padding[..., None])
    queries = F.pad(q, (0, 0, 0, 0, 0, tail)).unflatten(1, (blocks, block))  # [B, n, b, H, D]
    out = F.scaled_dot_product_attention(
        queries.flatten(0, 1).transpose(1, 2),  # [B n, H, b, D]
        keys.flatten(0, 1).transpose(1, 2),  # [B n, G, K, D]
        values.flatten(0, 1).transpose(1, 2),
        attn_mask=allowed.flatten(0, 1)[:, None], scale=scale, enable_gqa=True,
    )
    out = out.transpose(1, 2).unflatten(0, (batch, blocks)).masked_fill(padding[..., None, None], 0.0)
    out = out.flatten(1, 2)[:, :length]
    if order is not None:
        out = torch.empty_like(out).scatter(1, order[:, :, None, None].expand_as(out), out)
    return out


def _fixed_keys(k: Tensor, v: Tensor, position: Tensor, sinks: int, past: Past | None):
    """The keys every block considers: the past's, then the call's first `sinks` real tokens
    of each row (rows left-padded). Returns keys and values `[B, S + n, G, D]`, positions
    `[B, S + n]` (-1: none) and the step of each in the call `[B, S + n]` (-1 for the past),
    or None when there are none."""
    length = position.shape[1]
    parts = []
    if past is not None:
        step = torch.full_like(past[2], -1)
        parts.append((past[0], past[1], past[2], step))
    count = min(sinks, length)
    if count:
        real = (position >= 0).sum(dim=1, keepdim=True)  # [B, 1]
        i = torch.arange(count, device=k.device)
        step = (length - real + i).clamp(max=length - 1)  # [B, n]; left padding: tokens start at T - real
        first_position = position.gather(1, (length - real).clamp(max=length - 1))  # [B, 1]
        sink_position = torch.where((i < real) & (first_position + i < sinks), first_position + i, -1)
        gather = step[:, :, None, None].expand(-1, -1, *k.shape[2:])
        parts.append((k.gather(1, gather), v.gather(1, gather), sink_position, step))
    if not parts:
        return None
    return tuple(torch.cat([part[i].to(parts[-1][i].dtype) for part in parts], dim=1) for i in range(4))
