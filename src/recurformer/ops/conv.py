"""Causal depthwise conv1d over time, for prefill and for one-token decode.

The conv state holds the `K` most recent inputs, oldest first: `[B, C, K]`. The single
step is the oracle of the full-sequence version (running it T times gives the same output).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_conv1d(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Convolve each channel with its own causal filter.

    Args:
        x: inputs `[B, T, C]`.
        weight: filters `[C, K]`; `weight[:, -1]` multiplies the current input.
        bias: `[C]` or None.
        state: the `K` inputs before `x` `[B, C, K]` (zeros if None).

    Returns:
        y `[B, T, C]` and the new state `[B, C, K]` (the last K inputs).
    """
    batch, length, channels = x.shape
    width = weight.shape[1]
    if state is None:
        state = x.new_zeros(batch, channels, width)
    history = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=2)  # [B, C, K + T]
    y = F.conv1d(history[:, :, 1:], weight.unsqueeze(1), bias, groups=channels)
    return y.transpose(1, 2), history[:, :, -width:]


def causal_conv1d_step(
    x: Tensor, weight: Tensor, bias: Tensor | None, state: Tensor
) -> tuple[Tensor, Tensor]:
    """One decode step: x `[B, C]`, state `[B, C, K]` -> y `[B, C]`, new state `[B, C, K]`.

    The sum runs in fp32 and is rounded once, as `F.conv1d` does in bf16/fp16; products
    and sum in bf16 would round K + 1 times and stray from the prefill's conv."""
    state = torch.cat([state[:, :, 1:], x.unsqueeze(2).to(state.dtype)], dim=2)
    y = (state.float() * weight.float()).sum(dim=2)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), state
