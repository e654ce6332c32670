"""The oracle: the Mamba-1 (S6) selective scan as a plain fp32 loop over time.

    h_t = exp(delta_t * A) * h_{t-1} + delta_t * B_t * u_t
    y_t = C_t . h_t + D * u_t,        then y_t *= silu(z_t) if a gate is given

Slow on purpose: one step at a time, no tricks, so that it is easy to trust.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def selective_scan_naive(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    initial_state: Tensor | None = None,
    return_final_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Run the recurrence step by step in fp32.

    Args:
        u: inputs `[B, T, D]`.
        delta: positive step sizes `[B, T, D]` (softplus already applied).
        A: negative state decay rates `[D, N]`.
        B, C: input and output projections `[B, T, N]`, shared by all channels.
        D: skip weight `[D]`.
        z: gate `[B, T, D]`; the output is multiplied by `silu(z)`.
        initial_state: state before the first step `[B, D, N]` (zeros if None).
        return_final_state: also return the state after the last step.

    Returns:
        y `[B, T, D]` in the dtype of `u`, and the final state `[B, D, N]` (fp32) if asked.
    """
    dtype = u.dtype
    u, delta, A, B, C = (t.float() for t in (u, delta, A, B, C))
    batch, length, channels = u.shape
    h = u.new_zeros(batch, channels, A.shape[1]) if initial_state is None else initial_state.float()
    ys = []
    for t in range(length):
        decay = torch.exp(delta[:, t, :, None] * A)  # [B, D, N]
        h = decay * h + (delta[:, t] * u[:, t])[:, :, None] * B[:, t, None, :]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, t]))
    y = torch.stack(ys, dim=1) if ys else u.new_zeros(batch, 0, channels)
    if D is not None:
        y = y + u * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(dtype)
    return (y, h) if return_final_state else y
