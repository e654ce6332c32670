"""The `window` rival of a converted model at equal cache bytes.

A converted model holds, for its replaced KV groups, a state of fixed size: a recurrent
state, a window's ring buffer of keys and values, or both. The simplest rival keeps the
same groups and replaces them, training-free, by a plain `window` mixer (the heads' own
attention over sinks + the last tokens) whose ring buffer holds as many bytes. A converted
model is only worth its training where it beats that window. `equal_cache_window` finds
the window; `window_baseline` builds the rival.
"""

from __future__ import annotations

import torch

from .cache import CACHE_ARGUMENT
from .config import ReplacementSpec
from .device import model_device
from .mixers import MixerConfig
from .surgery import convert


@torch.no_grad()
def mixer_state_bytes(model) -> int:
    """Bytes of the replaced groups' state in `model`'s cache (batch 1). Every mixer allocates
    its state whole on first use, so a two-token forward shows its size at any length."""
    cache = model(torch.zeros(1, 2, dtype=torch.long, device=model_device(model)), use_cache=True)[CACHE_ARGUMENT]
    return cache.nbytes()["mixer_state"]


def _window(converted, window: int) -> MixerConfig:
    """A `window` mixer of `window` tokens with the converted model's sinks (the default
    sinks if it has no window)."""
    mixer = MixerConfig.from_dict(converted.config.mixer)
    sinks = mixer.sinks if mixer.has_window else MixerConfig.sinks
    return MixerConfig(kind="window", window=window, sinks=sinks)


def equal_cache_window(original, converted) -> int:
    """The window (tokens, besides the sinks) of a `window` mixer on `converted`'s replaced
    groups whose state holds as many bytes as `converted`'s (at least 1)."""
    spec = ReplacementSpec.from_dict(converted.config.replacement)
    target = mixer_state_bytes(converted)
    small, large = (mixer_state_bytes(convert(original, spec, _window(converted, w))) for w in (64, 128))
    per_token = (large - small) / 64
    return max(1, 64 + round((target - small) / per_token))


def window_baseline(original, converted, window: int | None = None):
    """`(model, window)`: the training-free `window` conversion of `original` on the groups
    `converted` replaced, at `converted`'s cache bytes (`window`: that window, if already
    known from `equal_cache_window`)."""
    window = equal_cache_window(original, converted) if window is None else window
    spec = ReplacementSpec.from_dict(converted.config.replacement)
    return convert(original, spec, _window(converted, window), init="reuse",
                   source_model=converted.config.source_model), window
