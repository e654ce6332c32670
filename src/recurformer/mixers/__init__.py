"""Recurrent mixers behind one interface (`Mixer`), built by kind from a `MixerConfig`."""

from __future__ import annotations

from ..config import MixerConfig
from .base import Mixer, MixerState, ReplacedHeads
from .mamba import MambaMixer

MIXERS: dict[str, type[Mixer]] = {"mamba": MambaMixer}


def build_mixer(d_in: int, d_out: int, config: MixerConfig) -> Mixer:
    """The mixer of `config.kind` mapping `d_in` to `d_out` channels."""
    return MIXERS[config.kind](d_in, d_out, config)


__all__ = ["MIXERS", "Mixer", "MixerState", "MambaMixer", "ReplacedHeads", "build_mixer"]
