"""The oracle: Mamba-2's SSD recurrence (scalar decay per head) as a plain fp32 loop over time.

Per batch row and head h, with a state S of shape `[P, N]`:

    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T
    y_t = S_t C_t + D_h x_t

B and C may be shared by groups of heads (as K and V are shared in grouped-query
attention): with G groups, head h reads group `h // (H / G)`.

Slow on purpose: one step at a time, no tricks, so that it is easy to trust.
"""

from __future__ import annotations

import torch
from torch import Tensor


def per_head(t: Tensor, heads: int) -> Tensor:
    """Group-shared `[B, T, G, N]` -> one copy per head `[B, T, H, N]` (head h reads group h // (H / G))."""
    groups = t.shape[2]
    if heads % groups:
        raise ValueError(f"{heads} heads cannot share {groups} groups evenly")
    return t if groups == heads else t.repeat_interleave(heads // groups, dim=2)


def ssd_naive(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    initial_state: Tensor | None = None,
    return_final_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Run the recurrence step by step in fp32.

    Args:
        x: inputs `[B, T, H, P]`.
        dt: positive step sizes `[B, T, H]` (softplus already applied); 0 leaves the state as is.
        A: negative decay rates `[H]`.
        B: input projections `[B, T, G, N]`, G dividing H.
        C: output projections `[B, T, G', N]`, G' dividing H.
        D: skip weight `[H]`.
        initial_state: state before the first step `[B, H, P, N]` (zeros if None).
        return_final_state: also return the state after the last step.

    Returns:
        y `[B, T, H, P]` in the dtype of `x`, and the final state `[B, H, P, N]` (fp32) if asked.
    """
    dtype = x.dtype
    batch, length, heads, head_dim = x.shape
    x, dt, A = x.float(), dt.float(), A.float()
    B, C = per_head(B.float(), heads), per_head(C.float(), heads)
    state = x.new_zeros(batch, heads, head_dim, B.shape[-1]) if initial_state is None else initial_state.float()
    ys = []
    # unbind, not x[:, t]: the backward of T slices would build T full-size gradients.
    for x_t, dt_t, B_t, C_t in zip(x.unbind(1), dt.unbind(1), B.unbind(1), C.unbind(1)):
        decay = torch.exp(dt_t * A)[:, :, None, None]  # [B, H, 1, 1]
        state = decay * state + (dt_t[..., None] * x_t)[..., None] * B_t[:, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C_t))
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(batch, 0, heads, head_dim)
    if D is not None:
        y = y + x * D.float()[:, None]
    y = y.to(dtype)
    return (y, state) if return_final_state else y
