"""[ours] The default shape of a mixer: `auto` fields decided by the heads' geometry.

Every window kind holds, by default, the same cache bytes per replaced KV group: the
**budget**, the state of `window+mamba2` with a window of `BUDGET_WINDOW` = 64 tokens (and
the config's sinks) and a full Mamba-2 tail (`ssd_state` = head_dim), the library's first
shape. A kind's `auto` window is the window whose state, with that kind's own tail, comes
nearest to the budget. For a group of `g` query heads of `D` channels, fp32, a conv of
width `k` and `s` sinks, a ring-buffer slot costs `8 D + 8` bytes (key, value and position)
and a Mamba-2 tail of `N` values per head `4 g D N + 4 k (D + N + g N)` bytes, so:

    ssd_state = D / 4                                        (window+mamba2; mamba2 alone: D)
    window    = 64 + round((tail(D) - tail(D / 4)) / (8 D + 8))     (window+mamba2)
    window    = 64 + round(tail(D) / (8 D + 8))                     (window: no tail)

On SmolLM2-135M (D = 64, g = 3, k = 4, s = 4) that is the shape measured best at these bytes
(docs/mixers.md, "Window or state"): window+mamba2 with window 141 and 16 state values per
head; the plain window gets 168. The bytes are counted by allocating the state on the meta
device, so every kind (window+mamba, window+linear) follows the same rule with its own tail.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .base import MIXERS, HeadShape
from .config import AUTO, MixerConfig

BUDGET_WINDOW = 64


def state_bytes(config: MixerConfig, heads: HeadShape) -> int:
    """Bytes of the decoding state of a mixer of `config` (resolved) for `heads`, batch 1, fp32."""
    with torch.device("meta"):
        mixer = MIXERS[config.kind](heads.d_out, heads, config)
        state = mixer.allocate_state(1, torch.float32, "meta")
    return sum(t.numel() * t.element_size() for t in state.values())


def budget_bytes(config: MixerConfig, heads: HeadShape) -> int:
    """The default cache budget of `heads`: window+mamba2 with a 64-token window, the
    config's sinks and a full tail (ssd_state = head_dim)."""
    return state_bytes(replace(config, kind="window+mamba2", window=BUDGET_WINDOW, ssd_state="head_dim"), heads)


def resolve_shape(config: MixerConfig, heads: HeadShape) -> MixerConfig:
    """`config` with its `auto` fields decided for replaced heads of `heads`' geometry (any
    number of groups: the rule is per KV group); a resolved config comes back unchanged."""
    if config.resolved:
        return config
    group = HeadShape(heads.group_size, 1, heads.head_dim, heads.qkv_bias)
    if config.reads("ssd_state") and config.ssd_state == AUTO:
        config = replace(config, ssd_state=config.resolved_ssd_state(heads.head_dim))
    if config.reads("window") and config.window == AUTO:
        one, two = (state_bytes(replace(config, window=w), group) for w in (1, 2))
        config = replace(config, window=max(1, 1 + round((budget_bytes(config, group) - one) / (two - one))))
    return config


def resolve_for_model(config: MixerConfig, text_config) -> MixerConfig:
    """`resolve_shape` for the KV groups of a Hugging Face (text) model config."""
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    group_size = text_config.num_attention_heads // text_config.num_key_value_heads
    return resolve_shape(config, HeadShape(group_size, 1, head_dim))
