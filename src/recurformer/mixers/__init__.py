"""Mixers behind one interface (`Mixer`), built by kind from a `MixerConfig`.

Each module of this package defines one kind and registers it (`register_mixer`) with the
`MixerConfig` fields it reads; all of them are imported here, before this package hands
out `MixerConfig` (`config.py`), so adding a kind adds a module and touches nothing else.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import MIXERS, HeadShape, Mixer, MixerState, PositionEmbeddings, ReplacedHeads, register_mixer, state_dtype
from .config import (AUTO, FIELD_READERS, MIXER_KINDS, SCAN_BACKENDS, STATE_DTYPES, MixerConfig, kinds_reading,
                     parse_ssd_state, parse_window)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

from .mamba import MambaMixer  # noqa: E402  (the public classes, re-exported)
from .mamba2 import Mamba2Mixer  # noqa: E402
from .shape import resolve_for_model, resolve_shape  # noqa: E402
from .window import WindowMixer  # noqa: E402
from .window_linear import WindowLinearMixer  # noqa: E402
from .window_recurrent import WindowRecurrentMixer  # noqa: E402


def build_mixer(d_in: int, heads: HeadShape, config: MixerConfig) -> Mixer:
    """The mixer of `config.kind` standing in for `heads`, reading `d_in` channels (`auto`
    shape fields decided for `heads`, `shape.py`)."""
    return MIXERS[config.kind](d_in, heads, resolve_shape(config, heads))


__all__ = [
    "AUTO",
    "FIELD_READERS",
    "MIXERS",
    "MIXER_KINDS",
    "SCAN_BACKENDS",
    "STATE_DTYPES",
    "HeadShape",
    "Mamba2Mixer",
    "MambaMixer",
    "Mixer",
    "MixerConfig",
    "MixerState",
    "PositionEmbeddings",
    "ReplacedHeads",
    "WindowLinearMixer",
    "WindowMixer",
    "WindowRecurrentMixer",
    "build_mixer",
    "kinds_reading",
    "parse_ssd_state",
    "parse_window",
    "register_mixer",
    "resolve_for_model",
    "resolve_shape",
    "state_dtype",
]
