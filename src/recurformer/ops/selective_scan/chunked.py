"""Fast CPU selective scan: the recurrence solved a segment of steps at a time, in log space.

Within a segment of l steps that starts from state H, with cum_t = delta_1 + ... + delta_t
(per channel) and S_t = A * cum_t (per channel and state), the recurrence

    h_t = exp(delta_t * A) * h_{t-1} + delta_t * u_t * B_t,        y_t = C_t . h_t

has the closed form

    h_t = exp(S_t) * H + sum_{s <= t} exp(S_t - S_s) * delta_s * u_s * B_s.

Writing exp(S_t - S_s) = E_t / E_s with E_t = exp(S_t - m), the sum is one small batched
matmul (a lower-triangular matrix that also carries B and C) applied to delta * u / E,
followed by a product with E and a sum over the state axis. Segments are processed K at
a time ("groups", sized to stay in cache) with dense eager ops; only the hand-over of the
state from one segment to the next is sequential: one small op per segment. So a scan
costs a few passes over [B, T, N, D] values plus T / l tiny ops, instead of T steps.

Stability. m is the midpoint of the segment's log decay (S_l / 2), so every exponent lies
in [-R/2, R/2], where R = max |A| * sum(delta) over the segment. Segments are cut so that
R <= 80: exp then never overflows and never produces denormals (which are ~100x slower
on x86). A step that on its own decays by more than e^-80 becomes a one-step segment
whose exponents are clamped at -40, and whole-segment decay factors are floored at e^-40:
a decay below e^-40 (4e-18) is kept as e^-40, which changes the state by less than 4e-18
of its magnitude. No global floating-point setting is touched.

The backward pass is written out by hand (`_Group.backward`): it recomputes each group
from the saved start states of its segments, so memory stays O(B T D + B T N D / l)
instead of storing [B, T, N, D] intermediates.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

# Largest log-decay range max|A| * sum(delta) allowed inside one segment: exponents are
# then within [-40, 40], far from exp's overflow (88) and from the denormal range (-87).
_MAX_RANGE = 80.0
# Exponent floor for single steps that decay by more than e^-_MAX_RANGE on their own,
# and for the decay over a whole segment (which multiplies a state, and must not
# make it denormal).
_EXP_FLOOR = -40.0
# Elements of one [B, K, N, l+1, D] group buffer: the K segments processed together
# should keep their few buffers in cache (L2), yet amortise per-op overhead.
_GROUP_ELEMENTS = 1 << 19
# Steps per segment: the triangular matmul costs 2 (l + 1) flops per element of the state.
_DEFAULT_CHUNK = 16


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
        chunk_size: steps per segment (default 16). Segments are cut shorter where the
            state decays too fast for one log-space block (see the module docstring).

    Returns:
        y `[B, T, D]` in the dtype of `u`, and the final state `[B, D, N]` (fp32) if asked.
        Computed in fp32; differentiable w.r.t. every tensor argument.
    """
    dtype = u.dtype
    u, delta, A, B, C = (t.float() for t in (u, delta, A, B, C))
    batch, _, channels = u.shape
    n_state = A.shape[1]
    if chunk_size is None:
        chunk_size = _DEFAULT_CHUNK
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    group = max(1, _GROUP_ELEMENTS // (batch * n_state * channels * chunk_size))
    if initial_state is None:
        h0 = u.new_zeros(batch, n_state, channels)
    else:
        h0 = initial_state.float().transpose(1, 2)  # [B, N, D]: channels innermost, like u
    y, h_last = _ChunkedScan.apply(delta * u, delta, A.t(), B, C, h0, chunk_size, group)
    if D is not None:
        y = y + u * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(dtype)
    return (y, h_last.transpose(1, 2)) if return_final_state else y


class _ChunkedScan(torch.autograd.Function):
    """h_t = exp(delta_t A) h_{t-1} + du_t B_t, y_t = C_t . h_t, over groups of segments.

    Inputs: du, delta `[B, T, D]` (du = delta * u), A_t `[N, D]`, B, C `[B, T, N]`,
    h0 `[B, N, D]`. Outputs: y `[B, T, D]`, final state `[B, N, D]`.
    """

    @staticmethod
    def forward(ctx, du, delta, A_t, B, C, h0, chunk, group):
        du, delta, A_t, B, C = (t.contiguous() for t in (du, delta, A_t, B, C))
        groups = _plan(delta, A_t, chunk, group)
        n_segments = sum(count for _, count, _ in groups)
        # states[:, k] is the state before segment k; the backward recomputes from them
        states = h0.new_empty(h0.shape[0], n_segments + 1, *h0.shape[1:])
        states[:, 0] = h0
        y = torch.empty_like(du)
        inputs = _Inputs(du, delta, A_t, B, C, chunk)
        work = _Workspace(du, A_t.shape[0], groups)
        k = 0
        for t0, count, length in groups:
            part = _Group(work, inputs, t0, count, length)
            part.forward(states[:, k : k + count + 1], y[:, t0 : part.t1].view(y.shape[0], count, length, -1))
            k += count
        ctx.groups, ctx.chunk = groups, chunk
        ctx.save_for_backward(du, delta, A_t, B, C, states)
        return y, states[:, -1].clone()

    @staticmethod
    def backward(ctx, gy, g_last):
        du, delta, A_t, B, C, states = ctx.saved_tensors
        gy = torch.zeros_like(du) if gy is None else gy.float().contiguous()
        g_state = torch.zeros_like(states[:, 0]) if g_last is None else g_last.float().contiguous()
        inputs = _Inputs(du, delta, A_t, B, C, ctx.chunk, gy)
        work = _Workspace(du, A_t.shape[0], ctx.groups, backward=True)
        grads = _Grads(du, delta, A_t, B, C)
        k = states.shape[1] - 1
        for t0, count, length in reversed(ctx.groups):
            part = _Group(work, inputs, t0, count, length)
            g_state = part.backward(states[:, k - count : k], g_state, grads)
            k -= count
        return grads.du, grads.delta, grads.A_t, grads.B, grads.C, g_state, None, None


def _plan(delta: Tensor, A_t: Tensor, chunk: int, group: int) -> list[tuple[int, int, int]]:
    """Cut [0, T) into groups `(t0, count, length)` of `count` consecutive segments of `length` steps.

    A segment's log-decay range is max over (batch, channel) of max_n |A| * sum(delta):
    the largest |S| from its start to its end (delta >= 0). Full chunks are checked with
    one reduction; chunks over the limit, and a ragged tail, are cut greedily into
    shorter pieces that fit. Runs of equal-length segments then form groups of at most
    `group * chunk` steps.
    """
    batch, length, channels = delta.shape
    a_max = A_t.abs().amax(0)  # [D]
    n_full = length // chunk
    sums = delta[:, : n_full * chunk].reshape(batch, n_full, chunk, channels).sum(2)
    fits = ((sums * a_max).amax(dim=(0, 2)) <= _MAX_RANGE).tolist()
    segments: list[tuple[int, int]] = []
    for c, ok in enumerate(fits):
        segments.extend([(c * chunk, chunk)] if ok else _split_stiff(delta, a_max, c * chunk, (c + 1) * chunk))
    segments.extend(_split_stiff(delta, a_max, n_full * chunk, length))
    groups: list[tuple[int, int, int]] = []
    for t0, steps in segments:
        if groups and groups[-1][2] == steps and (groups[-1][1] + 1) * steps <= group * chunk:
            groups[-1] = (groups[-1][0], groups[-1][1] + 1, steps)
        else:
            groups.append((t0, 1, steps))
    return groups


def _split_stiff(delta: Tensor, a_max: Tensor, t0: int, t1: int) -> list[tuple[int, int]]:
    """Greedy cut of [t0, t1) into `(start, length)` pieces: each the longest prefix that fits."""
    prefix = F.pad(delta[:, t0:t1].double().cumsum(1), (0, 0, 1, 0))  # [B, l + 1, D]
    pieces, s, length = [], 0, t1 - t0
    while s < length:
        ranges = ((prefix[:, s + 1 :] - prefix[:, s : s + 1]) * a_max).amax(dim=(0, 2))
        k = max(1, int((ranges <= _MAX_RANGE).sum()))  # ranges grow with k: count = last fit
        pieces.append((t0 + s, k))
        s += k
    return pieces


class _Grads:
    """Full-length gradient tensors that each group writes its slice of."""

    def __init__(self, du, delta, A_t, B, C):
        self.du, self.delta, self.B, self.C = (torch.empty_like(t) for t in (du, delta, B, C))
        self.A_t = torch.zeros_like(A_t)


class _Inputs:
    """Per-segment matrices and padded inputs, built in bulk for all full chunks at once.

    For K segments of l steps (batch b, state n, channels d), `group` returns views of
    (M and M2 only for the backward, MC only for the forward):
        cmh `[b, K, 1, l+1, d]`: rows t < l hold cum_t - cum_l / 2, row l holds cum_l / 2;
        du, gy `[b, K, 1, l+1, d]`: zero-padded to l + 1 rows;
        M `[b, K, n, l+1, l+1]`: M[t, s] = [s <= t] B_s and M[t, l] = 1 for t < l; row l is 0;
        M_end `[b, K, n, 1, l+1]`: row l-1 of M, [B_0 .. B_{l-1}, 1];
        decay `[b, K, n, d]`: exp(A cum_l), the decay over each whole segment (floored);
        MC: M with row t scaled by C_t; C `[b, K, n, l+1]` zero-padded;
        M2 `[b, K, n, l+1, l+1]`: the adjoint matrix, (MC)^T with column l = M[l-1].
    Ragged or stiff segments are built the same way when asked for.
    """

    def __init__(self, du, delta, A_t, B, C, chunk, gy=None):
        self.raw = (du, delta, B, C, gy)
        self.A = A_t.unsqueeze(1)  # [n, 1, d]: broadcasts against [b, K, 1, l+1, d]
        self.chunk = chunk
        self.matrices: dict[int, tuple[Tensor, Tensor]] = {}
        n_full = du.shape[1] // chunk
        self.full = self._build(0, n_full, chunk) if n_full else None

    def tril_centring(self, length: int) -> tuple[Tensor, Tensor]:
        """Lower-triangular ones `[l, l]` and the centring matrix `[l + 1, l]`."""
        if length not in self.matrices:
            tril = torch.ones(length, length, dtype=self.A.dtype, device=self.A.device).tril_()
            centring = torch.cat([tril - 0.5, tril.new_full((1, length), 0.5)])
            self.matrices[length] = (tril, centring)
        return self.matrices[length]

    def _build(self, t0: int, count: int, length: int) -> dict[str, Tensor]:
        def segments(t: Tensor) -> Tensor:  # [b, T, *] -> [b, K, l, *]
            return t[:, t0 : t0 + count * length].view(t.shape[0], count, length, -1)

        def padded(t: Tensor) -> Tensor:  # [b, T, d] -> [b, K, 1, l+1, d]
            return F.pad(segments(t), (0, 0, 0, 1)).unsqueeze(2)

        du, delta, B, C, gy = self.raw
        tril, centring = self.tril_centring(length)
        B, C = segments(B).transpose(2, 3), segments(C).transpose(2, 3)  # [b, K, n, l]
        cmh = torch.matmul(centring, segments(delta)).unsqueeze(2)  # [b, K, 1, l+1, d]
        parts = {
            "cmh": cmh,
            "du": padded(du),
            "M_end": F.pad(B, (0, 1), value=1.0).unsqueeze(-2),  # [B_0 .. B_{l-1}, 1]
            # decay over a whole segment, exp(A cum_l), floored so that decay * state is
            # never denormal (a change below e^-40 of the state)
            "decay": torch.exp((cmh[..., length, :] * (2 * self.A.squeeze(1))).clamp_(min=_EXP_FLOOR)),
        }

        def matrix(rows: Tensor) -> Tensor:  # M with row t scaled by rows[..., t]
            M = du.new_zeros(*B.shape[:3], length + 1, length + 1)
            torch.mul(tril * B.unsqueeze(-2), rows.unsqueeze(-1), out=M[..., :length, :length])
            M[..., :length, length] = rows
            return M

        if gy is None:
            parts["MC"] = matrix(C)
        else:
            parts["M"] = matrix(torch.ones_like(C))
            M2 = matrix(C).transpose(-1, -2).contiguous()
            M2[..., length] = parts["M_end"].squeeze(-2)
            parts.update(M2=M2, C=F.pad(C, (0, 1)), gy=padded(gy))
        return parts

    def group(self, t0: int, count: int, length: int) -> dict[str, Tensor]:
        if length == self.chunk and self.full is not None:
            first = t0 // length
            return {name: t[:, first : first + count] for name, t in self.full.items()}
        return self._build(t0, count, length)


class _Workspace:
    """Flat buffers reused by every group; `views` cuts them to one group shape (cached)."""

    def __init__(self, like: Tensor, n_state: int, groups, backward: bool = False):
        batch, _, channels = like.shape
        size = batch * n_state * max((count * (length + 1) * channels for _, count, length in groups), default=0)
        names = ("E", "Y", "G") + (("P", "W", "gY") if backward else ())
        self.flat = {name: like.new_empty(size) for name in names}
        self.cache: dict[tuple[int, ...], SimpleNamespace] = {}

    def views(self, shape: tuple[int, ...]) -> SimpleNamespace:
        """Views `[b, k, n, l+1, d]` of each buffer, plus the rows and 3-d shapes the ops use."""
        if shape not in self.cache:
            b, k, n, length, d = shape
            v = SimpleNamespace()
            for name, flat in self.flat.items():
                full = flat[: b * k * n * (length + 1) * d].view(b, k, n, length + 1, d)
                setattr(v, name, full)
                setattr(v, name + "_mat", full.view(-1, length + 1, d))  # for bmm
            v.E_end, v.E_half, v.Y_carry = v.E[..., length - 1, :], v.E[..., length, :], v.Y[..., length, :]
            v.G_rows = v.G[..., :length, :]
            self.cache[shape] = v
        return self.cache[shape]


class _Group:
    """Steps [t0, t0 + K l) of the scan as K segments of l steps: forward, and hand-written adjoint.

    Shapes: b batch, k segment, n state, t/s step in a segment, d channel. Every block has
    l + 1 rows, so the large elementwise ops run on contiguous memory: row l of E holds
    exp(m), row l of Y the carried state exp(m) H, which enters every h_t with weight 1.
    """

    def __init__(self, work: _Workspace, inputs: _Inputs, t0: int, count: int, length: int):
        self.A = inputs.A
        self.t0, self.t1 = t0, t0 + count * length
        self.tril, self.centring = inputs.tril_centring(length)
        self.parts = inputs.group(t0, count, length)
        batch, _, channels = inputs.raw[0].shape
        self.shape = (batch, count, inputs.A.shape[0], length, channels)
        self.v = work.views(self.shape)

    def _local(self) -> None:
        """E and Y (with Y[l] = 0): the parts that do not depend on the start states."""
        v, length = self.v, self.shape[3]
        # E[t] = exp(A (cum_t - cum_l / 2)) for t < l; E[l] = exp(A cum_l / 2) = exp(m)
        torch.mul(self.parts["cmh"], self.A, out=v.E)
        if length == 1:  # the only segments allowed to exceed the range: see module docstring
            v.E.clamp_(min=_EXP_FLOOR)
        v.E.exp_()
        torch.div(self.parts["du"], v.E, out=v.Y)

    def _states(self, H: Tensor, M: Tensor) -> Tensor:
        """(M Y) * E with Y[l] = E[l] H: the states h `[b, k, n, l+1, d]` (row l zero) for M = M,
        or the states times C_t for M = MC. H: start states `[b, k, n, d]`."""
        v, length = self.v, self.shape[3]
        torch.mul(v.E_half, H, out=v.Y_carry)
        torch.bmm(M.reshape(-1, length + 1, length + 1), v.Y_mat, out=v.G_mat)
        return v.G.mul_(v.E)

    def forward(self, states: Tensor, y: Tensor) -> None:
        """Fill states[:, 1:] from states[:, 0] (`[b, k + 1, n, d]`) and y `[b, k, l, d]`."""
        v = self.v
        self._local()
        # end state of each segment from a zero start: E[l-1] (row l-1 of M Y, while Y[l] = 0)
        local_end = torch.matmul(self.parts["M_end"], v.Y).squeeze(-2).mul_(v.E_end)
        # the only sequential part: one small op per segment
        for local, decay, start, end in zip(local_end.unbind(1), self.parts["decay"].unbind(1), states.unbind(1), states[:, 1:].unbind(1)):
            torch.addcmul(local, decay, start, out=end)
        # with M's rows scaled by C_t, y_t = sum_n C_t h_t is a plain sum over n; contracting
        # h with C instead would need h copied to [.., t, n, d]
        self._states(states[:, :-1], self.parts["MC"])
        torch.sum(v.G_rows, 2, out=y)

    def backward(self, starts: Tensor, g_end: Tensor, grads: _Grads) -> Tensor:
        """Write this group's gradients into `grads`; return dL/d(state before the group).

        starts: `[b, k, n, d]` saved start states; g_end: `[b, n, d]` gradient of the state
        after the group. The adjoint of h, g_t = C_t gy_t + exp(delta_{t+1} A) g_{t+1}, is
        again one triangular matmul in log space (M2) and a one-op-per-segment recurrence.
        """
        b, k, n, length, d = self.shape
        v, t0, t1, parts = self.v, self.t0, self.t1, self.parts
        self._local()
        E, Y, P, W, gY = v.E, v.Y, v.P, v.W, v.gY
        h = self._states(starts, parts["M"])
        gy, C = parts["gy"], parts["C"]  # [b, k, 1, l+1, d], [b, k, n, l+1]

        # P = gy h gives dL/dC, and (times C) the h-term of the exponent gradient
        torch.mul(h, gy, out=P)
        grads.C[:, t0:t1] = P[..., :length, :].sum(-1).transpose(2, 3).reshape(b, -1, n)

        # dL/dG = (C_t gy_t + [t = l-1] g_end_k) E_t, kept as W = gy E plus row l = g_end_k E[l-1]
        torch.mul(E, gy, out=W)
        # g_end_k, the gradient of the state after segment k, by a reverse recurrence:
        # g_start_k = E[l] sum_t C_t W_t + decay_k g_end_k
        g_from_y = torch.matmul(C.unsqueeze(-2), W).squeeze(-2).mul_(v.E_half)
        g_ends = torch.empty_like(starts)
        for from_y, decay, out in zip(g_from_y.unbind(1)[::-1], self.parts["decay"].unbind(1)[::-1], g_ends.unbind(1)[::-1]):
            out.copy_(g_end)
            g_end = torch.addcmul(from_y, decay, g_end)
        torch.mul(v.E_end, g_ends, out=W[..., length, :])
        torch.bmm(parts["M2"].reshape(-1, length + 1, length + 1), v.W_mat, out=v.gY_mat)

        # dL/dB_s = sum_{t >= s} dL/dM[t, s], where dL/dM = dL/dG Y^T = diag(C, 1) W Y^T
        WY = torch.matmul(W, Y.transpose(-1, -2))  # [b, k, n, l+1, l+1]
        g_B = (WY[..., :length, :length] * C[..., :length, None] * self.tril).sum(-2) + WY[..., length, :length]
        grads.B[:, t0:t1] = g_B.transpose(2, 3).reshape(b, -1, n)

        # Y[t] = du_t / E[t]  ->  dL/ddu_t = sum_n gY[t] / E[t]   (W is free again)
        grads.du[:, t0:t1] = torch.div(gY, E, out=W)[..., :length, :].sum(2).reshape(b, -1, d)

        # Gradient w.r.t. the exponents A * cmh (dL/dE * E): the h-term minus the Y-term,
        # except row l, where only Y[l] = E[l] H depends on E[l]
        P.mul_(C.unsqueeze(-1))
        P[..., length - 1, :].addcmul_(g_ends, h[..., length - 1, :])
        P.addcmul_(gY, Y, value=-1.0)
        P[..., length, :].neg_()
        grads.A_t.add_(torch.mul(P, parts["cmh"], out=W).sum((0, 1, 3)))
        g_cmh = P.mul_(self.A).sum(2)  # [b, k, l+1, d]
        grads.delta[:, t0:t1] = torch.matmul(self.centring.t(), g_cmh).reshape(b, -1, d)
        return g_end
