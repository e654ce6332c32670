"""Window + recurrent tail: the replaced heads' own sliding window, plus a recurrent branch
that can add what the window forgets.

    out = window(h) + gate * recurrent(h)          # [B, T, H * D]

[ours] `window` is exactly the `window` mixer (the heads' q/k/v, RoPE, a ring buffer of
`sinks + window` tokens). `recurrent` is a `mamba` or `mamba2` mixer standing in for the
same heads (kind `window+mamba`, `window+mamba2`) that reads every token, in parallel with
the window (as Hymba's attention and SSM heads do). `gate` `[H * D]` is one scalar per
output channel, zero at initialization: a converted model starts exactly at the `window`
mixer's outputs, whatever the recurrent branch computes. The gradient of the loss with
respect to `gate` is `sum_t dL/dout_t * recurrent(h)_t`, not zero, so the first optimizer
step opens the gate, and from then on the branch itself receives gradients (a zero gate in
front of a zero projection would be stuck; the branch's `out_proj` starts as the identity,
never zero). Why every token and not only those that left the window: docs/mixers.md.

State: the window's ring buffer (`window.keys`, `window.values`, `window.index`) and the
recurrent state (`recurrent.conv`, `recurrent.ssm`), all of fixed size.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops.window_step import Mamba2Tail, MambaTail, WindowWeights
from .base import HeadShape, Mixer, MixerState, PositionEmbeddings, ReplacedHeads, register_mixer
from .config import MixerConfig
from .fused_step import compiled_step, rotary
from .mamba import MambaMixer
from .mamba2 import Mamba2Mixer
from .window import WindowMixer


class WindowRecurrentMixer(Mixer):
    """`window(h) + gate * recurrent(h)`: `[B, T, d_in] -> [B, T, H * D]`, with the window's
    ring buffer and the recurrent branch's state (see the module docstring). A subclass per
    kind names its recurrent branch (`branch`)."""

    branch: type[Mixer]
    recipe = "tail"

    def __init__(self, d_in: int, heads: HeadShape, config: MixerConfig):
        super().__init__()
        self.d_in, self.d_out, self.config = d_in, heads.d_out, config
        self.window = WindowMixer(d_in, heads, config)
        self.recurrent = self.branch(d_in, heads, config)
        self.gate = nn.Parameter(torch.zeros(self.d_out))

    def reset_parameters(self) -> None:
        self.window.reset_parameters()
        self.recurrent.reset_parameters()
        with torch.no_grad():
            self.gate.zero_()

    @torch.no_grad()
    def init_from_heads(self, heads: ReplacedHeads) -> None:
        """The window takes the heads' q/k/v unchanged; the recurrent branch takes its own
        reuse init (mamba2: C <- W_Q, B <- W_K, x <- W_V; mamba: x <- W_V), so that it starts
        as a decayed linear attention of the same heads; the gate starts at zero, so the
        model starts exactly as the `window` mixer."""
        self.window.init_from_heads(heads)
        self.recurrent.init_from_heads(heads)
        self.gate.zero_()

    def tail_parameters(self) -> list[nn.Parameter]:
        """What the tail-training recipe trains first: the recurrent branch and the gate
        (the window's projections stay frozen; docs/training.md)."""
        return [*self.recurrent.parameters(), self.gate]

    def allocate_state(self, batch: int, dtype, device) -> MixerState:
        return {
            **{f"window.{k}": t for k, t in self.window.allocate_state(batch, dtype, device).items()},
            **{f"recurrent.{k}": t for k, t in self.recurrent.allocate_state(batch, dtype, device).items()},
        }

    @staticmethod
    def _part(state: MixerState | None, prefix: str) -> MixerState | None:
        """The sub-mixer's view of `state`: the same tensors, so in-place updates land in it."""
        if state is None:
            return None
        return {k[len(prefix):]: t for k, t in state.items() if k.startswith(prefix)}

    def forward(
        self,
        x: Tensor,
        state: MixerState | None = None,
        attention_mask: Tensor | None = None,
        position_embeddings: PositionEmbeddings | None = None,
    ) -> Tensor:
        window = self.window(x, self._part(state, "window."), attention_mask, position_embeddings)
        tail = self.recurrent(x, self._part(state, "recurrent."), attention_mask, position_embeddings)
        return window + self.gate * tail

    def fused_step_parts(self) -> tuple[WindowWeights, Mamba2Tail | MambaTail]:
        """What the compiled step reads (`mixers/fused_step.py`): the window, and the
        recurrent branch as its tail with the gate."""
        return self.window.window_weights(), self.recurrent.as_tail(self.gate)

    def step(self, x: Tensor, state: MixerState, position_embeddings: PositionEmbeddings | None = None) -> Tensor:
        """One token through both branches, the states updated in place: one compiled call
        (projections, window, branch step, out_proj and gate) when the kernels are built
        (`ops/window_step`); else the two mixers' own steps."""
        kernel = None if self.window.kv_cache_type else compiled_step(self, x)
        if kernel is not None:
            names = {"keys": "window.keys", "values": "window.values", "index": "window.index",
                     "conv": "recurrent.conv", "ssm": "recurrent.ssm"}
            return kernel(x, *rotary(position_embeddings), {name: state[key] for name, key in names.items()})
        window = self.window.step(x, self._part(state, "window."), position_embeddings)
        tail = self.recurrent.step(x, self._part(state, "recurrent."), position_embeddings)
        return torch.addcmul(window, self.gate, tail)  # window + gate * tail, one kernel where it was two


@register_mixer("window+mamba")
class WindowMambaMixer(WindowRecurrentMixer):
    """The window plus a `mamba` branch."""

    branch = MambaMixer
    reads = WindowMixer.reads | MambaMixer.reads


@register_mixer("window+mamba2")
class WindowMamba2Mixer(WindowRecurrentMixer):
    """The window plus a `mamba2` branch (trained by the `tail-mamba2` recipe: the lm stage at mamba2's rate)."""

    branch = Mamba2Mixer
    reads = WindowMixer.reads | Mamba2Mixer.reads
    recipe = "tail-mamba2"
