"""A model's keys and values stored as llama.cpp's cache types store them (`kv_quant`).

For a conversion, `store_kv_as` makes its kept heads and its window heads store what they compute
that way, in a whole-sequence forward and in each decode step alike (the compiled and static
decode paths step aside: they write the cache themselves); its recurrent state stays as it is.
For an unconverted model, `StoredKVCache` is a transformers cache whose layers store what they
are given that way: pass it as the model's cache.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from .attention import HybridAttention
from .kv_quant import check_cache_type, stored
from .mixers.window import WindowMixer
from .mixers.window_linear import WindowLinearMixer


def store_kv_as(model, cache_type: str | None):
    """Every kept and window head of the conversion `model` stores its keys and values as
    `cache_type` ("f16", "q8_0", "q4_0"; None: as computed). Returns the model."""
    for module in model.modules():
        if isinstance(module, WindowLinearMixer) and cache_type:
            raise ValueError("KV cache types: the window+linear mixer keeps its own window; convert with another kind")
        if isinstance(module, (HybridAttention, WindowMixer)):
            if cache_type:
                check_cache_type(cache_type, module.head_dim)
            module.kv_cache_type = cache_type
    return model


# llama.cpp's `llama` architecture (Llama, Mistral: its converter permutes q and k) rotates pairs of
# adjacent dimensions, where transformers rotates dimension i with i + D/2: its key rows hold the
# dimensions interleaved, so their blocks of 32 hold other numbers. Qwen2 and recurformer keep
# transformers' order.
INTERLEAVED_KEYS = ("llama", "mistral")


def interleaved(head_dim: int) -> torch.Tensor:
    """The order `[D]` of transformers' key dimensions in a row of llama.cpp's `llama` cache."""
    half = torch.arange(head_dim // 2)
    return torch.stack([half, half + head_dim // 2], dim=-1).flatten()


class StoredKVCache(DynamicCache):
    """transformers' dynamic cache, each layer's new keys and values `[B, H, T, D]` stored as
    `cache_type` before attention reads them, for the unconverted `model_type` (its keys in
    llama.cpp's order for that architecture)."""

    def __init__(self, cache_type: str, model_type: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cache_type, self.interleaved_keys = cache_type, model_type in INTERLEAVED_KEYS

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        check_cache_type(self.cache_type, key_states.shape[-1])
        if self.interleaved_keys:
            order = interleaved(key_states.shape[-1]).to(key_states.device)
            keys = stored(key_states[..., order], self.cache_type, "k")[..., order.argsort()]
        else:
            keys = stored(key_states, self.cache_type, "k")
        return super().update(keys, stored(value_states, self.cache_type, "v"), layer_idx, *args, **kwargs)
