"""HybridAttention: the kept heads stay softmax attention, one mixer stands in for the rest.

[ours] Layout. In each layer the KV groups are split into kept and replaced ones. The kept
heads' q/k/v rows are physically sliced (replaced heads cost no compute and no cache). The
mixer reads the same normalized hidden states (and rotary position embeddings) as
attention and emits the replaced query heads' channels; which mixer it is, the layer does
not know. `o_proj` is the original projection with its input columns reordered as
`[kept query heads..., replaced query heads...]` (same function, no gather at run time), so
the output is `o_proj(cat(attention_of_kept_heads, mixer_output))`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

from .cache import HybridCache
from .config import ConfigError
from .kv_quant import stored
from .mixers import HeadShape, MixerConfig, build_mixer, resolve_for_model
from .ops.backends import pick_backend
from .ops.attention_step import AttentionStepKernel, AttentionWeights
from .ops.decode_attention import decode_attention
from .ops.module_kernels import KernelsByModule, records_gradients

_decode_kernels = KernelsByModule()  # HybridAttention -> its kept heads' compiled decode step


def check_window_fits(config, mixer_config: MixerConfig) -> None:
    """A window kind's window (`auto`: decided for this model) must fit in the positions of
    the model `config` describes."""
    limit = getattr(config, "max_position_embeddings", None)
    mixer_config = resolve_for_model(mixer_config, config)
    if mixer_config.has_window and limit is not None and mixer_config.window > limit:
        raise ConfigError(f"window {mixer_config.window} is larger than the model's position limit ({limit} positions)")


def packed_decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scaling: float) -> Tensor:
    """One decode step's attention, each K/V head read once: q `[B, Hq, 1, D]`, k and v
    `[B, Hkv, T, D]`, mask None, `[B, 1, 1, T]` (bool or additive) or `[B, Hkv, 1, T]` (one per
    group) -> `[B, 1, Hq, D]`.

    [ours] The `Hq / Hkv` query heads of a KV group become that group's queries (`[B, Hkv,
    Hq / Hkv, D]`, a plain multi-query attention). transformers passes decode steps without
    a mask to SDPA with `enable_gqa`, whose CPU kernel reads each K/V head once per query
    head: twice the time at 3 query heads per group, on what is the largest part of a
    long-context decode step (docs/results/bench.md).
    """
    batch, heads, _, dim = q.shape
    groups = k.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(batch, groups, heads // groups, dim), k, v, attn_mask=mask, scale=scaling)
    return out.reshape(batch, 1, heads, dim)


def with_head_bias(attention_mask: Tensor | None, bias: Tensor, queries: int) -> Tensor:
    """The kept heads' mask with each head's hidden slots (`HybridLayer.attention_bias`):
    `attention_mask` None (causal, every earlier token seen), bool (True: seen) or additive
    `[B, 1, Q, K]`, `bias` additive `[B, Hkv, 1, K]` -> additive `[B, Hkv, Q, K]`."""
    keys = bias.shape[-1]
    if attention_mask is None:
        attention_mask = torch.ones(queries, keys, dtype=torch.bool, device=bias.device).tril(keys - queries)[None, None]
    if attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape, dtype=bias.dtype,
                                     device=bias.device).masked_fill(~attention_mask, float("-inf"))
    return attention_mask[..., :keys] + bias


def left_padding_starts(attention_mask: Tensor, tokens: int) -> Tensor | None:
    """The slot from which each row of a decode step attends, int64 `[B]`, when its mask
    `[B, 1, 1, tokens]` (bool, or additive: 0 where a token is seen) hides only a prefix of
    every row, as left padding does; None for any other mask."""
    if attention_mask.dim() != 4 or attention_mask.shape[1:] != (1, 1, tokens):
        return None
    seen = attention_mask[:, 0, 0] if attention_mask.dtype == torch.bool else attention_mask[:, 0, 0] == 0
    starts = seen.to(torch.uint8).argmax(1)  # the first seen slot
    return starts if bool((seen.sum(1) == tokens - starts).all()) else None


class HybridAttention(nn.Module):
    """Drop-in replacement for a Llama/Qwen2/Mistral attention module.

    Args:
        config: the base model's (text) config; its `_attn_implementation` picks the kernel.
        layer_idx: index of the decoder layer (for the cache).
        kept_kv_heads / replaced_kv_heads: original KV head indices, ascending, disjoint.
        mixer_config: builds the mixer for the replaced heads (None if there are none).
        qkv_bias / o_bias: whether q/k/v and o projections carry a bias (as in the original).
        sliding_window: the original layer's sliding window (Qwen2/Mistral), else None.
    """

    kv_cache_type: str | None = None  # the kept heads' K/V stored as llama.cpp stores them (`stored_kv.store_kv_as`)

    def __init__(
        self,
        config,
        layer_idx: int,
        kept_kv_heads: list[int],
        replaced_kv_heads: list[int],
        mixer_config: MixerConfig | None,
        qkv_bias: bool,
        o_bias: bool,
        sliding_window: int | None = None,
    ):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        hidden = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = getattr(config, "attention_dropout", 0.0)
        self.is_causal = True
        self.sliding_window = sliding_window
        self.kept_kv_heads, self.replaced_kv_heads = list(kept_kv_heads), list(replaced_kv_heads)

        kept_q = len(self.kept_kv_heads) * self.num_key_value_groups
        replaced_q = len(self.replaced_kv_heads) * self.num_key_value_groups
        if kept_q:
            self.q_proj = nn.Linear(hidden, kept_q * self.head_dim, bias=qkv_bias)
            self.k_proj = nn.Linear(hidden, len(self.kept_kv_heads) * self.head_dim, bias=qkv_bias)
            self.v_proj = nn.Linear(hidden, len(self.kept_kv_heads) * self.head_dim, bias=qkv_bias)
        self.mixer = None
        if replaced_q:
            check_window_fits(config, mixer_config)
            heads = HeadShape(replaced_q, len(self.replaced_kv_heads), self.head_dim, qkv_bias)
            self.mixer = build_mixer(hidden, heads, mixer_config)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, hidden, bias=o_bias)

    @property
    def has_attention(self) -> bool:
        return bool(self.kept_kv_heads)

    def forward(
        self,
        hidden_states: Tensor,
        position_embeddings: tuple[Tensor, Tensor],
        attention_mask: Tensor | None = None,
        cache=None,
        padding_mask: Tensor | None = None,
        past_key_values=None,
        **kwargs,
    ) -> tuple[Tensor, Tensor | None]:
        """hidden_states `[B, T, hidden]` -> output `[B, T, hidden]`, attention weights or None.

        `padding_mask` `[B, T_total]` (1 = token) is the 2-D mask given to the model; the mixer
        needs it so that left padding does not enter its state. The decoder layer passes the
        cache as `cache` (transformers >= 5.24) or `past_key_values` (before).
        """
        cache = past_key_values if cache is None else cache
        batch, length = hidden_states.shape[:2]
        if length == 1 and isinstance(cache, HybridCache) and cache.is_static:
            if self.kv_cache_type:
                raise ValueError(f"a {self.kv_cache_type} KV cache decodes on the general path: leave the cache dynamic")
            return self._static_decode(hidden_states, position_embeddings, cache), None
        parts: list[Tensor] = []
        weights = None
        compiled = (self._compiled_decode(hidden_states, position_embeddings, attention_mask, cache, kwargs)
                    if self.has_attention and not self.kv_cache_type else None)
        if compiled is not None:
            parts.append(compiled[:, None])
        elif self.has_attention:
            shape = (batch, length, -1, self.head_dim)
            q = self.q_proj(hidden_states).view(shape).transpose(1, 2)  # [B, Hq_kept, T, D]
            k = self.k_proj(hidden_states).view(shape).transpose(1, 2)  # [B, Hkv_kept, T, D]
            v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
            cos, sin = position_embeddings
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            if self.kv_cache_type:
                k, v = stored(k, self.kv_cache_type, "k"), stored(v, self.kv_cache_type, "v")
            if cache is not None:
                k, v = cache.update(k, v, self.layer_idx)
            packs = self._packs_decode(length, attention_mask, kwargs)
            bias = cache.layers[self.layer_idx].attention_bias(k.shape[-2], q.dtype) \
                if isinstance(cache, HybridCache) else None
            mask = attention_mask if bias is None else with_head_bias(attention_mask, bias, length)
            if packs:
                out = packed_decode_attention(q, k, v, mask, self.scaling)
            else:
                if bias is not None:  # [B, Hkv, Q, K] -> one mask per query head
                    mask = mask.repeat_interleave(self.num_key_value_groups, dim=1)
                interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
                out, weights = interface(
                    self, q, k, v, mask,
                    dropout=self.attention_dropout if self.training else 0.0,
                    scaling=self.scaling,
                    sliding_window=self.sliding_window,
                    **kwargs,
                )
            parts.append(out.reshape(batch, length, -1))
        elif cache is not None:
            # No kept heads: store nothing, but let the cache count the tokens.
            empty = hidden_states.new_empty(batch, 0, length, self.head_dim)
            cache.update(empty, empty, self.layer_idx)
        if self.mixer is not None:
            parts.append(self._mix(hidden_states, cache, padding_mask, position_embeddings))
        return self.o_proj(torch.cat(parts, dim=-1)), weights

    def _static_decode(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor], cache: HybridCache) -> Tensor:
        """One token `[B, 1, hidden]` over a static cache (`HybridCache.make_static`): the kept
        heads attend over the whole buffer, each row its visible slots, and the mixer steps;
        nothing depends on a Python value or waits for the device (`decode_graph.py`). The
        layers share the filled length, which the last one advances."""
        batch = hidden_states.shape[0]
        layer = cache.layers[self.layer_idx]
        parts: list[Tensor] = []
        if self.has_attention:
            shape = (batch, -1, self.head_dim)
            q = self.q_proj(hidden_states).view(shape)  # [B, Hq_kept, D]
            k = self.k_proj(hidden_states).view(shape)  # [B, Hkv_kept, D]
            v = self.v_proj(hidden_states).view(shape)
            rotary = position_embeddings[0][:, 0], position_embeddings[1][:, 0]  # [B or 1, D] each
            # RoPE inside the write and the attention: on a GPU, kernels that rotate as they load
            keys, values, visible = layer.append_static(k, v, self.sliding_window, rotary)
            groups = keys.shape[1]
            out = decode_attention(q.view(batch, groups, -1, self.head_dim), keys, values, visible, self.scaling, rotary)
            parts.append(out.reshape(batch, 1, -1))
        if self.mixer is not None:
            state = cache.mixer_state(self.layer_idx, self.mixer, batch, hidden_states.dtype, hidden_states.device)
            parts.append(self.mixer.step(hidden_states[:, 0], state, position_embeddings)[:, None])
        if self.layer_idx == len(cache.layers) - 1:
            layer.steps.advance()  # every layer has written the token at the same slot: count it once
        return self.o_proj(torch.cat(parts, dim=-1))

    def _compiled_decode(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor], attention_mask: Tensor | None,
                         cache, kwargs: dict) -> Tensor | None:
        """The kept heads' decode step as one compiled call (`ops/attention_step`): their
        output `[B, kept query heads * D]`, the token's key and value written into the
        cache's buffers; None where the PyTorch path runs instead. [ours] Taken for one
        token without a mask (the query sees the whole cache, as SDPA and eager attention
        without a mask compute it) or with a left-padding mask (each row from its first
        token on, the padding not read), in inference (no gradients recorded), with a
        `HybridCache` that holds the layer's buffers already, and CPU fp32 / bf16
        activations and weights, when the kernels are built."""
        if not (
            hidden_states.shape[1] == 1
            and isinstance(cache, HybridCache)
            and not self.training
            and self.config._attn_implementation in ("sdpa", "eager")
            and not kwargs.get("output_attentions")
            and not records_gradients(self, hidden_states)
            and cache.layers[self.layer_idx].evicted is None
        ):
            return None
        dtype = hidden_states.dtype
        kernel = _decode_kernels.get(self, dtype)
        if kernel is None:
            projections = [self.q_proj, self.k_proj, self.v_proj]
            fits = all(p.dtype == dtype for m in projections for p in m.parameters())
            if pick_backend("attention step", "auto", hidden_states, fits=fits) != "compiled":
                return None
            kernel = AttentionStepKernel(AttentionWeights(
                self.q_proj.weight, self.q_proj.bias, self.k_proj.weight, self.k_proj.bias, self.v_proj.weight,
                self.v_proj.bias, self.q_proj.out_features // self.head_dim, len(self.kept_kv_heads), self.scaling,
            ), dtype)
            _decode_kernels.put(self, kernel, reads=projections)
        starts = None
        if attention_mask is not None:
            starts = left_padding_starts(attention_mask, cache.layers[self.layer_idx].tokens + 1)
            if starts is None:
                return None
        slot = cache.layers[self.layer_idx].append_slot()
        if slot is None:
            return None
        keys, values, length = slot
        cos, sin = position_embeddings
        return kernel(hidden_states[:, 0], cos[:, 0], sin[:, 0], keys, values, length, starts)

    def _packs_decode(self, length: int, attention_mask: Tensor | None, kwargs: dict) -> bool:
        """Whether this call is a decode step `packed_decode_attention` computes exactly as
        SDPA would: one query, SDPA, no attention weights asked for, a mask shared by all heads."""
        return (
            length == 1
            and not self.training
            and self.config._attn_implementation == "sdpa"
            and not kwargs.get("output_attentions")
            and (attention_mask is None or attention_mask.shape[1] == 1)
        )

    def _mix(self, hidden_states: Tensor, cache, padding_mask: Tensor | None, position_embeddings) -> Tensor:
        batch, length = hidden_states.shape[:2]
        mask = None if padding_mask is None else padding_mask[:, -length:]
        if mask is not None and bool(mask.all()):
            mask = None
        if cache is None:
            return self.mixer(hidden_states, None, mask, position_embeddings)
        if not hasattr(cache, "mixer_state"):
            raise TypeError(
                f"a RecurFormer model needs a HybridCache, got {type(cache).__name__}; "
                "pass no cache and the model creates one"
            )
        state = cache.mixer_state(self.layer_idx, self.mixer, batch, hidden_states.dtype, hidden_states.device)
        if length == 1 and mask is None:
            return self.mixer.step(hidden_states[:, 0], state, position_embeddings)[:, None]
        return self.mixer(hidden_states, state, mask, position_embeddings)
