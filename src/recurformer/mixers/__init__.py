"""Mixers behind one interface (`Mixer`), built by kind from a `MixerConfig`."""

from __future__ import annotations

from ..config import MixerConfig
from .base import HeadShape, Mixer, MixerState, PositionEmbeddings, ReplacedHeads, state_dtype
from .mamba import MambaMixer
from .mamba2 import Mamba2Mixer
from .window import WindowMixer

MIXERS: dict[str, type[Mixer]] = {"mamba": MambaMixer, "mamba2": Mamba2Mixer, "window": WindowMixer}


def build_mixer(d_in: int, heads: HeadShape, config: MixerConfig) -> Mixer:
    """The mixer of `config.kind` standing in for `heads`, reading `d_in` channels."""
    return MIXERS[config.kind](d_in, heads, config)


__all__ = [
    "MIXERS",
    "HeadShape",
    "Mamba2Mixer",
    "MambaMixer",
    "Mixer",
    "MixerState",
    "PositionEmbeddings",
    "ReplacedHeads",
    "WindowMixer",
    "build_mixer",
    "state_dtype",
]
