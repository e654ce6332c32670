"""Window + linear tail (LoLCATs-style): softmax over the window, linear attention over the
tokens that left it, one shared normalizer.

For query i (the i-th real token of its row), the window W(i) is the `window` mixer's
(the last `window` tokens and the first `sinks`), the tail is every older token
`{ j : sinks <= j <= i - window }`, and

    hybrid_i = (sum_{j in W} e^{s_ij - m_i} v_j + alpha sum_{j in tail} phi(q_i).phi(k_j) v_j)
             / (sum_{j in W} e^{s_ij - m_i}     + alpha sum_{j in tail} phi(q_i).phi(k_j))
    out_i    = window_i + gate * (hybrid_i - window_i)

with `s_ij` the heads' own scaled, rotated dot products, `m_i` their maximum over the window,
`window_i` the plain windowed softmax, and `phi(x) = [softmax(x W_g), softmax(-x W_g)]` a
learned feature map per KV group g (Hedgehog's, applied to the rotated q and k, as in
LoLCATs). The shared normalizer lets the tail take the share of attention mass that the
window cannot see, instead of adding a correction on top of a distribution that already
sums to one. [ours] `gate` `[H]` (one per query head) starts at zero, so the mixer starts
exactly as the `window` mixer; its gradient is `dL/dout . (hybrid - window)`, so it opens
at the first step. `alpha = exp(log_alpha)` `[H]` starts at 1.

State: the window's ring buffer, plus the tail's sums per KV group `tail_kv`
`[B, G, F, D]` (sum of phi(k_j) v_j^T) and `tail_k` `[B, G, F]` (sum of phi(k_j)),
F = 2 * feature_dim. A token enters them when the ring buffer overwrites its slot, i.e.
when it leaves the window, so the tail needs no buffer of its own.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops.window_step import LinearTail, WindowWeights
from .base import HeadShape, MixerState, PositionEmbeddings, ReplacedHeads, register_mixer, state_dtype
from .config import MixerConfig
from .fused_step import compiled_step, rotary
from .window import WindowMixer


@register_mixer("window+linear")
class WindowLinearMixer(WindowMixer):
    """Windowed softmax + linear attention over the evicted tail, `[B, T, d_in] -> [B, T, H * D]`."""

    reads = WindowMixer.reads | {"feature_dim", "state_dtype"}
    recipe = "tail"

    def __init__(self, d_in: int, heads: HeadShape, config: MixerConfig):
        super().__init__(d_in, heads, config)
        self.feature_dim = config.resolved_feature_dim(heads.head_dim)
        self.features = 2 * self.feature_dim
        self.group = heads.group_size
        self.feature_map = nn.Parameter(torch.empty(self.n_kv_heads, self.head_dim, self.feature_dim))
        self.gate = nn.Parameter(torch.zeros(self.n_heads))
        self.log_alpha = nn.Parameter(torch.zeros(self.n_heads))
        self._reset_tail()

    @torch.no_grad()
    def _reset_tail(self) -> None:
        """Feature maps start as the identity on the first `feature_dim` channels (Hedgehog's
        init); gate 0, alpha 1."""
        self.feature_map.copy_(torch.eye(self.head_dim, self.feature_dim).expand_as(self.feature_map))
        self.gate.zero_()
        self.log_alpha.zero_()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self._reset_tail()

    @torch.no_grad()
    def init_from_heads(self, heads: ReplacedHeads) -> None:
        """The heads' q/k/v unchanged (as `window`); the tail keeps its own init."""
        super().init_from_heads(heads)
        self._reset_tail()

    def tail_parameters(self) -> list[nn.Parameter]:
        """The feature maps, gate and alpha: what the tail recipe trains with q/k/v frozen."""
        return [self.feature_map, self.gate, self.log_alpha]

    def allocate_state(self, batch: int, dtype, device) -> MixerState:
        state = super().allocate_state(batch, dtype, device)
        # The tail sums accumulate over tokens: kept in state_dtype (fp32 by default, docs/precision.md).
        accumulator = state_dtype(self.config)
        state["tail_kv"] = torch.zeros(batch, self.n_kv_heads, self.features, self.head_dim, dtype=accumulator, device=device)
        state["tail_k"] = torch.zeros(batch, self.n_kv_heads, self.features, dtype=accumulator, device=device)
        return state

    def _phi(self, x: Tensor, per_query_head: bool) -> Tensor:
        """Features of rotated queries `[B, H, L, D]` or keys `[B, S, G, D]` (fp32) -> `[B, H or G, L or S, F]`."""
        feature_map = self.feature_map.float()
        if per_query_head:
            projected = torch.einsum("bhld,hde->bhle", x, feature_map.repeat_interleave(self.group, dim=0))
        else:
            projected = torch.einsum("bsgd,gde->bgse", x, feature_map)
        return torch.cat([projected.softmax(-1), (-projected).softmax(-1)], dim=-1)

    def forward(
        self,
        x: Tensor,
        state: MixerState | None = None,
        attention_mask: Tensor | None = None,
        position_embeddings: PositionEmbeddings | None = None,
    ) -> Tensor:
        batch, length = x.shape[:2]
        q, k, v = self._project(x, position_embeddings)
        buffer = state if state is not None else self.allocate_state(batch, k.dtype, x.device)
        keys, values, index = buffer["keys"], buffer["values"], buffer["index"]
        tail_kv, tail_k = buffer["tail_kv"].float(), buffer["tail_k"].float()
        position = self._positions(index, attention_mask, batch, length)
        # Blocks of at most `window` steps: no token of a block is in the tail of a query of
        # the same block, and a block's tokens never share a ring slot.
        outputs = []
        for start in range(0, length, self.window):
            block = slice(start, min(length, start + self.window))
            out, keys, values, index, tail_kv, tail_k = self._hybrid_block(
                q[:, :, block], k[:, block], v[:, block], position[:, block], keys, values, index, tail_kv, tail_k
            )
            outputs.append(out)
        if state is not None:
            for name, tensor in (("keys", keys), ("values", values), ("index", index), ("tail_kv", tail_kv), ("tail_k", tail_k)):
                state[name].copy_(tensor)
        return torch.cat(outputs, dim=2).transpose(1, 2).reshape(batch, length, self.d_out).to(x.dtype)

    def _hybrid_block(self, q, k, v, position, keys, values, index, tail_kv, tail_k):
        """One block: q `[B, H, L, D]`, k and v `[B, L, G, D]`, position `[B, L]` against the
        ring buffer (keys, values `[B, S, G, D]`, index `[B, S]`) and the tail sums
        (`[B, G, F, D]`, `[B, G, F]`). Returns the output `[B, H, L, D]` and the new
        buffer and sums (out of place, so autograd sees every version)."""
        length, slots = q.shape[2], index.shape[1]
        q = q.float()
        key_position = torch.cat([index, position], dim=1)  # [B, S + L]
        query, key = position[:, :, None], key_position[:, None, :]
        visible = (key >= 0) & (key <= query) & ((query - key < self.window) | (key < self.sinks))  # [B, L, S + L]
        itself = torch.zeros(length, slots + length, dtype=torch.bool, device=q.device)
        itself[:, slots:] = torch.eye(length, dtype=torch.bool, device=q.device)
        visible = visible | itself  # a padding query sees only itself: its output stays finite
        all_keys = torch.cat([keys, k.to(keys.dtype)], dim=1).float().transpose(1, 2).repeat_interleave(self.group, dim=1)
        all_values = torch.cat([values, v.to(values.dtype)], dim=1).float().transpose(1, 2).repeat_interleave(self.group, dim=1)
        scores = (q @ all_keys.transpose(-1, -2)) * self.scaling  # [B, H, L, S + L]
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        weights = torch.exp(scores - scores.amax(-1, keepdim=True))
        window_num, window_den = weights @ all_values, weights.sum(-1, keepdim=True)  # [B, H, L, D], [B, H, L, 1]
        window_out = window_num / window_den

        # The tail: the sums of the tokens already evicted, and the ring tokens that a query
        # of this block no longer sees in its window (j <= i - window), not yet evicted.
        ring_keys = self._phi(keys.float(), per_query_head=False)  # [B, G, S, F]
        phi_q = self._phi(q, per_query_head=True)  # [B, H, L, F]
        in_tail = (index[:, None, :] >= self.sinks) & (index[:, None, :] <= query - self.window)  # [B, L, S]
        ring = (phi_q @ ring_keys.repeat_interleave(self.group, dim=1).transpose(-1, -2)) * in_tail[:, None]  # [B, H, L, S]
        ring_values = values.float().transpose(1, 2).repeat_interleave(self.group, dim=1)  # [B, H, S, D]
        tail_num = ring @ ring_values + phi_q @ tail_kv.repeat_interleave(self.group, dim=1)
        tail_den = ring.sum(-1, keepdim=True) + phi_q @ tail_k.repeat_interleave(self.group, dim=1)[..., None]
        alpha = self.log_alpha.float().exp()[:, None, None]
        hybrid = (window_num + alpha * tail_num) / (window_den + alpha * tail_den)
        out = window_out + self.gate.float()[:, None, None] * (hybrid - window_out)

        # Evict: the slots this block's tokens overwrite held the tokens leaving the window.
        rows, steps = (position >= 0).nonzero(as_tuple=True)
        slot = self.slots(position[rows, steps])
        overwritten = torch.zeros_like(index, dtype=torch.bool).index_put((rows, slot), torch.ones_like(slot, dtype=torch.bool))
        leaving = (overwritten & (index >= self.sinks)).to(ring_keys.dtype)  # [B, S]
        leaving_keys = ring_keys * leaving[:, None, :, None]
        tail_kv = tail_kv + torch.einsum("bgsf,bsgd->bgfd", leaving_keys, values.float())
        tail_k = tail_k + leaving_keys.sum(2)

        keys = keys.index_put((rows, slot), k[rows, steps].to(keys.dtype))
        values = values.index_put((rows, slot), v[rows, steps].to(values.dtype))
        index = index.index_put((rows, slot), position[rows, steps])
        return out, keys, values, index, tail_kv, tail_k

    def fused_step_parts(self) -> tuple[WindowWeights, LinearTail]:
        """What the compiled step reads (`mixers/fused_step.py`): the window and the tail."""
        return self.window_weights(), LinearTail(self.feature_map, self.log_alpha, self.gate)

    def step(self, x: Tensor, state: MixerState, position_embeddings: PositionEmbeddings | None = None) -> Tensor:
        """One token, its block of length one written in place: the token leaving the window
        (the one in the ring slot this token takes) enters the tail sums, this token takes
        its slot, then the query attends over the ring and reads the sums. One compiled call
        when the kernels are built (`ops/window_step`); else PyTorch, each KV group's
        `group` query heads as one `[group, D]` matrix, so no K/V or sum is repeated per head."""
        kernel = compiled_step(self, x)
        if kernel is not None:
            return kernel(x, *rotary(position_embeddings), state)
        batch = x.shape[0]
        q, k, v = self._project(x[:, None], position_embeddings)  # [B, H, 1, D], [B, 1, G, D] twice
        keys, values, index = state["keys"], state["values"], state["index"]
        rows = torch.arange(batch, device=x.device)
        position = index.max(dim=-1).values + 1  # [B]
        slot = self.slots(position)
        leaving = (index[rows, slot] >= self.sinks).to(torch.float32)[:, None, None, None]  # [B, 1, 1, 1]
        leaving_keys = self._phi(keys[rows, slot].float()[:, None], per_query_head=False) * leaving  # [B, G, 1, F]
        tail_kv, tail_k = state["tail_kv"].float(), state["tail_k"].float()  # the state itself when fp32
        tail_kv.add_(leaving_keys.transpose(-1, -2) * values[rows, slot].float()[:, :, None])  # [B, G, F, D]
        tail_k.add_(leaving_keys[:, :, 0])
        state["tail_kv"].copy_(tail_kv)  # no-ops for an fp32 state
        state["tail_k"].copy_(tail_k)
        keys[rows, slot] = k[:, 0].to(keys.dtype)
        values[rows, slot] = v[:, 0].to(values.dtype)
        index[rows, slot] = position

        groups, group, dim = self.n_kv_heads, self.group, self.head_dim
        queries = q.float().reshape(batch, groups, group, dim)
        scores = (queries @ keys.float().permute(0, 2, 3, 1)) * self.scaling  # [B, G, group, S]
        scores = scores.masked_fill((index < 0)[:, None, None], float("-inf"))
        weights = torch.exp(scores - scores.amax(-1, keepdim=True))
        window_num = weights @ values.float().transpose(1, 2)  # [B, G, group, D]
        window_den = weights.sum(-1, keepdim=True)
        window_out = window_num / window_den
        phi_q = self._phi(queries.transpose(1, 2), per_query_head=False)  # a group's queries as its keys: [B, G, group, F]
        alpha = self.log_alpha.float().exp().view(groups, group, 1)
        hybrid = (window_num + alpha * (phi_q @ tail_kv)) / (window_den + alpha * (phi_q @ tail_k[..., None]))
        out = window_out + self.gate.float().view(groups, group, 1) * (hybrid - window_out)
        return out.reshape(batch, self.d_out).to(x.dtype)
