"""What a fused window step reads: the window's projections and shape, and its tail's
weights (one dataclass per tail kind). The mixers build them from their parameters; the
tensors are the parameters themselves, not copies."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..head_projections import HeadProjections


@dataclass(frozen=True)
class WindowWeights(HeadProjections):
    """The window mixer's projections (`HeadProjections`) and its ring buffer of `sinks` +
    `window` slots."""

    sinks: int
    window: int

    @property
    def slots(self) -> int:
        return self.sinks + self.window

    @property
    def scaling(self) -> float:
        return self.head_dim**-0.5


@dataclass(frozen=True)
class Mamba2Tail:
    """window+mamba2's branch, `out = window + gate * out_proj(mamba2_step(in_proj(x)))`:
    in_weight `[H P + G P + G N + H N + H, d_in]` and in_bias (or None), the parameters of
    `ops.step.mamba2_step` (G = `groups`, P = the window's head_dim), out_weight `[H D, H P]`
    and out_bias (or None), gate `[H D]`. State: `conv` and `ssm` (fp32)."""

    in_weight: Tensor
    in_bias: Tensor | None
    conv_weight: Tensor
    conv_bias: Tensor | None
    dt_bias: Tensor
    A_log: Tensor
    D: Tensor
    norm_weight: Tensor | None
    out_weight: Tensor
    out_bias: Tensor | None
    gate: Tensor
    groups: int
    eps: float


@dataclass(frozen=True)
class MambaTail:
    """window+mamba's branch, `out = window + gate * out_proj(mamba_step(in_proj(x)))`:
    in_weight `[2 Di, d_in]` and in_bias (or None), the parameters of `ops.step.mamba_step`,
    out_weight `[H D, Di]` and out_bias (or None), gate `[H D]`. State: `conv` and `ssm` (fp32)."""

    in_weight: Tensor
    in_bias: Tensor | None
    conv_weight: Tensor
    conv_bias: Tensor | None
    x_proj_weight: Tensor
    dt_proj_weight: Tensor
    dt_proj_bias: Tensor
    A_log: Tensor
    D: Tensor
    out_weight: Tensor
    out_bias: Tensor | None
    gate: Tensor


@dataclass(frozen=True)
class LinearTail:
    """window+linear's tail (mixers/window_linear.py): feature_map `[G, D, F / 2]`,
    log_alpha and gate `[H]`. State: `tail_kv` `[B, G, F, D]` and `tail_k` `[B, G, F]` (fp32)."""

    feature_map: Tensor
    log_alpha: Tensor
    gate: Tensor


Tail = Mamba2Tail | MambaTail | LinearTail | None
