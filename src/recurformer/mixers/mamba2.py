"""Mamba-2 block (SSD: a scalar decay per head), laid out like the heads it replaces.

    z, xBC, dt = in_proj(h)                  # xBC = (x [G, P], B [G, N], C [H, N])
    x, B, C    = silu(causal_conv1d(xBC))
    dt         = softplus(dt + dt_bias)      # [H]
    y          = ssd(x, dt, A=-exp(A_log), B, C, D)     # [H, P], see ops/ssd
    out        = out_proj(rmsnorm_per_head(y * silu(z)))  # (or y * silu(z) without the norm)

[ours] Geometry. One SSD head per replaced query head (H), head size P = head_dim, so that
head h of the mixer lands in the slot of replaced query head h in front of `o_proj`. As
in grouped-query attention, x (~ values) and B (~ keys) are shared by the query heads of
one KV group (G groups), C (~ queries) is per head, and every head has its own decay:
state `[H, P, N]`, N = `ssd_state` (default head_dim). The gated RMSNorm normalizes each
head's channels separately (a head's output stays a head's output).

Initialization follows Mamba-2 (Dao & Gu, 2024): A uniform in [1, 16] (A_log = its log),
dt bias the inverse softplus of a log-uniform dt in [dt_min, dt_max], D = 1, norm weight 1.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.conv import causal_conv1d
from ..ops.gated_norm import gated_rms_norm
from ..ops.ssd import ssd
from ..ops.step import mamba2_step
from ..ops.window_step import Mamba2Tail
from .base import HeadShape, Mixer, MixerState, PositionEmbeddings, ReplacedHeads, register_mixer, state_dtype
from .config import MixerConfig
from .ssm_init import initial_dt_bias, reset_conv_

_NORM_EPS = 1e-5
_A_INIT_RANGE = (1.0, 16.0)


@register_mixer("mamba2")
class Mamba2Mixer(Mixer):
    """Mamba-2 mixer `[B, T, d_in] -> [B, T, H * P]` with state `conv [B, G*P + G*N + H*N,
    d_conv]` and `ssm [B, H, P, N]`."""

    reads = frozenset({"d_conv", "dt_min", "dt_max", "dt_init_floor", "conv_bias", "proj_bias", "scan_backend",
                       "ssd_state", "ssd_chunk", "ssd_norm", "state_dtype"})
    recipe = "mamba2"  # its lm stage diverges at the `mixers` recipe's 1e-3 (docs/mixers.md)

    def __init__(self, d_in: int, heads: HeadShape, config: MixerConfig):
        super().__init__()
        self.d_in, self.d_out, self.config = d_in, heads.d_out, config
        self.n_heads, self.n_groups, self.head_dim = heads.num_q_heads, heads.num_kv_heads, heads.head_dim
        self.d_state = config.resolved_ssd_state(heads.head_dim)
        self.d_conv = config.d_conv
        H, G, P, N = self.n_heads, self.n_groups, self.head_dim, self.d_state
        # in_proj rows: z [H*P] | x [G*P] | B [G*N] | C [H*N] | dt [H]
        self.splits = [H * P, G * P + G * N + H * N, H]
        self.conv_splits = [G * P, G * N, H * N]
        self.in_proj = nn.Linear(d_in, sum(self.splits), bias=config.proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(self.splits[1], config.d_conv))
        self.conv_bias = nn.Parameter(torch.zeros(self.splits[1])) if config.conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.A_log = nn.Parameter(torch.empty(H))
        self.D = nn.Parameter(torch.empty(H))
        self.norm_weight = nn.Parameter(torch.empty(H * P)) if config.ssd_norm else None
        self.out_proj = nn.Linear(H * P, self.d_out, bias=config.proj_bias)
        self._reset_ssm_parameters()

    def reset_parameters(self) -> None:
        self.in_proj.reset_parameters()
        self.out_proj.reset_parameters()
        self._reset_ssm_parameters()

    @torch.no_grad()
    def _reset_ssm_parameters(self) -> None:
        cfg = self.config
        reset_conv_(self.conv_weight, self.conv_bias, cfg.d_conv)
        self.dt_bias.copy_(initial_dt_bias(self.n_heads, cfg.dt_min, cfg.dt_max, cfg.dt_init_floor))
        self.A_log.copy_(torch.log(torch.empty(self.n_heads).uniform_(*_A_INIT_RANGE)))
        self.D.fill_(1.0)
        if self.norm_weight is not None:
            self.norm_weight.fill_(1.0)

    @torch.no_grad()
    def init_from_heads(self, heads: ReplacedHeads) -> None:
        """[ours] "reuse" init, the attention analogy of SSD: C <- W_Q (per query head),
        B <- W_K and x <- W_V (per KV group), row for row; the conv starts as the identity
        and out_proj as the identity, so head h's output lands in replaced head h's slot.
        With N = head_dim (the default) the rows copy exactly; with N < head_dim the first
        N rows of each K/Q head are copied, with N > head_dim the extra rows keep their
        init. Biases (Qwen2) are copied when the mixer has them (`proj_bias`). The gate z,
        dt, A, D and the norm have no counterpart and keep Mamba-2's init. See docs/mixers.md."""
        n_q, head_dim, hidden = heads.q.shape
        n_kv = heads.k.shape[0]
        if (n_q, n_kv, head_dim, hidden) != (self.n_heads, self.n_groups, self.head_dim, self.d_in):
            raise ValueError(
                f"mamba2 mixer for {self.n_heads} query / {self.n_groups} KV heads of {self.head_dim} channels "
                f"over {self.d_in} inputs cannot take {n_q} / {n_kv} heads of {head_dim} over {hidden}"
            )
        H, G, P, N = self.n_heads, self.n_groups, self.head_dim, self.d_state
        n = min(N, head_dim)
        first_x, first_B = H * P, H * P + G * P
        first_C = first_B + G * N
        x_rows = torch.arange(G * P) + first_x
        B_rows = (torch.arange(G)[:, None] * N + torch.arange(n) + first_B).flatten()  # first n rows of each group
        C_rows = (torch.arange(H)[:, None] * N + torch.arange(n) + first_C).flatten()  # first n rows of each head
        bias = self.in_proj.bias
        for rows, w, b in ((x_rows, heads.v, heads.v_bias), (B_rows, heads.k[:, :n], heads.k_bias), (C_rows, heads.q[:, :n], heads.q_bias)):
            self.in_proj.weight[rows] = w.reshape(-1, hidden)
            if bias is not None:
                bias[rows] = 0.0 if b is None else b[:, : w.shape[1]].flatten()
        self.conv_weight.zero_()
        self.conv_weight[:, -1] = 1.0
        if self.conv_bias is not None:
            self.conv_bias.zero_()
        self.out_proj.weight.copy_(torch.eye(self.d_out))
        if self.out_proj.bias is not None:
            self.out_proj.bias.zero_()

    @property
    def A(self) -> Tensor:
        """The per-head decay rates `[H]`, negative."""
        return -torch.exp(self.A_log)

    def _output(self, y: Tensor, z: Tensor) -> Tensor:
        """y `[..., H, P]`, z `[..., H*P]` -> out_proj(norm(y * silu(z))) `[..., d_out]`."""
        return self.out_proj(gated_rms_norm(y, z, self.norm_weight, _NORM_EPS))

    def scan_inputs(self, x: Tensor, attention_mask: Tensor | None = None, conv_state: Tensor | None = None):
        """Everything before the scan, for `x` `[B, T, d_in]`: (gate z `[B, T, H*P]`, x `[B, T, H, P]`,
        dt `[B, T, H]`, B `[B, T, G, N]`, C `[B, T, H, N]`, the conv state after the last token)."""
        z, xbc, dt = self.in_proj(x).split(self.splits, dim=-1)
        if attention_mask is not None:
            keep = attention_mask.to(xbc.dtype).unsqueeze(-1)  # [B, T, 1]
            xbc = xbc * keep  # padding feeds zeros to the conv, as an empty history does
        xbc, conv_state = causal_conv1d(xbc, self.conv_weight, self.conv_bias, conv_state)
        xs, B, C = F.silu(xbc).split(self.conv_splits, dim=-1)
        dt = F.softplus(dt + self.dt_bias)
        if attention_mask is not None:
            dt = dt * keep  # dt = 0: decay 1 and no input, the state passes unchanged
        xs = xs.unflatten(-1, (self.n_groups, self.head_dim)).repeat_interleave(self.n_heads // self.n_groups, dim=2)
        return (z, xs, dt, B.unflatten(-1, (self.n_groups, self.d_state)),
                C.unflatten(-1, (self.n_heads, self.d_state)), conv_state)

    def forward(
        self,
        x: Tensor,
        state: MixerState | None = None,
        attention_mask: Tensor | None = None,
        position_embeddings: PositionEmbeddings | None = None,
    ) -> Tensor:
        z, xs, dt, B, C, conv_state = self.scan_inputs(x, attention_mask, None if state is None else state["conv"])
        with torch.autocast(x.device.type, enabled=False):  # the scan runs in fp32, never autocast
            scan = ssd(
                xs, dt, self.A.float(), B, C, self.D,
                initial_state=None if state is None else state["ssm"],
                return_final_state=state is not None,
                backend=self.config.scan_backend,
                chunk_size=self.config.ssd_chunk,
            )
        if state is None:
            return self._output(scan, z)
        y, ssm_state = scan
        state["conv"].copy_(conv_state)
        state["ssm"].copy_(ssm_state)
        return self._output(y, z)

    def step(self, x: Tensor, state: MixerState, position_embeddings: PositionEmbeddings | None = None) -> Tensor:
        """One token, updating the state in place (the recurrence of `ssd_naive` with T = 1):
        everything between in_proj and out_proj is one op (`ops/step`): one compiled call
        when the kernels are built, one Triton kernel on a GPU."""
        g = mamba2_step(
            self.in_proj(x), state["conv"], state["ssm"], self.conv_weight, self.conv_bias, self.dt_bias, self.A_log,
            self.D, self.norm_weight, self.n_groups, _NORM_EPS, backend=self.config.scan_backend,
        )
        return self.out_proj(g)

    def as_tail(self, gate: Tensor) -> Mamba2Tail:
        """This mixer as the tail of a fused window step (`ops/window_step`), behind `gate`."""
        return Mamba2Tail(self.in_proj.weight, self.in_proj.bias, self.conv_weight, self.conv_bias, self.dt_bias,
                          self.A_log, self.D, self.norm_weight, self.out_proj.weight, self.out_proj.bias, gate,
                          self.n_groups, _NORM_EPS)

    def allocate_state(self, batch: int, dtype, device) -> MixerState:
        """`conv`: the last `d_conv` inputs, in `dtype`; `ssm`: the accumulated state, in the
        config's `state_dtype`."""
        return {
            "conv": torch.zeros(batch, self.splits[1], self.d_conv, dtype=dtype, device=device),
            "ssm": torch.zeros(batch, self.n_heads, self.head_dim, self.d_state, dtype=state_dtype(self.config), device=device),
        }
