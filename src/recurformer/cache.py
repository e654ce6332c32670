"""HybridCache: per layer, K/V of the kept KV heads plus the mixer state of the replaced ones.

Works with `model.generate()` of transformers 5.x: it is a `transformers.Cache` whose layers
are `HybridLayer`s. A layer's K/V hold only the kept heads `[B, kept_kv_heads, T, head_dim]`
(zero heads in a fully replaced layer); its mixer state has a fixed size whatever T is.
No token is evicted, unless a press asks for it (`HybridLayer.keep_tokens`: the comparisons with
kvpress's presses on the kept heads).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer
from transformers.models.llama.modeling_llama import LlamaModel

from .mixers import Mixer, MixerState
from .ops.rope import Rotary
from .ops.token_write import write_token

# transformers 5.24 renamed the cache argument of models and layers (and the key of
# `generate`'s model kwargs) from `past_key_values` to `cache`, the old name deprecated: we
# pass and read whichever the installed version's models take.
CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


class StaticSteps:
    """[ours] What every layer of a static cache shares (`HybridCache.make_static`): the
    filled length `[1]` and each row's first real slot `[B, 1]`, on the device, and which
    slots a decode step's token sees, computed once a step for all layers (once per sliding
    window) where each layer computed its own: on a GPU four launches a layer fewer. The
    step's token takes slot `length` in every layer; the last layer counts it (`advance`)."""

    def __init__(self, tokens: int, capacity: int, starts: Tensor, device) -> None:
        self.length = torch.tensor([tokens], device=device)
        self.slots = torch.arange(capacity, device=device)
        self.starts = starts
        self._visible: dict[int | None, Tensor] = {}

    def visible(self, sliding_window: int | None = None) -> Tensor:
        """`[B, 1, 1, C]` bool: the slots from each row's start up to this step's token, and
        within the last `sliding_window` tokens where given."""
        if None not in self._visible:
            self._visible[None] = ((self.slots >= self.starts) & (self.slots <= self.length))[:, None, None, :]
        if sliding_window not in self._visible:
            self._visible[sliding_window] = self._visible[None] & (self.slots > self.length - sliding_window)
        return self._visible[sliding_window]

    def advance(self) -> None:
        """The step's token counted in every layer: the next step writes and sees one slot more."""
        self.length += 1
        self._visible.clear()


