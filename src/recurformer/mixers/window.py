"""Sliding-window attention: the replaced heads stay softmax attention over a fixed window.

The baseline reviewers asked for. The replaced heads keep their own q/k/v projections
(and biases) and RoPE; query `i` (the i-th real token of its row) attends to the tokens

    { j <= i :  i - j < window  or  j < sinks }

(the last `window` tokens including itself, and the row's first `sinks` tokens, which
stay attended forever as "attention sinks"). With `window` >= the sequence length this
is exactly the original heads' attention.

State: a ring buffer of `sinks + window` slots per row, `keys` and `values`
`[B, sinks + window, G, D]` (keys stored after RoPE, so the softmax over the buffer does
not depend on the slot order) and `index` `[B, sinks + window]`, the position of each
slot's token among the row's real tokens (-1: empty). Token n goes to slot n if n < sinks,
else to slot `sinks + (n - sinks) % window`. Padding (attention_mask 0) takes no slot and
no index, so left padding changes nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ..ops.window import token_positions, window_attention
from ..kv_quant import stored
from ..ops.rope import rotate
from ..ops.window.ring_step import ring_slot, ring_step
from ..ops.window_step import Tail, WindowWeights
from .base import HeadShape, Mixer, MixerState, PositionEmbeddings, ReplacedHeads, register_mixer
from .config import MixerConfig
from .fused_step import compiled_step, rotary


@register_mixer("window")
class WindowMixer(Mixer):
    """Sliding-window softmax attention `[B, T, d_in] -> [B, T, H * D]` with a ring-buffer
    state of `sinks + window` tokens."""

    reads = frozenset({"window", "sinks", "scan_backend"})  # scan_backend: the attention's and the decode step's
    kv_cache_type: str | None = None  # its keys and values stored as llama.cpp stores them (`stored_kv.store_kv_as`)

    def __init__(self, d_in: int, heads: HeadShape, config: MixerConfig):
        super().__init__()
        self.d_in, self.d_out, self.config = d_in, heads.d_out, config
        self.n_heads, self.n_kv_heads, self.head_dim = heads.num_q_heads, heads.num_kv_heads, heads.head_dim
        self.window, self.sinks = config.window, config.sinks
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(d_in, self.n_heads * self.head_dim, bias=heads.qkv_bias)
        self.k_proj = nn.Linear(d_in, self.n_kv_heads * self.head_dim, bias=heads.qkv_bias)
        self.v_proj = nn.Linear(d_in, self.n_kv_heads * self.head_dim, bias=heads.qkv_bias)

    def reset_parameters(self) -> None:
        for linear in (self.q_proj, self.k_proj, self.v_proj):
            linear.reset_parameters()

    @torch.no_grad()
    def init_from_heads(self, heads: ReplacedHeads) -> None:
        """The replaced heads' q/k/v weights and biases, unchanged: the same heads, windowed."""
        for linear, w, b, name in (
            (self.q_proj, heads.q, heads.q_bias, "q"),
            (self.k_proj, heads.k, heads.k_bias, "k"),
            (self.v_proj, heads.v, heads.v_bias, "v"),
        ):
            w = w.reshape(-1, w.shape[-1])
            if w.shape != linear.weight.shape or (b is None) != (linear.bias is None):
                raise ValueError(
                    f"window mixer: {name} projection is {tuple(linear.weight.shape)} (bias {linear.bias is not None}), "
                    f"the replaced heads' is {tuple(w.shape)} (bias {b is not None})"
                )
            linear.weight.copy_(w)
            if b is not None:
                linear.bias.copy_(b.flatten())

    def allocate_state(self, batch: int, dtype, device) -> MixerState:
        slots = self.sinks + self.window
        return {
            "keys": torch.zeros(batch, slots, self.n_kv_heads, self.head_dim, dtype=dtype, device=device),
            "values": torch.zeros(batch, slots, self.n_kv_heads, self.head_dim, dtype=dtype, device=device),
            "index": torch.full((batch, slots), -1, dtype=torch.long, device=device),
        }

    def _project(self, x: Tensor, position_embeddings: PositionEmbeddings | None) -> tuple[Tensor, Tensor, Tensor]:
        """x `[B, T, d_in]` -> q `[B, H, T, D]`, k and v `[B, T, G, D]`, RoPE applied to q and k."""
        if position_embeddings is None:
            raise ValueError("the window mixer needs position_embeddings=(cos, sin): it applies RoPE as the heads it replaces did")
        batch, length = x.shape[:2]
        q = self.q_proj(x).view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.n_kv_heads, self.head_dim)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k.transpose(1, 2), v

    def slots(self, index: Tensor) -> Tensor:
        """Ring-buffer slot of the tokens at positions `index` (>= 0)."""
        return ring_slot(index, self.window, self.sinks)

    @staticmethod
    def _positions(index: Tensor, attention_mask: Tensor | None, batch: int, length: int) -> Tensor:
        """Sequence positions `[B, T]` of the new tokens (-1 for padding), continuing after the
        real tokens the buffer's `index` `[B, S]` has seen."""
        return token_positions(attention_mask, index, batch, length, index.device)

    def _project_tokens(self, x: Tensor, position_embeddings: PositionEmbeddings | None) -> tuple[Tensor, Tensor, Tensor]:
        """x `[B, T, d_in]` -> q `[B, T, H, D]`, k and v `[B, T, G, D]` (the layout the
        attention kernels read, no transposes), RoPE applied to q and k."""
        if position_embeddings is None:
            raise ValueError("the window mixer needs position_embeddings=(cos, sin): it applies RoPE as the heads it replaces did")
        batch, length = x.shape[:2]
        q = self.q_proj(x).view(batch, length, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(batch, length, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, length, self.n_kv_heads, self.head_dim)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
        return q, k, v

    def forward(
        self,
        x: Tensor,
        state: MixerState | None = None,
        attention_mask: Tensor | None = None,
        position_embeddings: PositionEmbeddings | None = None,
    ) -> Tensor:
        """The windowed attention of the whole sequence in one call (`ops/window`: compiled
        when the kernels are built), over the buffer's tokens too when `state` is given;
        then the tokens that stay in the window are written into the buffer."""
        batch, length = x.shape[:2]
        q, k, v = self._project_tokens(x, position_embeddings)
        if self.kv_cache_type:
            k, v = stored(k, self.kv_cache_type, "k"), stored(v, self.kv_cache_type, "v")
        past = None if state is None else (state["keys"], state["values"], state["index"])
        out = window_attention(q, k, v, self.window, self.sinks, self.scaling, attention_mask, past,
                               backend=self.config.scan_backend)
        if state is not None:
            self._remember(k, v, attention_mask, state)
        return out.reshape(batch, length, self.d_out)

    def _remember(self, k: Tensor, v: Tensor, attention_mask: Tensor | None, state: MixerState) -> None:
        """Write the tokens of k, v `[B, T, G, D]` that the buffer keeps (the row's first
        `sinks` and its last `window`) into their slots, in place: these have distinct slots,
        so the buffer ends as if every token had been written in turn."""
        index = state["index"]
        batch, length = k.shape[:2]
        position = self._positions(index, attention_mask, batch, length)
        seen = torch.maximum(index.max(dim=-1).values, position.max(dim=-1).values) + 1  # [B]
        keep = (position >= 0) & ((position < self.sinks) | (position >= seen[:, None] - self.window))
        rows, steps = keep.nonzero(as_tuple=True)
        # Rows of flattened views: `k[rows, steps]` (advanced indexing) takes ~3 ms at T = 8K.
        source = rows * length + steps
        target = rows * index.shape[1] + self.slots(position[rows, steps])
        for name, tensor in (("keys", k), ("values", v)):
            buffer = state[name]
            rows_of = tensor.reshape(batch * length, *tensor.shape[2:]).index_select(0, source)
            buffer.view(-1, *buffer.shape[2:]).index_copy_(0, target, rows_of.to(buffer.dtype))
        index.view(-1).index_copy_(0, target, position.flatten().index_select(0, source))

    def window_weights(self) -> WindowWeights:
        """The projections and shape, as the fused step (`ops/window_step`) reads them."""
        return WindowWeights(self.q_proj.weight, self.q_proj.bias, self.k_proj.weight, self.k_proj.bias,
                             self.v_proj.weight, self.v_proj.bias, self.n_heads, self.n_kv_heads, self.sinks, self.window)

    def fused_step_parts(self) -> tuple[WindowWeights, Tail]:
        """What the compiled step reads (`mixers/fused_step.py`): the window, no tail."""
        return self.window_weights(), None

    def step(self, x: Tensor, state: MixerState, position_embeddings: PositionEmbeddings | None = None) -> Tensor:
        """One token, written into its ring slot in place, then attending over the buffer:
        one compiled call when the kernels are built (`ops/window_step`); else the
        projections here and `ops/window/ring_step` with RoPE (Triton on a GPU, PyTorch
        elsewhere), each KV group's query heads as that group's queries, so no key or value
        is repeated per head."""
        kernel = None if self.kv_cache_type else compiled_step(self, x)
        if kernel is not None:
            return kernel(x, *rotary(position_embeddings), state)
        batch = x.shape[0]
        q = self.q_proj(x).view(batch, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(batch, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, self.n_kv_heads, self.head_dim)
        rope = rotary(position_embeddings)
        if self.kv_cache_type:  # the key stored as the cache stores it, after its rotation
            q, k = rotate(q, *rope), rotate(k, *rope)
            k, v, rope = stored(k, self.kv_cache_type, "k"), stored(v, self.kv_cache_type, "v"), None
        out = ring_step(q, k, v, state["keys"], state["values"], state["index"], self.window, self.sinks, self.scaling, rope)
        return out.reshape(batch, self.d_out)
