"""Fast CPU selective scan: the recurrence solved a segment of steps at a time, in log space.

Within a segment of l steps that starts from state H, with cum_t = delta_1 + ... + delta_t
(per channel) and S_t = A * cum_t (per channel and state), the recurrence

    h_t = exp(delta_t * A) * h_{t-1} + delta_t * u_t * B_t,        y_t = C_t . h_t

has the closed form

    h_t = exp(S_t) * H + sum_{s <= t} exp(S_t - S_s) * delta_s * u_s * B_s.

Splitting exp(S_t - S_s) = E_t / E_s with E_t = exp(S_t - m), the sum becomes one batched
matmul (a lower-triangular matrix that also carries B, times delta*u / E), followed by an
elementwise product with E and a small matmul with C. Everything is dense eager PyTorch:
a handful of passes over [B, N, l, D] tensors small enough to stay in cache, one Python
iteration per segment instead of one per step.

Stability. m is the midpoint of the segment's log decay (S_l / 2), so every exponent lies
in [-R/2, R/2] where R = max |A| * sum(delta) over the segment. Segments are cut so that
R <= 80: then exp never overflows and never produces denormals (which are ~100x slower
on x86). Where a single step already decays by more than e^-80, that step becomes its
own segment and its exponents are clamped at -40: a decay factor below e^-40 (4e-18)
is then kept as e^-40, which changes the state by less than 4e-18 of its magnitude.

The backward pass is written out by hand (`_ChunkedScan`): it recomputes each segment
from its saved start state, so memory stays O(B * T * D + T / l * B * N * D) instead of
storing [B, T, D, N] intermediates.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Largest log-decay range max|A| * sum(delta) allowed inside one segment: exponents are
# then within [-40, 40], far from exp's overflow (88) and from the denormal range (-87).
_MAX_RANGE = 80.0
# Exponent floor for single steps that decay by more than e^-_MAX_RANGE on their own.
_EXP_FLOOR = -40.0


def selective_scan_chunked(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    initial_state: Tensor | None = None,
    return_final_state: bool = False,
    *,
    chunk_size: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Selective scan in chunks of steps; same signature and results as `selective_scan_naive`.

    Args:
        u: inputs `[B, T, D]`.
        delta: positive step sizes `[B, T, D]` (softplus already applied).
        A: negative state decay rates `[D, N]`.
        B, C: input and output projections `[B, T, N]`.
        D: skip weight `[D]`.
        z: gate `[B, T, D]`; the output is multiplied by `silu(z)`.
        initial_state: state before the first step `[B, D, N]` (zeros if None).
        return_final_state: also return the state after the last step.
        chunk_size: steps per segment (default: chosen from the tensor sizes). Segments
            are cut shorter where the state decays too fast for one log-space block.

    Returns:
        y `[B, T, D]` in the dtype of `u`, and the final state `[B, D, N]` (fp32) if asked.
        Computed in fp32; differentiable w.r.t. every tensor argument.
    """
    dtype = u.dtype
    u, delta, A, B, C = (t.float() for t in (u, delta, A, B, C))
    batch, _, channels = u.shape
    n_state = A.shape[1]
    if chunk_size is None:
        chunk_size = _default_chunk(batch, channels, n_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if initial_state is None:
        h0 = u.new_zeros(batch, n_state, channels)
    else:
        h0 = initial_state.float().transpose(1, 2)  # [B, N, D]: channels innermost, like u
    y, h_last = _ChunkedScan.apply(delta * u, delta, A.t(), B, C, h0, chunk_size)
    if D is not None:
        y = y + u * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(dtype)
    return (y, h_last.transpose(1, 2)) if return_final_state else y


def _default_chunk(batch: int, channels: int, n_state: int) -> int:
    """Steps per segment so that one [B, N, l, D] buffer stays near 1 MB (cache-sized)."""
    steps = (1 << 18) // max(1, batch * n_state * channels)
    return max(8, min(64, 1 << max(0, steps.bit_length() - 1)))


class _ChunkedScan(torch.autograd.Function):
    """h_t = exp(delta_t A) h_{t-1} + du_t B_t, y_t = C_t . h_t, over segments.

    Inputs: du, delta `[B, T, D]` (du = delta * u), A_t `[N, D]`, B, C `[B, T, N]`,
    h0 `[B, N, D]`. Outputs: y `[B, T, D]`, final state `[B, N, D]`.
    """

    @staticmethod
    def forward(ctx, du, delta, A_t, B, C, h0, chunk):
        du, delta, B, C, h0 = (t.contiguous() for t in (du, delta, B, C, h0))
        A_t = A_t.contiguous()
        segments = _plan(delta, A_t, chunk)
        work = _Workspace(du, A_t.shape[0], chunk)
        starts = [h0]  # state before each segment; the backward recomputes from these
        ys = []
        for t0, t1 in segments:
            parts = _Segment(work, du, delta, A_t, B, C, t0, t1)
            h = parts.states(starts[-1])
            ys.append(torch.matmul(C[:, t0:t1, None, :], h.transpose(1, 2)).squeeze(2))
            starts.append(h[:, :, -1].clone())
        y = torch.cat(ys, dim=1) if ys else du.new_zeros(du.shape)
        ctx.segments = segments
        ctx.chunk = chunk
        ctx.save_for_backward(du, delta, A_t, B, C, *starts)
        return y, starts[-1]

    @staticmethod
    def backward(ctx, gy, g_last):
        du, delta, A_t, B, C, *starts = ctx.saved_tensors
        gy = torch.zeros_like(du) if gy is None else gy.float().contiguous()
        g_state = torch.zeros_like(starts[0]) if g_last is None else g_last.float().contiguous()
        work = _Workspace(du, A_t.shape[0], ctx.chunk, backward=True)
        g_du, g_delta = torch.empty_like(du), torch.empty_like(delta)
        g_B, g_C = torch.empty_like(B), torch.empty_like(C)
        g_A = torch.zeros_like(A_t)
        for (t0, t1), h_start in zip(reversed(ctx.segments), reversed(starts[:-1])):
            parts = _Segment(work, du, delta, A_t, B, C, t0, t1)
            g_state = parts.backward(h_start, gy[:, t0:t1], g_state, g_du, g_delta, g_B, g_C, g_A)
        return g_du, g_delta, g_A, g_B, g_C, g_state, None


def _plan(delta: Tensor, A_t: Tensor, chunk: int) -> list[tuple[int, int]]:
    """Cut [0, T) into segments of at most `chunk` steps whose log-decay range fits.

    The range of a segment is max over (batch, channel) of max_n |A| * sum(delta): the
    largest |S| from its start to its end (delta >= 0). Full chunks are checked with one
    reduction; only chunks over the limit are cut further, greedily.
    """
    batch, length, channels = delta.shape
    a_max = A_t.abs().amax(0)  # [D]
    n_full = length // chunk
    bounds = [(c * chunk, (c + 1) * chunk) for c in range(n_full)]
    sums = delta[:, : n_full * chunk].reshape(batch, n_full, chunk, channels).sum(2)
    if n_full * chunk < length:
        bounds.append((n_full * chunk, length))
        sums = torch.cat([sums, delta[:, n_full * chunk :].sum(1, keepdim=True)], dim=1)
    ranges = (sums * a_max).amax(dim=(0, 2)).tolist()
    segments = []
    for (t0, t1), r in zip(bounds, ranges):
        segments.extend([(t0, t1)] if r <= _MAX_RANGE else _split_stiff(delta, a_max, t0, t1))
    return segments


def _split_stiff(delta: Tensor, a_max: Tensor, t0: int, t1: int) -> list[tuple[int, int]]:
    """Greedy cut of [t0, t1): each piece is the longest prefix that fits (at least one step)."""
    prefix = F.pad(delta[:, t0:t1].double().cumsum(1), (0, 0, 1, 0))  # [B, l + 1, D]
    pieces, s, length = [], 0, t1 - t0
    while s < length:
        ranges = ((prefix[:, s + 1 :] - prefix[:, s : s + 1]) * a_max).amax(dim=(0, 2))
        k = max(1, int((ranges <= _MAX_RANGE).sum()))  # ranges grow with k: count = last fit
        pieces.append((t0 + s, t0 + s + k))
        s += k
    return pieces


class _Workspace:
    """Reusable flat buffers, viewed per segment as contiguous [B, N, l(+1), D] blocks."""

    def __init__(self, like: Tensor, n_state: int, chunk: int, backward: bool = False):
        batch, _, channels = like.shape
        size = batch * n_state * (chunk + 1) * max(channels, chunk + 1)
        names = ("E", "Y", "G", "M") + (("P", "W", "gY", "K", "M2") if backward else ())
        self.buffers = {name: like.new_empty(size) for name in names}
        self.tril = torch.ones(chunk, chunk, dtype=like.dtype).tril_()

    def view(self, name: str, *shape: int) -> Tensor:
        numel = 1
        for s in shape:
            numel *= s
        return self.buffers[name][:numel].view(shape)


class _Segment:
    """Steps [t0, t1) of the scan: the log-space forward, and its hand-written adjoint.

    Shapes: b batch, n state, t/s steps in the segment (l of them), d channels. The extra
    row l of E / Y holds the carried state: Y[l] = exp(m) * H enters every h_t with weight 1.
    """

    def __init__(self, work, du, delta, A_t, B, C, t0, t1):
        self.work, self.A_t = work, A_t
        self.du, self.delta = du[:, t0:t1], delta[:, t0:t1]  # [b, l, d]
        self.B, self.C = B[:, t0:t1], C[:, t0:t1]  # [b, l, n]
        self.t0, self.t1 = t0, t1
        self.batch, self.length, self.channels = self.du.shape
        self.n_state = A_t.shape[0]

    def _centring(self) -> Tensor:
        """[l + 1, l]: rows t < l give cum_t - cum_l / 2, row l gives cum_l / 2."""
        length = self.length
        tril = self.work.tril[:length, :length]
        return torch.cat([tril - 0.5, tril.new_full((1, length), 0.5)])

    def states(self, H: Tensor) -> Tensor:
        """All states h_t of the segment `[b, n, l, d]` (a workspace view), from start state H."""
        b, n, length, d = self.batch, self.n_state, self.length, self.channels
        work = self.work
        self.centring = self._centring()
        self.cmh = torch.matmul(self.centring, self.delta)  # [b, l + 1, d]
        # E[t] = exp(A (cum_t - cum_l / 2)); E[l] = exp(A cum_l / 2) = exp(m)
        E = work.view("E", b, n, length + 1, d)
        torch.mul(self.cmh[:, None], self.A_t[:, None, :], out=E)
        if length == 1:  # the only segments allowed to exceed the range: see module docstring
            E.clamp_(min=_EXP_FLOOR)
        E.exp_()
        Y = work.view("Y", b, n, length + 1, d)
        torch.div(self.du[:, None], E[:, :, :length], out=Y[:, :, :length])
        torch.mul(E[:, :, length], H, out=Y[:, :, length])
        # M[t, s] = [s <= t] B_s for s < l, and 1 for the carried-state column s = l
        M = work.view("M", b, n, length, length + 1)
        torch.mul(work.tril[:length, :length], self.B.transpose(1, 2)[:, :, None, :], out=M[..., :length])
        M[..., length] = 1.0
        G = work.view("G", b, n, length, d)
        torch.bmm(M.view(b * n, length, length + 1), Y.view(b * n, length + 1, d), out=G.view(b * n, length, d))
        G.mul_(E[:, :, :length])
        self.E, self.Y, self.M = E, Y, M
        return G

    def backward(self, H, gy, g_end, g_du, g_delta, g_B, g_C, g_A) -> Tensor:
        """Write this segment's gradients into the full-length outputs; return dL/dH.

        gy: `[b, l, d]` gradient of y; g_end: `[b, n, d]` gradient of the segment's last state.
        The adjoint of h is g_t = C_t gy_t + exp(delta_{t+1} A) g_{t+1}; in log space it is
        again one triangular matmul, here M2 applied to W = gy * E.
        """
        b, n, length, d = self.batch, self.n_state, self.length, self.channels
        work, t0, t1 = self.work, self.t0, self.t1
        h = self.states(H)
        E, Y, M = self.E, self.Y, self.M
        C_t = self.C.transpose(1, 2)  # [b, n, l]

        # P = gy * h gives dL/dC, and (times C) the h-term of the log-decay gradient
        P = work.view("P", b, n, length, d)
        torch.mul(h, gy[:, None], out=P)
        g_C[:, t0:t1] = P.sum(-1).transpose(1, 2)

        # dL/dG = (C gy + [t = l-1] g_end) * E, written as W = gy * E plus row l = g_end * E_{l-1}
        W = work.view("W", b, n, length + 1, d)
        torch.mul(E[:, :, :length], gy[:, None], out=W[:, :, :length])
        torch.mul(E[:, :, length - 1], g_end, out=W[:, :, length])
        # dL/dY = M^T dL/dG = M2 W with M2[s, t] = M[t, s] C_t (t < l), M2[s, l] = M[l-1, s]
        M2 = work.view("M2", b, n, length + 1, length + 1)
        torch.mul(M, C_t[..., None], out=M2[..., :length].transpose(-1, -2))
        M2[..., length] = M[:, :, length - 1]
        gY = work.view("gY", b, n, length + 1, d)
        torch.bmm(M2.view(b * n, length + 1, length + 1), W.view(b * n, length + 1, d), out=gY.view(b * n, length + 1, d))

        # dL/dB_s = sum_{t >= s} dL/dM[t, s], with dL/dM = dL/dG Y^T = diag(C, 1) (W Y^T)
        K = work.view("K", b, n, length + 1, length + 1)
        torch.bmm(W.view(b * n, length + 1, d), Y.view(b * n, length + 1, d).transpose(1, 2), out=K.view(b * n, length + 1, length + 1))
        tril = work.tril[:length, :length]
        g_M = K[:, :, :length, :length] * C_t[..., None] * tril
        g_B[:, t0:t1] = (g_M.sum(2) + K[:, :, length, :length]).transpose(1, 2)

        # Y[t] = du_t / E[t]  ->  dL/ddu_t = sum_n gY[t] / E[t]
        g_du[:, t0:t1] = (gY[:, :, :length] / E[:, :, :length]).sum(1)
        # Y[l] = E[l] H  ->  dL/dH = gY[l] E[l]
        g_start = gY[:, :, length] * E[:, :, length]

        # Gradient w.r.t. the exponents A * cmh (dL/dE * E): h-term minus Y-term
        P.mul_(C_t[..., None])
        P[:, :, length - 1].addcmul_(g_end, h[:, :, length - 1])
        P.addcmul_(gY[:, :, :length], Y[:, :, :length], value=-1.0)
        g_exp_last = gY[:, :, length] * Y[:, :, length]  # row l: Y[l] = E[l] H
        g_A.add_((P * self.cmh[:, None, :length]).sum((0, 2)))
        g_A.add_((g_exp_last * self.cmh[:, None, length]).sum(0))
        P.mul_(self.A_t[:, None, :])
        g_cmh = torch.cat([P.sum(1), (g_exp_last * self.A_t).sum(1, keepdim=True)], dim=1)  # [b, l + 1, d]
        g_delta[:, t0:t1] = torch.matmul(self.centring.t(), g_cmh)
        return g_start