class HybridLayer(DynamicLayer):
    """One decoder layer's cache: a growing K/V for kept heads and a fixed-size mixer state.

    [ours] A decode step allocates and concatenates nothing here. K/V live in buffers
    `[B, kept_kv_heads, capacity, D]` of which the first `tokens` slots are filled;
    appending a token writes its slot in place (transformers' `DynamicLayer` concatenates,
    copying the whole cache at every step), and `keys`/`values` are views of the filled
    part. When the buffers are full they grow to the next multiple of `BLOCK` tokens: one
    copy of the cache every `BLOCK` tokens, and at most `BLOCK - 1` empty slots reserved
    (`nbytes()["kv_reserved"]`). The mixer state is updated in place by the mixer. Beam
    search reorders the rows of both in place.
    """

    BLOCK = 256

    def __init__(self) -> None:
        super().__init__()
        self.mixer_state: MixerState | None = None
        self.tokens = 0  # counted here: a layer without kept heads stores no K/V to count
        self._key_buffer: Tensor | None = None
        self._value_buffer: Tensor | None = None
        self.steps: StaticSteps | None = None  # static decoding (`make_static`), shared by every layer
        self.evicted: Tensor | None = None  # bool [B, kept_kv_heads, n]: slots hidden from a head (`keep_tokens`)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append `[B, kept_kv_heads, T, D]` keys/values; return all of them so far."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, length = self.tokens, key_states.shape[-2]
        self.tokens += length
        if self._key_buffer is None or self._key_buffer.shape[-2] < self.tokens:
            self._grow(key_states)
        self._key_buffer[:, :, start:self.tokens] = key_states
        self._value_buffer[:, :, start:self.tokens] = value_states
        self._view()
        return self.keys, self.values

    def append_slot(self) -> tuple[Tensor, Tensor, int] | None:
        """For a decode step that writes its token's key and value itself
        (`ops/attention_step`): count one more token, grow the buffers if they are full,
        and return (key buffer, value buffer `[B, kept_kv_heads, capacity, D]`, tokens);
        the token's slot is `tokens - 1`. None before the first `update` (the buffers'
        shape is not known yet)."""
        if self._key_buffer is None:
            return None
        self.tokens += 1
        if self._key_buffer.shape[-2] < self.tokens:
            self._grow(self._key_buffer[:, :, :1])
        self._view()
        return self._key_buffer, self._value_buffer, self.tokens

    def check_static(self, capacity: int) -> None:
        """Why this layer cannot decode statically with `capacity` tokens (a ValueError), if it cannot."""
        if self._key_buffer is None:
            raise ValueError("make_static: prefill first (the layer holds no keys yet)")
        if self.evicted is not None:
            raise ValueError("make_static: the heads keep uneven counts of tokens (keep_tokens with counts)")
        if capacity < self.tokens:
            raise ValueError(f"make_static: capacity {capacity} < the {self.tokens} tokens held")

    def make_static(self, capacity: int, steps: StaticSteps) -> None:
        """[ours] Decode from here on with buffers of `capacity` tokens whose filled length is a
        device tensor shared by all layers (`steps`, `append_static`), so that a step depends
        on no Python value and can be captured in a CUDA graph (`decode_graph.py`)."""
        self.check_static(capacity)
        if self._key_buffer.shape[-2] != capacity:
            self._reallocate(self._key_buffer.shape[0], capacity)
        # the slots not written yet hold whatever the allocator left, NaN included, and a masked
        # slot still enters SDPA's sum with weight 0: 0 * NaN would be NaN
        self._key_buffer[:, :, self.tokens:].zero_()
        self._value_buffer[:, :, self.tokens:].zero_()
        self.steps = steps

    def append_static(self, key_states: Tensor, value_states: Tensor, sliding_window: int | None = None,
                      rotary: Rotary | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """A static decode step's token: write its key and value `[B, kept_kv_heads, D]` at slot
        `steps.length` (the key rotated first by `rotary`, the token's (cos, sin) `[B or 1, D]`,
        where given; one kernel on a GPU, `ops/token_write`), on the device; return the whole
        buffers `[B, kept, C, D]` and which slots each row sees `[B, 1, 1, C]` (bool: from its
        start up to the token, and within the layer's `sliding_window` last tokens where it has
        one). The last layer counts the token (`StaticSteps.advance`)."""
        write_token(self._key_buffer, self._value_buffer, key_states, value_states, self.steps.length, rotary)
        return self._key_buffer, self._value_buffer, self.steps.visible(sliding_window)

    def repeat_rows(self, batch: int, capacity: int) -> None:
        """`HybridCache.repeat_rows` for this layer: its one row made `batch` rows, K/V buffers of
        `capacity` tokens."""
        if self._key_buffer is not None:
            if capacity < self.tokens or self.keys.shape[0] != 1:
                raise ValueError(f"repeat_rows: needs one row and capacity >= {self.tokens} tokens")
            self._reallocate(batch, capacity)
        self._map_state(lambda t: t.expand(batch, *t.shape[1:]).clone())
        if self.evicted is not None:
            self.evicted = self.evicted.expand(batch, *self.evicted.shape[1:]).clone()

    def _reallocate(self, batch: int, capacity: int) -> None:
        """New K/V buffers `[batch, kept_kv_heads, capacity, D]` holding the tokens held (one row
        repeated to `batch` rows, or the rows as they are)."""
        shape = (batch, self._key_buffer.shape[1], capacity, self._key_buffer.shape[-1])
        keys, values = self._key_buffer.new_empty(shape), self._value_buffer.new_empty(shape)
        keys[:, :, : self.tokens], values[:, :, : self.tokens] = self.keys, self.values
        self._key_buffer, self._value_buffer = keys, values
        self._view()

    def _view(self) -> None:
        """`keys`/`values`: the filled part of the buffers."""
        self.keys = self._key_buffer[:, :, : self.tokens]
        self.values = self._value_buffer[:, :, : self.tokens]

    def _grow(self, like: Tensor) -> None:
        capacity = -(-self.tokens // self.BLOCK) * self.BLOCK
        shape = (*like.shape[:2], capacity, like.shape[-1])
        keys, values = like.new_empty(shape), like.new_empty(shape)
        filled = self.tokens - like.shape[-2]
        if filled:
            keys[:, :, :filled] = self.keys
            values[:, :, :filled] = self.values
        self._key_buffer, self._value_buffer = keys, values

    def _adopt(self) -> None:
        """After an operation that replaced `keys`/`values` by new tensors of another batch
        size (`batch_repeat_interleave`, `batch_select_indices`), make them the buffers."""
        if self.keys is not None and self.keys.dim() == 4:
            self.keys, self.values = self.keys.contiguous(), self.values.contiguous()
            self._key_buffer, self._value_buffer = self.keys, self.values

    def get_seq_length(self) -> int:
        """Tokens seen (in static decoding read from the device: a synchronization)."""
        return self.tokens if self.steps is None else int(self.steps.length)

    def reset(self) -> None:
        super().reset()
        self.mixer_state = None
        self.tokens = 0
        self._key_buffer = self._value_buffer = None
        self.steps = self.evicted = None

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0 and self.mixer_state is not None:
            raise ValueError("a recurrent mixer state cannot be rolled back: HybridCache does not support crop()")
        super().crop(tokens_to_remove)
        if self._key_buffer is not None:
            self.tokens = max(0, self.tokens - abs(tokens_to_remove))
            self._view()

    def keep_tokens(self, index: Tensor, counts: Tensor | None = None) -> None:
        """Keep in each kept head only its tokens at `index` `[B, kept_kv_heads, n]`, and count
        `n` tokens: a token-eviction press acting on the kept heads after a prefill
        (`benchmarks/peers/kept_press.py`). With `counts` `[B, kept_kv_heads]`, head h of row
        b keeps only its first `counts[b, h]` entries of `index`: its other slots stay
        allocated but attention no longer sees them (`evicted`, `attention_bias`), as kvpress
        hides the tokens of its uneven presses. The mixer state is not touched; the tokens that
        follow must be given their positions (`position_ids`)."""
        gather = index[..., None].expand(-1, -1, -1, self.keys.shape[-1])
        self._key_buffer = self.keys.gather(2, gather).contiguous()
        self._value_buffer = self.values.gather(2, gather).contiguous()
        self.tokens = index.shape[-1]
        self._view()
        slots = torch.arange(self.tokens, device=index.device)
        self.evicted = None if counts is None else slots >= counts[..., None].to(index.device)
        if self.evicted is not None and not bool(self.evicted.any()):
            self.evicted = None

    def attention_bias(self, tokens: int, dtype: torch.dtype) -> Tensor | None:
        """Additive `[B, kept_kv_heads, 1, tokens]`: -inf on the slots hidden from a head
        (`keep_tokens` with counts), 0 on all others (the tokens after them included); None when
        no slot is hidden."""
        if self.evicted is None:
            return None
        hidden = F.pad(self.evicted, (0, tokens - self.evicted.shape[-1]))
        return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill(hidden, float("-inf"))[:, :, None]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i becomes row `beam_idx[i]`, in the same buffers and state tensors."""
        tensors = [*(self.mixer_state or {}).values()]
        if self._key_buffer is not None:
            tensors += [self.keys, self.values]
        for t in tensors:
            t.copy_(t.index_select(0, beam_idx.to(t.device)))
        if self.evicted is not None:
            self.evicted = self.evicted.index_select(0, beam_idx.to(self.evicted.device))

    def _map_state(self, fn) -> None:
        if self.mixer_state is not None:
            self.mixer_state = {name: fn(t) for name, t in self.mixer_state.items()}

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._adopt()
        self._map_state(lambda t: t.repeat_interleave(repeats, dim=0))
        if self.evicted is not None:
            self.evicted = self.evicted.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: Tensor) -> None:
        super().batch_select_indices(indices)
        self._adopt()
        self._map_state(lambda t: t[indices])
        if self.evicted is not None:
            self.evicted = self.evicted[indices]

    def nbytes(self) -> dict[str, int]:
        """`kv`: the keys and values held; `kv_reserved`: their buffers (up to one block more)."""
        def size(*tensors):
            return sum(t.numel() * t.element_size() for t in tensors if t is not None and t.dim() == 4)

        state = sum(t.numel() * t.element_size() for t in (self.mixer_state or {}).values())
        return {"kv": size(self.keys, self.values), "kv_reserved": size(self._key_buffer, self._value_buffer), "mixer_state": state}


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

    def repeat_rows(self, batch: int, capacity: int) -> None:
        """Make a cache of one row (a prefilled prompt) `batch` identical rows, in place, with K/V
        buffers of `capacity` tokens (>= those held): what serving `batch` requests of that
        prompt holds, allocated once at its final size (`batch_repeat_interleave` would
        allocate the rows, then copy them again when the buffers next grow)."""
        for layer in self.layers:
            layer.repeat_rows(batch, capacity)

    def make_static(self, capacity: int, starts: Tensor | None = None) -> None:
        """Every layer decodes statically from here on (`HybridLayer.make_static`), their filled
        length and visible slots shared (`StaticSteps`). `starts` `[B]`: each row's first real
        slot (left padding; default 0). The prefill must have run (the buffers exist)."""
        for layer in self.layers:
            layer.check_static(capacity)
        first = self.layers[0]
        batch, device = first._key_buffer.shape[0], first._key_buffer.device
        starts = torch.zeros(batch, 1, dtype=torch.long, device=device) if starts is None else starts.view(batch, 1)
        steps = StaticSteps(first.tokens, capacity, starts, device)
        for layer in self.layers:
            layer.make_static(capacity, steps)

    @property
    def is_static(self) -> bool:
        return self.layers[0].steps is not None

    @property
    def batch_size(self) -> int:
        """Rows held (after the prefill)."""
        return self.layers[0]._key_buffer.shape[0]

    def nbytes(self) -> dict[str, int]:
        """Bytes by kind: `kv` (the kept heads' keys and values), `kv_reserved` (their
        buffers, at most one block of tokens more), `mixer_state`, and `total` (kv + state)."""
        totals = {"kv": 0, "kv_reserved": 0, "mixer_state": 0}
        for layer in self.layers:
            for kind, n in layer.nbytes().items():
                totals[kind] += n
        totals["total"] = totals["kv"] + totals["mixer_state"]
        return totals
