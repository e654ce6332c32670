"""Mixers behind one interface (`Mixer`), built by kind from a `MixerConfig`."""

from __future__ import annotations

from ..config import MixerConfig
from .base import HeadShape, Mixer, MixerState, PositionEmbeddings, ReplacedHeads
from .mamba import MambaMixer
from .mamba2 import Mamba2Mixer
from .window import WindowMixer
from .window_linear import WindowLinearMixer
from .window_recurrent import WindowRecurrentMixer

MIXERS: dict[str, type[Mixer]] = {
    "mamba": MambaMixer,
    "mamba2": Mamba2Mixer,
    "window": WindowMixer,
    "window+mamba": WindowRecurrentMixer,
    "window+mamba2": WindowRecurrentMixer,
    "window+linear": WindowLinearMixer,
}


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
    "WindowLinearMixer",
    "WindowMixer",
    "WindowRecurrentMixer",
    "build_mixer",
]
