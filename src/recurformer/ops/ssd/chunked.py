"""Fast CPU SSD: the Mamba-2 scan as a few batched matmuls per chunk (Dao & Gu, 2024).

With a scalar decay per head, the recurrence of `ssd_naive` unrolls into

    y_i = sum_{j <= i} (C_i . B_j) exp(a_{j+1} + ... + a_i) dt_j x_j,     a_k = dt_k A <= 0,

a masked "attention" with a decay mask. Time is cut into chunks of l steps; per chunk:

1. intra-chunk: the quadratic form above restricted to the chunk, `(C B^T * L) (dt x)`,
   where `L[i, j] = exp(segment sum of a over (j, i])` is the decay mask;
2. chunk state from a zero start: `S_c = sum_j L[l-1, j] dt_j x_j B_j^T`;
3. state passing: `H_{c+1} = exp(sum of a over chunk c) H_c + S_c`, the only sequential
   part (one small op per chunk);
4. inter-chunk: `y_i += exp(a_1 + ... + a_i) C_i . H_c`.

Stability: every exponent is a sum of `a_k <= 0`, so every factor is in (0, 1] and
nothing can overflow. The segment sums are summed directly over their segment (a masked
cumulative sum), never taken as a difference of two prefix sums, which would lose all
precision in chunks with stiff decays (|a| large). Exponents are floored at -40, so that
no product becomes denormal (~100x slower on x86); this changes a term by less than
4e-18 of its size.

A ragged tail is padded with `dt = 0` (decay 1, no input), which leaves the final state
exact. Plain PyTorch ops throughout, so autograd gives the backward pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .naive import per_head

_EXP_FLOOR = -40.0
DEFAULT_CHUNK = 64


def ssd_chunked(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    initial_state: Tensor | None = None,
    return_final_state: bool = False,
    *,
    chunk_size: int = DEFAULT_CHUNK,
) -> Tensor | tuple[Tensor, Tensor]:
    """SSD in chunks of `chunk_size` steps; same signature and results as `ssd_naive`.

    Args:
        x `[B, T, H, P]`, dt `[B, T, H]`, A `[H]`, B `[B, T, G, N]`, C `[B, T, G', N]`,
        D `[H]`, initial_state `[B, H, P, N]`: as in `ssd_naive`.
        chunk_size: steps per chunk (any positive value; T need not be a multiple).

    Returns:
        y `[B, T, H, P]` in the dtype of `x`, and the final state `[B, H, P, N]` (fp32) if asked.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    dtype = x.dtype
    batch, length, heads, head_dim = x.shape
    B, C = per_head(B.float(), heads), per_head(C.float(), heads)
    n_state = B.shape[-1]
    state = x.new_zeros(batch, heads, head_dim, n_state, dtype=torch.float32) if initial_state is None else initial_state.float()
    if length == 0:
        y = x.new_zeros(batch, 0, heads, head_dim)
        return (y, state) if return_final_state else y
    x32, dt = x.float(), dt.float()

    chunk = min(chunk_size, length)
    chunks = -(-length // chunk)
    pad = chunks * chunk - length

    def chunked(t: Tensor) -> Tensor:
        """`[B, T, H, ...]` -> `[B, H, chunks, chunk, ...]`, the tail padded with zeros."""
        if pad:
            t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(batch, chunks, chunk, heads, *t.shape[3:]).movedim(3, 1)

    a = chunked(dt * A.float())  # [B, H, c, l], <= 0
    u = chunked(x32 * dt[..., None])  # [B, H, c, l, P]
    B_c, C_c = chunked(B), chunked(C)  # [B, H, c, l, N]

    # seg[i, j] = a_{j+1} + ... + a_i for i >= j, summed over the segment itself.
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    strict = causal.tril(-1)
    seg = (a[..., :, None] * strict).cumsum(dim=-2)  # [B, H, c, l, l]
    mask = torch.exp(seg.clamp_min(_EXP_FLOOR)) * causal

    y = (C_c @ B_c.transpose(-1, -2) * mask) @ u  # intra-chunk, [B, H, c, l, P]
    to_end = mask[..., -1, :, None]  # decay from step j to the chunk's end, [B, H, c, l, 1]
    chunk_states = (u * to_end).transpose(-1, -2) @ B_c  # from a zero start, [B, H, c, P, N]
    chunk_decay = torch.exp(a.sum(dim=-1).clamp_min(_EXP_FLOOR))  # [B, H, c]

    starts = []
    for c in range(chunks):
        starts.append(state)
        state = chunk_decay[:, :, c, None, None] * state + chunk_states[:, :, c]
    starts = torch.stack(starts, dim=2)  # the state entering each chunk, [B, H, c, P, N]
    from_start = torch.exp(a.cumsum(dim=-1).clamp_min(_EXP_FLOOR))[..., None]  # [B, H, c, l, 1]
    y = y + (C_c @ starts.transpose(-1, -2)) * from_start  # inter-chunk

    y = y.movedim(1, 3).reshape(batch, chunks * chunk, heads, head_dim)[:, :length]
    if D is not None:
        y = y + x32 * D.float()[:, None]
    y = y.to(dtype)
    return (y, state) if return_final_state else y
