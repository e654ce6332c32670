"""Mamba-1 block (selective SSM), the paper's mixer.

    x, z   = in_proj(h)                     # two branches of width d_inner
    x      = silu(causal_conv1d(x))
    dt,B,C = x_proj(x);  delta = softplus(dt_proj(dt))
    y      = selective_scan(x, delta, A=-exp(A_log), B, C, D) * silu(z)
    out    = out_proj(y)                    # -> d_out, the replaced heads' channels

Parameterization and initialization follow Mamba (Gu & Dao, 2023): A_log = log(1..N),
dt bias = inverse softplus of a log-uniform dt in [dt_min, dt_max], D = 1.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.conv import causal_conv1d
from ..ops.selective_scan import selective_scan
from ..ops.step import mamba_step
from ..ops.window_step import MambaTail
from .base import HeadShape, Mixer, MixerState, PositionEmbeddings, ReplacedHeads, register_mixer, state_dtype
from .config import MixerConfig
from .ssm_init import initial_dt_bias, reset_conv_


@register_mixer("mamba")
class MambaMixer(Mixer):
    """Mamba-1 mixer `[B, T, d_in] -> [B, T, d_out]` with state `conv [B, d_inner, d_conv]`
    and `ssm [B, d_inner, d_state]`. Of the replaced heads it uses only their width
    `d_out`; it has no notion of position (`position_embeddings` are ignored)."""

    reads = frozenset({"d_state", "d_conv", "expand", "dt_rank", "dt_min", "dt_max", "dt_init_floor", "conv_bias",
                       "proj_bias", "scan_backend", "state_dtype"})

    def __init__(self, d_in: int, heads: HeadShape, config: MixerConfig):
        super().__init__()
        d_out = heads.d_out
        self.d_in, self.d_out, self.config = d_in, d_out, config
        self.d_inner = d_inner = config.inner_width(d_out)
        self.d_state, self.d_conv = config.d_state, config.d_conv
        self.dt_rank = config.resolved_dt_rank(d_in)

        self.in_proj = nn.Linear(d_in, 2 * d_inner, bias=config.proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(d_inner, config.d_conv))
        self.conv_bias = nn.Parameter(torch.zeros(d_inner)) if config.conv_bias else None
        self.x_proj = nn.Linear(d_inner, self.dt_rank + 2 * config.d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, d_inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(d_inner, config.d_state))
        self.D = nn.Parameter(torch.empty(d_inner))
        self.out_proj = nn.Linear(d_inner, d_out, bias=config.proj_bias)
        self._reset_ssm_parameters()

    def reset_parameters(self) -> None:
        for linear in (self.in_proj, self.x_proj, self.dt_proj, self.out_proj):
            linear.reset_parameters()
        self._reset_ssm_parameters()

    @torch.no_grad()
    def init_from_heads(self, heads: ReplacedHeads) -> None:
        """[ours] "reuse" init: the x branch reads what the replaced heads' values read,
        the conv starts as the identity and out_proj puts channel i of the recurrence in
        channel i of the replaced heads' slots, so the unchanged o_proj sees value-like inputs.
        Q and K have no counterpart here (B and C are read from the conv'd x branch), and
        the gate z, dt, A and D keep Mamba's initialization. See docs/method.md."""
        n_q, head_dim, hidden = heads.q.shape
        values = heads.v.repeat_interleave(heads.group_size, dim=0).reshape(n_q * head_dim, hidden)
        rows = min(self.d_inner, values.shape[0])
        self.in_proj.weight[:rows].copy_(values[:rows])
        if self.in_proj.bias is not None:
            self.in_proj.bias.zero_()
            if heads.v_bias is not None:
                self.in_proj.bias[:rows].copy_(heads.v_bias.repeat_interleave(heads.group_size, dim=0).flatten()[:rows])
        self.conv_weight.zero_()
        self.conv_weight[:, -1] = 1.0
        if self.conv_bias is not None:
            self.conv_bias.zero_()
        self.out_proj.weight.copy_(torch.eye(self.d_out, self.d_inner))
        if self.out_proj.bias is not None:
            self.out_proj.bias.zero_()

    @torch.no_grad()
    def _reset_ssm_parameters(self) -> None:
        """Mamba's initialization of the conv, dt, A and D parameters."""
        cfg = self.config
        reset_conv_(self.conv_weight, self.conv_bias, cfg.d_conv)
        std = self.dt_rank**-0.5
        self.dt_proj.weight.uniform_(-std, std)
        self.dt_proj.bias.copy_(initial_dt_bias(self.d_inner, cfg.dt_min, cfg.dt_max, cfg.dt_init_floor))
        self.A_log.copy_(torch.log(torch.arange(1, cfg.d_state + 1, dtype=torch.float32)).repeat(self.d_inner, 1))
        self.D.fill_(1.0)

    def _ssm_inputs(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x `[..., d_inner]` -> delta `[..., d_inner]`, B and C `[..., d_state]`."""
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        return F.softplus(self.dt_proj(dt)), B, C

    def forward(
        self,
        x: Tensor,
        state: MixerState | None = None,
        attention_mask: Tensor | None = None,
        position_embeddings: PositionEmbeddings | None = None,
    ) -> Tensor:
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        if attention_mask is not None:
            keep = attention_mask.to(xs.dtype).unsqueeze(-1)  # [B, T, 1]
            xs = xs * keep  # padding feeds zeros to the conv, as an empty history does
        xs, conv_state = causal_conv1d(xs, self.conv_weight, self.conv_bias, None if state is None else state["conv"])
        xs = F.silu(xs)
        delta, B, C = self._ssm_inputs(xs)
        if attention_mask is not None:
            delta = delta * keep  # delta = 0: decay 1 and no input, the state passes unchanged
        A = self.A.float()
        with torch.autocast(xs.device.type, enabled=False):  # the scan runs in fp32, never autocast
            scan = selective_scan(
                xs, delta, A, B, C, self.D, z,
                initial_state=None if state is None else state["ssm"],
                return_final_state=state is not None,
                backend=self.config.scan_backend,
            )
        if state is None:
            return self.out_proj(scan)
        y, ssm_state = scan
        state["conv"].copy_(conv_state)
        state["ssm"].copy_(ssm_state)
        return self.out_proj(y)

    def step(self, x: Tensor, state: MixerState, position_embeddings: PositionEmbeddings | None = None) -> Tensor:
        """One token, updating the state in place (the recurrence of `selective_scan_naive`
        with T = 1): everything between in_proj and out_proj is one op (`ops/step`), one
        compiled call when the kernels are built."""
        y = mamba_step(
            self.in_proj(x), state["conv"], state["ssm"], self.conv_weight, self.conv_bias, self.x_proj.weight,
            self.dt_proj.weight, self.dt_proj.bias, self.A_log, self.D, backend=self.config.scan_backend,
        )
        return self.out_proj(y)

    def as_tail(self, gate: Tensor) -> MambaTail:
        """This mixer as the tail of a fused window step (`ops/window_step`), behind `gate`."""
        return MambaTail(self.in_proj.weight, self.in_proj.bias, self.conv_weight, self.conv_bias, self.x_proj.weight,
                         self.dt_proj.weight, self.dt_proj.bias, self.A_log, self.D, self.out_proj.weight,
                         self.out_proj.bias, gate)

    @property
    def A(self) -> Tensor:
        """The state decay rates `[d_inner, d_state]`, negative."""
        return -torch.exp(self.A_log)

    def allocate_state(self, batch: int, dtype, device) -> MixerState:
        """`conv`: the last `d_conv` inputs, in `dtype`; `ssm`: the accumulated state, in the
        config's `state_dtype`."""
        return {
            "conv": torch.zeros(batch, self.d_inner, self.d_conv, dtype=dtype, device=device),
            "ssm": torch.zeros(batch, self.d_inner, self.d_state, dtype=state_dtype(self.config), device=device),
        }
