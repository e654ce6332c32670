"""Mamba's initialization of the causal conv and the step size, shared by the `mamba` and
`mamba2` mixers (and their window+ kinds)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


@torch.no_grad()
def reset_conv_(weight: Tensor, bias: Tensor | None, width: int) -> None:
    """nn.Conv1d's default for a depthwise filter of `width` taps: uniform in +-1/sqrt(width)."""
    bound = 1.0 / math.sqrt(width)
    weight.uniform_(-bound, bound)
    if bias is not None:
        bias.uniform_(-bound, bound)


def initial_dt_bias(n: int, dt_min: float, dt_max: float, floor: float) -> Tensor:
    """`[n]` biases whose softplus is a step size drawn log-uniformly in [dt_min, dt_max]
    (at least `floor`), as Mamba initializes them."""
    dt = torch.exp(torch.rand(n) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))  # the inverse of softplus
