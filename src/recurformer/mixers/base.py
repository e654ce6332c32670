"""The interface every mixer shares. The attention layer and the cache know only this.

A mixer is built as `Mixer(d_in, heads, config)` from the geometry of the heads it stands
in for (`HeadShape`) and maps a layer's normalized hidden states `[B, T, d_in]` to those
heads' channels `[B, T, d_out]`, `d_out = heads.num_q_heads * heads.head_dim`. Its
decoding state is a dict of fixed-size tensors, allocated by `allocate_state` and updated
in place by `forward` (prefill) and `step` (one token). Every call receives the rotary
`position_embeddings` the attention layer received; mixers without positions ignore them.

Precision policy (docs/precision.md): a state that accumulates over tokens (an SSM state)
is allocated in `state_dtype(config)` (fp32 by default) and updated in fp32 whatever the
activations' dtype; a state that only stores past inputs (a conv window, keys and values)
is allocated in the activations' dtype, like the kept heads' KV cache. Outputs are cast
back to the activations' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

from .config import FIELD_READERS, MIXER_KINDS, MixerConfig

MixerState = dict[str, Tensor]
PositionEmbeddings = tuple[Tensor, Tensor]


def state_dtype(config: MixerConfig) -> torch.dtype:
    """The dtype a mixer of `config` keeps its accumulated recurrent state in."""
    return getattr(torch, config.state_dtype)


@dataclass(frozen=True)
class HeadShape:
    """The replaced heads of one layer, which a mixer stands in for.

    `num_q_heads` query heads of `head_dim` channels read `num_kv_heads` KV heads (query
    head `i` reads KV head `i // group_size`); `qkv_bias`: their q/k/v projections carry
    biases (Qwen2). The mixer emits `num_q_heads * head_dim` channels.
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        if min(self.num_q_heads, self.num_kv_heads, self.head_dim) < 1 or self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"head shape: need positive sizes and num_q_heads a multiple of num_kv_heads, got "
                f"num_q_heads={self.num_q_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
            )

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def d_out(self) -> int:
        return self.num_q_heads * self.head_dim


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
    """Base class: subclasses take `(d_in, heads: HeadShape, config: MixerConfig)` and
    implement `forward`, `step`, `allocate_state`, `reset_parameters` and `init_from_heads`.

    `reads`: the `MixerConfig` fields the kind reads (the command line refuses a value for
    any other, and the docs list the readers of each field from these). `recipe`: the name
    of the recipe `recurformer run` trains the kind with (`recipe.RECIPES`); None for a kind
    with nothing to train, which `run` refuses.
    """

    kind: str
    reads: frozenset[str] = frozenset()
    recipe: str | None = "mixers"
    d_in: int
    d_out: int

    def forward(
        self,
        x: Tensor,
        state: MixerState | None = None,
        attention_mask: Tensor | None = None,
        position_embeddings: PositionEmbeddings | None = None,
    ) -> Tensor:
        """x `[B, T, d_in]` -> `[B, T, d_out]`.

        `state`, if given, is the state before `x`; it is overwritten with the state after
        `x`. `attention_mask` `[B, T]` (1 = token, 0 = padding): padding leaves the state as
        it was, so a left-padded row gives the same outputs as the row alone.
        `position_embeddings`: the model's rotary `(cos, sin)`, each `[B or 1, T, head_dim]`.
        """
        raise NotImplementedError

    def step(self, x: Tensor, state: MixerState, position_embeddings: PositionEmbeddings | None = None) -> Tensor:
        """One decode step: x `[B, d_in]` -> `[B, d_out]`, `state` updated in place;
        `position_embeddings` as in `forward`, with T = 1."""
        raise NotImplementedError

    def allocate_state(self, batch: int, dtype, device) -> MixerState:
        """A fresh state for `batch` sequences (the state before any token). `dtype` is the
        activations' dtype, for buffers of past inputs; accumulators use `state_dtype(config)`."""
        raise NotImplementedError

    def reset_parameters(self) -> None:
        """(Re-)initialize every parameter with the mixer's own scheme."""
        raise NotImplementedError

    def init_from_heads(self, heads: ReplacedHeads) -> None:
        """Initialize what can be derived from the replaced attention heads ("reuse" init)."""
        raise NotImplementedError

    def tail_parameters(self) -> list[nn.Parameter]:
        """What the tail-training recipe trains while the rest stays frozen (`window+*`
        kinds: the part that sees beyond the window); empty for kinds without a tail."""
        return []

MIXERS: dict[str, type[Mixer]] = {}


def register_mixer(kind: str):
    """Class decorator: make a `Mixer` subclass available as `MixerConfig(kind=kind)` and
    `--mixer kind`. Every module of the mixers package is imported with the package, so a
    new kind needs only its own module."""

    def add(cls: type[Mixer]) -> type[Mixer]:
        if kind in MIXERS:
            raise ValueError(f"mixer kind {kind!r} is registered twice")
        unknown = sorted(set(cls.reads) - {f.name for f in fields(MixerConfig)} - {"kind"})
        if unknown:
            raise ValueError(f"mixer kind {kind!r} reads unknown MixerConfig field(s) {', '.join(unknown)}")
        cls.kind = kind
        MIXERS[kind] = cls
        MIXER_KINDS.append(kind)
        for name in sorted(cls.reads):
            FIELD_READERS.setdefault(name, []).append(kind)
        return cls

    return add
