"""HybridCache: per layer, K/V of the kept KV heads plus the mixer state of the replaced ones.

Works with `model.generate()` of transformers 5.x: it is a `transformers.Cache` whose layers
are `HybridLayer`s. A layer's K/V hold only the kept heads `[B, kept_kv_heads, T, head_dim]`
(zero heads in a fully replaced layer); its mixer state has a fixed size whatever T is.
No token is evicted.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

from .mixers import Mixer, MixerState


class HybridLayer(DynamicLayer):
    """One decoder layer's cache: a growing K/V for kept heads and a fixed-size mixer state."""

    def __init__(self) -> None:
        super().__init__()
        self.mixer_state: MixerState | None = None
        self.tokens = 0  # counted here: a layer without kept heads stores no K/V to count

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        self.tokens += key_states.shape[-2]
        return super().update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self) -> int:
        return self.tokens

    def reset(self) -> None:
        super().reset()
        self.mixer_state = None
        self.tokens = 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0 and self.mixer_state is not None:
            raise ValueError("a recurrent mixer state cannot be rolled back: HybridCache does not support crop()")
        super().crop(tokens_to_remove)
        self.tokens = max(0, self.tokens - abs(tokens_to_remove))

    def _map_state(self, fn) -> None:
        if self.mixer_state is not None:
            self.mixer_state = {name: fn(t) for name, t in self.mixer_state.items()}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_state(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_state(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_state(lambda t: t[indices])

    def nbytes(self) -> dict[str, int]:
        kv = sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)
        state = sum(t.numel() * t.element_size() for t in (self.mixer_state or {}).values())
        return {"kv": kv, "mixer_state": state}


class HybridCache(Cache):
    """The cache of a RecurFormer model: one `HybridLayer` per decoder layer."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[HybridLayer() for _ in range(num_layers)])

    def mixer_state(self, layer_idx: int, mixer: Mixer, batch: int, dtype: torch.dtype, device) -> MixerState:
        """The mixer state of `layer_idx`, allocated on first use."""
        layer = self.layers[layer_idx]
        if layer.mixer_state is None:
            layer.mixer_state = mixer.allocate_state(batch, dtype, device)
        return layer.mixer_state

    def nbytes(self) -> dict[str, int]:
        """Bytes held, by kind: `kv` (kept heads' keys and values), `mixer_state`, `total`."""
        totals = {"kv": 0, "mixer_state": 0}
        for layer in self.layers:
            for kind, n in layer.nbytes().items():
                totals[kind] += n
        totals["total"] = totals["kv"] + totals["mixer_state"]
        return totals
