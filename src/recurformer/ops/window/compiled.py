"""Compiled CPU windowed attention (`ops/csrc/window_attention.cpp`) behind the oracle's signature.

Work items are (batch row, KV group, block of 64 steps): the group's query heads at those
steps against only the keys they can see (the past, the row's sinks, the window before
the block), gathered once per item; each block of four rows computes its scores over the
keys its own queries see, in fp32, with register-blocked products. The forward pass saves
each row's log-sum-exp; the backward pass (written by hand) recomputes the probabilities
from it and accumulates the key and value gradients per thread. fp32 or bf16 inputs, fp32
arithmetic. See docs/scan.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import kernels
from .naive import Past, token_positions

_OP = "window_attention"


def window_attention_compiled(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    sinks: int,
    scale: float | None = None,
    mask: Tensor | None = None,
    past: Past | None = None,
) -> Tensor:
    """Windowed attention with the compiled kernel; same signature and results as
    `window_attention_naive`.

    Args:
        q `[B, T, H, D]`, k and v `[B, T, G, D]`, mask `[B, T]`, past (keys, values
        `[B, S, G, D]`, index `[B, S]`): as in `window_attention_naive`; q, k, v and the
        past's keys and values fp32 or bf16 CPU tensors.

    Returns:
        `[B, T, H, D]` in the dtype of q.

    Raises:
        RuntimeError when the kernels are unavailable; TypeError / ValueError (one line,
        naming the argument) for a tensor of the wrong dtype, device or shape, or a bad
        window or sinks.
    """
    lib = kernels.require(_OP)
    _check(q, k, v, window, sinks, mask, past)
    batch, length, heads, dim = q.shape
    scale = dim**-0.5 if scale is None else float(scale)
    past_index = None if past is None else past[2]
    position = token_positions(mask, past_index, batch, length, q.device).contiguous()
    past_keys, past_values = (None, None) if past is None else past[:2]
    tensors = (q, k, v, past_keys, past_values)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        out = _WindowAttention.apply(q, k, v, past_keys, past_values, position, past_index, window, sinks, scale, lib)
    else:
        out, _ = _forward(lib, q, k, v, past_keys, past_values, position, past_index, window, sinks, scale, save=False)
    return out.to(q.dtype)


def _check(q, k, v, window, sinks, mask, past) -> None:
    for name, tensor, layout in (("q", q, "[B, T, H, D]"), ("k", k, "[B, T, G, D]"), ("v", v, "[B, T, G, D]")):
        if not isinstance(tensor, Tensor) or tensor.dim() != 4:
            got = f"shape {list(tensor.shape)}" if isinstance(tensor, Tensor) else type(tensor).__name__
            raise ValueError(f"{_OP}: {name} must be a 4-d tensor {layout}, got {got}")
    batch, length, heads, dim = q.shape
    groups = k.shape[2]
    if groups < 1 or heads % groups:
        raise ValueError(f"{_OP}: {heads} query heads cannot share {groups} key/value heads evenly")
    for name, value, least in (("window", window, 1), ("sinks", sinks, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{_OP}: {name} must be an integer >= {least}, got {value!r}")
    kernels.check(_OP, "q", q, None)
    for name, tensor in (("k", k), ("v", v)):
        kernels.check(_OP, name, tensor, (batch, length, groups, dim), "[B, T, G, D]")
    if mask is not None and (not isinstance(mask, Tensor) or mask.shape != (batch, length)):
        got = list(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"{_OP}: mask must have shape {[batch, length]} [B, T], got {got}")
    if past is not None:
        keys, values, index = past
        slots = keys.shape[1] if isinstance(keys, Tensor) and keys.dim() == 4 else -1
        for name, tensor in (("past keys", keys), ("past values", values)):
            kernels.check(_OP, name, tensor, (batch, max(slots, 0), groups, dim), "[B, S, G, D]")
        if not isinstance(index, Tensor) or index.shape != (batch, slots) or index.dtype.is_floating_point:
            raise ValueError(f"{_OP}: past index must be an integer tensor of shape {[batch, slots]} [B, S]")


def _forward(lib, q, k, v, past_keys, past_values, position, past_index, window, sinks, scale, save: bool):
    """Run the forward kernel: (output in the inputs' dtype, log-sum-exp `[B, T, H]` or None)."""
    io = kernels.io_dtype(q, k, v, past_keys, past_values)
    q, k, v, past_keys, past_values = (kernels.prepare(t, io) for t in (q, k, v, past_keys, past_values))
    past_index = None if past_index is None else past_index.to(torch.int64).contiguous()
    batch, length, heads, dim = q.shape
    out = torch.empty_like(q)
    lse = q.new_empty(batch, length, heads, dtype=torch.float32) if save else None
    p = kernels.pointer
    kernels.run(
        _OP, lib.rf_window_forward, io == torch.bfloat16,
        p(q), p(k), p(v), p(past_keys), p(past_values), p(position), p(past_index), p(out), p(lse),
        batch, length, heads, k.shape[2], dim, 0 if past_keys is None else past_keys.shape[1], window, sinks, scale,
        torch.get_num_threads(),
    )
    return out, (q, k, v, past_keys, past_values, out, lse) if save else None


class _WindowAttention(torch.autograd.Function):
    """The compiled windowed attention with its hand-written backward pass."""

    @staticmethod
    def forward(ctx, q, k, v, past_keys, past_values, position, past_index, window, sinks, scale, lib):
        out, saved = _forward(lib, q, k, v, past_keys, past_values, position, past_index, window, sinks, scale, save=True)
        ctx.save_for_backward(*saved[:5], position, past_index, out, saved[6])
        ctx.has_past, ctx.settings, ctx.lib = past_keys is not None, (window, sinks, scale), lib
        return out

    @staticmethod
    def backward(ctx, gout):
        q, k, v, past_keys, past_values, position, past_index, out, lse = ctx.saved_tensors
        if not ctx.has_past:
            past_keys = past_values = past_index = None
        window, sinks, scale = ctx.settings
        batch, length, heads, dim = q.shape
        groups, slots = k.shape[2], 0 if past_keys is None else past_keys.shape[1]
        threads = torch.get_num_threads()
        gout = gout.to(q.dtype).contiguous()
        f32 = {"dtype": torch.float32}
        dq = torch.empty(q.shape, **f32)
        dk, dv = (torch.zeros(threads, batch, length, groups, dim, **f32) for _ in range(2))
        dpk, dpv = (None, None) if past_keys is None else (torch.zeros(threads, batch, slots, groups, dim, **f32) for _ in range(2))
        p = kernels.pointer
        kernels.run(
            _OP, ctx.lib.rf_window_backward, q.dtype == torch.bfloat16,
            p(q), p(k), p(v), p(past_keys), p(past_values), p(position), p(past_index), p(out), p(gout), p(lse),
            p(dq), p(dk), p(dv), p(dpk), p(dpv),
            batch, length, heads, groups, dim, slots, window, sinks, scale, threads,
        )
        grads = (dq, dk.sum(0), dv.sum(0), None if dpk is None else dpk.sum(0), None if dpv is None else dpv.sum(0))
        return *(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), *(None,) * 6
