"""The interface every mixer shares. The attention layer and the cache know only this.

A mixer maps a layer's normalized hidden states `[B, T, d_in]` to the replaced heads'
channels `[B, T, d_out]`. Its decoding state is a dict of fixed-size tensors, allocated by
`allocate_state` and updated in place by `forward` (prefill) and `step` (one token).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

MixerState = dict[str, Tensor]


@dataclass(frozen=True)
class ReplacedHeads:
    """The original projections of one layer's replaced heads, for `Mixer.init_from_heads`.

    q `[n_q, D, hidden]`, k and v `[n_kv, D, hidden]`; biases `[n, D]` or None. Query head
    `i` reads KV head `i // group_size`.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    q_bias: Tensor | None
    k_bias: Tensor | None
    v_bias: Tensor | None
    group_size: int


class Mixer(nn.Module):
    """Base class: subclasses implement `forward`, `step` and `allocate_state`."""

    d_in: int
    d_out: int

    def forward(
        self, x: Tensor, state: MixerState | None = None, attention_mask: Tensor | None = None
    ) -> Tensor:
        """x `[B, T, d_in]` -> `[B, T, d_out]`.

        `state`, if given, is the state before `x`; it is overwritten with the state after
        `x`. `attention_mask` `[B, T]` (1 = token, 0 = padding): padding leaves the state as
        it was, so a left-padded row gives the same outputs as the row alone.
        """
        raise NotImplementedError

    def step(self, x: Tensor, state: MixerState) -> Tensor:
        """One decode step: x `[B, d_in]` -> `[B, d_out]`, `state` updated in place."""
        raise NotImplementedError

    def allocate_state(self, batch: int, dtype, device) -> MixerState:
        """A fresh state for `batch` sequences (the state before any token)."""
        raise NotImplementedError

    def reset_parameters(self) -> None:
        """(Re-)initialize every parameter with the mixer's own scheme."""
        raise NotImplementedError

    def init_from_heads(self, heads: ReplacedHeads) -> None:
        """Initialize what can be derived from the replaced attention heads ("reuse" init)."""
        raise NotImplementedError
