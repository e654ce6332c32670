"""Windowed attention in PyTorch, block by block: the `torch` backend.

Queries go in blocks of `window` steps (at least 64 on the CPU: fewer, larger ops for short
windows; at least 1024 on a GPU, where a block costs its launches more than its arithmetic).
A query at step t of a row whose real tokens are consecutive sees, among the call's
tokens, only steps (t - window, t] and the row's first `sinks` real tokens, so a block of
queries [t0, t1) needs the past, those sink tokens and steps [t0 - window + 1, t1): SDPA
over at most `S + sinks + window + block - 1` keys, never the `[T, T]` score matrix. Rows
whose padding is not all on the left are first reordered (padding first, real tokens in
order), which changes no position, and put back after.
Autograd gives the backward pass; the arithmetic is SDPA's, in the inputs' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .naive import Past, token_positions, visible

MIN_BLOCK = {"cpu": 64, "cuda": 1024}  # queries a block holds at least, by device type


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
    """Windowed attention in blocks of `max(window, MIN_BLOCK)` queries; signature and results as
    `window_attention_naive` (q `[B, T, H, D]`, k and v `[B, T, G, D]` -> `[B, T, H, D]`)."""
    batch, length, heads, dim = q.shape
    scale = dim**-0.5 if scale is None else scale
    order = None
    if mask is not None and not bool((mask[:, 1:].bool() >= mask[:, :-1].bool()).all()):
        order = torch.sort(mask.bool().int(), dim=1, stable=True).indices  # padding first, tokens in order
        q, k, v = (t.gather(1, order[:, :, None, None].expand_as(t)) for t in (q, k, v))
        mask = mask.gather(1, order)
    position = token_positions(mask, None if past is None else past[2], batch, length, q.device)
    fixed = _fixed_keys(k, v, position, sinks, past)  # the past and the call's sink tokens
    outputs = []
    block = max(window, MIN_BLOCK.get(q.device.type, MIN_BLOCK["cpu"]))
    for start in range(0, length, block):
        end, first = min(length, start + block), max(0, start - window + 1)
        keys, values, key_position = [k[:, first:end]], [v[:, first:end]], [position[:, first:end]]
        if fixed is not None:
            fixed_keys, fixed_values, fixed_position, fixed_step = fixed
            keys.insert(0, fixed_keys), values.insert(0, fixed_values)
            key_position.insert(0, fixed_position.masked_fill(fixed_step >= first, -1))  # else there twice
        key_position = torch.cat(key_position, dim=1)  # [B, K]
        query_position = position[:, start:end]
        padding = query_position < 0
        allowed = visible(query_position[:, :, None], key_position[:, None, :], window, sinks)  # [B, L, K]
        # A padding query sees only its own key, so that its (zeroed) output stays finite.
        own = torch.zeros(end - start, key_position.shape[1], dtype=torch.bool, device=q.device)
        offset = key_position.shape[1] - (end - first) + (start - first)
        own[:, offset:offset + end - start] = torch.eye(end - start, dtype=torch.bool, device=q.device)
        allowed = allowed | (own & padding[:, :, None])
        out = F.scaled_dot_product_attention(
            q[:, start:end].transpose(1, 2),
            torch.cat(keys, dim=1).to(q.dtype).transpose(1, 2),  # [B, G, K, D]
            torch.cat(values, dim=1).to(q.dtype).transpose(1, 2),
            attn_mask=allowed[:, None], scale=scale, enable_gqa=True,
        )
        outputs.append(out.transpose(1, 2).masked_fill(padding[:, :, None, None], 0.0))
    out = torch.cat(outputs, dim=1) if outputs else q.new_zeros(q.shape)
    if order is not None:
        out = torch.empty_like(out).scatter(1, order[:, :, None, None].expand_as(out), out)
    return out


def _fixed_keys(k: Tensor, v: Tensor, position: Tensor, sinks: int, past: Past | None):
    """The keys every block considers: the past's, then the call's first `sinks` real tokens
    of each row (rows left-padded). Returns keys and values `[B, S + n, G, D]`, positions
    `[B, S + n]` (-1: none) and the step of each in the call `[B, S + n]` (-1 for the past),
    or None when there are none."""
    batch, length = position.shape
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
