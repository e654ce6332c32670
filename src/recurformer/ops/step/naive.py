"""The decode steps of the mamba and mamba2 mixers in plain PyTorch: the oracle of
`step/compiled.py`, and the path taken wherever the compiled kernels are not.

Each runs one token through everything between the mixer's in_proj and out_proj (the
conv's update, SiLU, projections, softplus, the recurrence with T = 1, D, the gate), and
updates the conv and SSM states in place. The recurrence is computed in fp32 whatever the
activations' dtype (a state rounded at every token would drift from the prefill's fp32
scan); the result is cast back to the activations' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..conv import causal_conv1d_step
from ..gated_norm import gated_rms_norm

# Decays below e^-80 are kept at e^-80: exp would otherwise return denormals, which are
# ~100x slower on x86 and change the state by less than 1e-34 of its size.
_EXP_FLOOR = -80.0


def mamba_step_naive(
    xz: Tensor,
    conv_state: Tensor,
    ssm_state: Tensor,
    conv_weight: Tensor,
    conv_bias: Tensor | None,
    x_proj_weight: Tensor,
    dt_proj_weight: Tensor,
    dt_proj_bias: Tensor,
    A_log: Tensor,
    D: Tensor,
) -> Tensor:
    """One token of the Mamba-1 mixer between in_proj and out_proj.

    Args:
        xz: in_proj's output `[B, 2 Di]` (x, then the gate z).
        conv_state: the conv's last inputs `[B, Di, K]`, updated in place.
        ssm_state: the recurrent state `[B, Di, N]`, updated in place.
        conv_weight `[Di, K]`, conv_bias `[Di]`, x_proj_weight `[R + 2N, Di]`,
        dt_proj_weight `[Di, R]`, dt_proj_bias `[Di]`, A_log `[Di, N]` (A = -exp(A_log)),
        D `[Di]`: the mixer's parameters.

    Returns:
        The gated output `[B, Di]` in the dtype of `xz`.
    """
    dt_rank, n_state = dt_proj_weight.shape[1], A_log.shape[1]
    x, z = xz.chunk(2, dim=-1)
    x, conv = causal_conv1d_step(x, conv_weight, conv_bias, conv_state)
    conv_state.copy_(conv)
    x = F.silu(x)
    dt, B, C = F.linear(x, x_proj_weight).split([dt_rank, n_state, n_state], dim=-1)
    delta = F.softplus(F.linear(dt, dt_proj_weight, dt_proj_bias))
    u, delta, B, C, z = (t.float() for t in (x, delta, B, C, z))
    decay = torch.exp((delta.unsqueeze(-1) * -torch.exp(A_log.float())).clamp_min(_EXP_FLOOR))  # [B, Di, N]
    ssm = ssm_state.float()  # the state itself when it is fp32
    ssm.mul_(decay).addcmul_((delta * u).unsqueeze(-1), B.unsqueeze(1))
    ssm_state.copy_(ssm)  # a no-op for an fp32 state
    y = torch.bmm(ssm, C.unsqueeze(-1)).squeeze(-1) + D.float() * u
    return (y * F.silu(z)).to(xz.dtype)


def mamba2_step_naive(
    zxbcdt: Tensor,
    conv_state: Tensor,
    ssm_state: Tensor,
    conv_weight: Tensor,
    conv_bias: Tensor | None,
    dt_bias: Tensor,
    A_log: Tensor,
    D: Tensor,
    norm_weight: Tensor | None,
    groups: int,
    eps: float,
) -> Tensor:
    """One token of the Mamba-2 mixer between in_proj and out_proj.

    Args:
        zxbcdt: in_proj's output `[B, H P + G P + G N + H N + H]`: the gate z, the conv's
            channels (x `[G, P]`, B `[G, N]`, C `[H, N]`), then dt `[H]`.
        conv_state: the conv's last inputs `[B, G P + G N + H N, K]`, updated in place.
        ssm_state: the recurrent state `[B, H, P, N]`, updated in place.
        conv_weight `[channels, K]`, conv_bias `[channels]`, dt_bias, A_log (A = -exp(A_log))
        and D `[H]`, norm_weight `[H P]` (None: no norm): the mixer's parameters.
        groups: G, the groups of heads sharing x and B. eps: the norm's epsilon.

    Returns:
        The gated, normalized output `[B, H P]` in the dtype of `zxbcdt`.
    """
    _, heads, head_dim, n_state = ssm_state.shape
    z, xbc, dt = zxbcdt.split([heads * head_dim, conv_weight.shape[0], heads], dim=-1)
    xbc, conv = causal_conv1d_step(xbc, conv_weight, conv_bias, conv_state)
    conv_state.copy_(conv)
    x, B, C = F.silu(xbc).split([groups * head_dim, groups * n_state, heads * n_state], dim=-1)
    dt = F.softplus(dt + dt_bias)  # [B, H]
    per_group = heads // groups
    x = x.unflatten(-1, (groups, head_dim)).repeat_interleave(per_group, dim=1)  # [B, H, P]
    B = B.unflatten(-1, (groups, n_state)).repeat_interleave(per_group, dim=1)  # [B, H, N]
    C = C.unflatten(-1, (heads, n_state))  # [B, H, N]
    x, dt, B, C = (t.float() for t in (x, dt, B, C))
    decay = torch.exp((dt * -torch.exp(A_log.float())).clamp_min(_EXP_FLOOR))  # [B, H]
    ssm = ssm_state.float()  # the state itself when it is fp32
    ssm.mul_(decay[..., None, None]).add_((dt[..., None] * x)[..., None] * B[:, :, None, :])
    ssm_state.copy_(ssm)  # a no-op for an fp32 state
    y = (ssm @ C[..., None]).squeeze(-1) + D.float()[:, None] * x
    return gated_rms_norm(y.to(z.dtype), z, norm_weight, eps)
