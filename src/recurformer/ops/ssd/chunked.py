"""Fast CPU SSD: the Mamba-2 scan as a few batched matmuls per chunk (Dao & Gu, 2024).

With a scalar decay per head, the recurrence of `ssd_naive` unrolls into

    y_i = sum_{j <= i} (C_i . B_j) exp(a_{j+1} + ... + a_i) dt_j x_j,     a_k = dt_k A <= 0,

a masked "attention" with a decay mask. Time is cut into chunks of l steps; per chunk:

1. intra-chunk: the quadratic form above restricted to the chunk, `(C B^T * L) (dt x)`,
   where `L[i, j] = exp(segment sum of a over (j, i])` is the decay mask;
2. chunk state from a zero start: `S_c = sum_j L[l-1, j] dt_j x_j B_j^T`;
3. state passing: `H_{c+1} = exp(sum of a over chunk c) H_c + S_c`, the only sequential
   part, solved by the same decay-mask matmul over chunks (`linear_recurrence`: in blocks
   of chunks, a few ops per level, never one op per chunk);
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
RECURRENCE_BLOCK = 32


def decay_mask(exponents: Tensor) -> Tensor:
    """exponents `[..., n]` (each <= 0) -> `[..., n, n]`: `exp(exponents[j+1] + ... +
    exponents[i])` for i >= j (1 on the diagonal), 0 above it; each sum taken over its own
    segment (stable for any decays), floored at `_EXP_FLOOR`."""
    n = exponents.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=exponents.device).tril()
    segments = (exponents[..., :, None] * causal.tril(-1)).cumsum(dim=-2)
    return torch.exp(segments.clamp_min(_EXP_FLOOR)) * causal


def linear_recurrence(exponents: Tensor, inputs: Tensor, block: int = RECURRENCE_BLOCK) -> Tensor:
    """Every h_i of h_0 = inputs_0, h_i = exp(exponents_i) h_{i-1} + inputs_i, with no loop over i.

    Args:
        exponents `[B, H, n]` (<= 0; the first is not used), inputs `[B, H, n, F]`.
        block: at most this many steps are solved as one masked matmul (`decay_mask`); a longer
            sequence is cut into blocks, each solved from zero, and the blocks' ends are
            passed on by the same recurrence one level up (log_block(n) levels).

    Returns:
        h `[B, H, n, F]`.
    """
    n = exponents.shape[-1]
    if n <= block:
        return decay_mask(exponents) @ inputs
    blocks = -(-n // block)
    pad = blocks * block - n  # zero steps at the end change nothing before them
    exponents = F.pad(exponents, (0, pad)).unflatten(-1, (blocks, block))  # [B, H, m, b]
    inputs = F.pad(inputs, (0, 0, 0, pad)).unflatten(2, (blocks, block))  # [B, H, m, b, F]
    local = decay_mask(exponents) @ inputs  # each block from a zero start
    ends = linear_recurrence(exponents.sum(dim=-1), local[:, :, :, -1], block)  # h at each block's end
    before = F.pad(ends[:, :, :-1], (0, 0, 1, 0))  # h entering each block, [B, H, m, F]
    carried = torch.exp(exponents.cumsum(dim=-1).clamp_min(_EXP_FLOOR))[..., None] * before[:, :, :, None]
    return (local + carried).flatten(2, 3)[:, :, :n]


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

    mask = decay_mask(a)  # [B, H, c, l, l]: exp(a_{j+1} + ... + a_i) for i >= j

    y = (C_c @ B_c.transpose(-1, -2) * mask) @ u  # intra-chunk, [B, H, c, l, P]
    to_end = mask[..., -1, :, None]  # decay from step j to the chunk's end, [B, H, c, l, 1]
    chunk_states = (u * to_end).transpose(-1, -2) @ B_c  # from a zero start, [B, H, c, P, N]

    # The state entering each chunk, [B, H, c, P, N], and the final one: H_0 = the initial
    # state, H_{c+1} = exp(chunk c's exponent sum) H_c + S_c.
    exponents = F.pad(a.sum(dim=-1), (1, 0))  # [B, H, 1 + c]: the first is never used
    inputs = torch.cat([state[:, :, None], chunk_states], dim=2)  # [B, H, 1 + c, P, N]
    entering = linear_recurrence(exponents, inputs.flatten(3)).unflatten(3, (head_dim, n_state))
    starts, state = entering[:, :, :-1], entering[:, :, -1]
    from_start = torch.exp(a.cumsum(dim=-1).clamp_min(_EXP_FLOOR))[..., None]  # [B, H, c, l, 1]
    y = y + (C_c @ starts.transpose(-1, -2)) * from_start  # inter-chunk

    y = y.movedim(1, 3).reshape(batch, chunks * chunk, heads, head_dim)[:, :length]
    if D is not None:
        y = y + x32 * D.float()[:, None]
    y = y.to(dtype)
    return (y, state) if return_final_state else y
