"""Fast CPU selective scan: the recurrence stepped chunk by chunk, many chunks side by side.

The Mamba-1 scan, per batch row, channel d and state n, is a linear recurrence

    h_t = a_t h_{t-1} + x_t,    a_t = exp(delta_t A),  x_t = delta_t u_t B_t,    y_t = C_t . h_t.

The naive loop spends several small ops on every time step. Here time is cut into chunks
of l steps, and P consecutive chunks form a block. Per block:

1. a and x for all P l steps at once (broadcast products, one exp);
2. each chunk's end state from a zero start, stepping the P chunks side by side
   (l - 1 ops on [B, P, N, D] slices);
3. each chunk's true start state, H_{c+1} = end_c + decay_c H_c, with decay_c the product
   of the chunk's a: one small op per chunk, the only part sequential in c;
4. the states, stepping the P chunks again, now from their true starts and in place
   (l ops), then y = C . h as one batched matmul.

A scan of T steps thus costs about 2 T / P + T / l ops plus six passes over the
[B, T, N, D] values, instead of about 8 T tiny ops. When one step is already a large op
(B N D >= 16K values, e.g. a batch of 8), blocks hold a single chunk that is stepped
directly from its known start: T ops, without the end-state sweep (`_layout`).

Every factor is a decay in (0, 1]; the only exponent is delta * A <= 0: the arithmetic
is the naive loop's and cannot overflow, however large delta * |A| is. Decays below
e^-40 (4e-18) are floored at e^-40 so that no product becomes denormal (denormal
arithmetic is ~100x slower on x86, and we set no global flush-to-zero flag); this
changes a state by less than 4e-18 of its magnitude.

The backward pass is written by hand: the adjoint g_t = C_t gy_t + a_{t+1} g_{t+1} is the
same kind of recurrence run in reverse, stepped the same way. Each block's states are
recomputed from the saved chunk start states, so nothing of size [B, T, N, D] is kept
between the forward and the backward pass.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

# Exponent floor: decays exp(delta A) and whole-chunk decays are at least e^-40.
_EXP_FLOOR = -40.0
# Steps per chunk when many chunks are stepped side by side.
_DEFAULT_CHUNK = 16
# Values in one [B, P, l, N, D] block buffer. Larger blocks mean fewer ops (each costs
# ~10 us on top of its work), smaller ones faster passes; 2M was best on 2 cores.
_BLOCK_ELEMENTS = 1 << 21
# From this many values per step (B N D) on, a step is a large enough op to be run on
# its own: one chunk per block, stepped directly, without the end-state sweep; such
# blocks were best at about 4M values.
_SEQUENTIAL_STEP = 1 << 14
_SEQUENTIAL_BLOCK_ELEMENTS = 1 << 22


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
    """Selective scan in chunks; same signature and results as `selective_scan_naive`.

    Args:
        u: inputs `[B, T, D]`.
        delta: positive step sizes `[B, T, D]` (softplus already applied).
        A: negative state decay rates `[D, N]`.
        B, C: input and output projections `[B, T, N]`.
        D: skip weight `[D]`.
        z: gate `[B, T, D]`; the output is multiplied by `silu(z)`.
        initial_state: state before the first step `[B, D, N]` (zeros if None).
        return_final_state: also return the state after the last step.
        chunk_size: steps per chunk (default: 16, or more when batch * N * D is large).

    Returns:
        y `[B, T, D]` in the dtype of `u`, and the final state `[B, D, N]` (fp32) if asked.
        Computed in fp32; differentiable w.r.t. every tensor argument.
    """
    dtype = u.dtype
    u, delta, A, B, C = (t.float() for t in (u, delta, A, B, C))
    batch, _, channels = u.shape
    n_state = A.shape[1]
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    chunk, per_block = _layout(batch * n_state * channels, chunk_size)
    if initial_state is None:
        h0 = u.new_zeros(batch, n_state, channels)
    else:
        h0 = initial_state.float().transpose(1, 2)  # [B, N, D]: channels innermost, like u
    y, h_last = _ChunkedScan.apply(delta * u, delta, A.t(), B, C, h0, chunk, per_block)
    if D is not None:
        y = y + u * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(dtype)
    return (y, h_last.transpose(1, 2)) if return_final_state else y


def _layout(step: int, chunk_size: int | None) -> tuple[int, int]:
    """Steps per chunk and chunks per block, for `step` = B N D values per time step.

    Small steps: many chunks side by side (two sweeps and a carry per chunk, about
    2 T / P + T / l ops). Large steps: one chunk per block, stepped directly from its
    known start (T ops, one pass fewer). Measured on 2 cores at T = 1024-4096: the first
    is ~1.2x faster at B N D = 12K, the second ~1.2-1.4x faster from 24K on.
    """
    if step >= _SEQUENTIAL_STEP:
        return chunk_size or max(_DEFAULT_CHUNK, _SEQUENTIAL_BLOCK_ELEMENTS // step), 1
    chunk = chunk_size or _DEFAULT_CHUNK
    return chunk, max(1, _BLOCK_ELEMENTS // (step * chunk))


class _ChunkedScan(torch.autograd.Function):
    """h_t = exp(delta_t A) h_{t-1} + du_t B_t, y_t = C_t . h_t, block by block.

    Inputs: du, delta `[B, T, D]` (du = delta * u), A_t `[N, D]`, B, C `[B, T, N]`,
    h0 `[B, N, D]`. Outputs: y `[B, T, D]`, final state `[B, N, D]`.
    """

    @staticmethod
    def forward(ctx, du, delta, A_t, B, C, h0, chunk, per_block):
        scan = _Scan(du, delta, A_t, B, C, chunk, per_block)
        # starts[:, c]: the state before chunk c (the last entry: the final state)
        starts = h0.new_empty(h0.shape[0], scan.n_chunks + 1, *h0.shape[1:])
        starts[:, 0] = h0
        y = torch.empty_like(scan.du)
        for block in scan.blocks():
            block.forward(starts[:, block.c0 : block.c1 + 1], y)
        ctx.chunk, ctx.per_block = chunk, per_block
        ctx.save_for_backward(scan.du, scan.delta, A_t, scan.B, scan.C, starts)
        return y, starts[:, -1].clone()

    @staticmethod
    def backward(ctx, gy, g_last):
        du, delta, A_t, B, C, starts = ctx.saved_tensors
        scan = _Scan(du, delta, A_t, B, C, ctx.chunk, ctx.per_block, backward=True)
        gy = torch.zeros_like(du) if gy is None else gy.float().contiguous()
        g_state = torch.zeros_like(starts[:, 0]) if g_last is None else g_last.float().contiguous()
        grads = SimpleNamespace(
            du=torch.empty_like(du), delta=torch.empty_like(delta), A_t=torch.zeros_like(A_t),
            B=torch.empty_like(B), C=torch.empty_like(C),
        )
        for block in reversed(list(scan.blocks())):
            g_state = block.backward(starts[:, block.c0 : block.c1], g_state, gy, grads)
        return grads.du, grads.delta, grads.A_t, grads.B, grads.C, g_state, None, None


class _Scan:
    """The inputs of one scan, its blocks, and the buffers that every block reuses."""

    def __init__(self, du, delta, A_t, B, C, chunk, per_block, backward=False):
        self.du, self.delta, self.B, self.C = (t.contiguous() for t in (du, delta, B, C))
        self.A_t = A_t.contiguous()
        self.chunk, self.per_block = chunk, per_block
        batch, length, channels = du.shape
        n_state = A_t.shape[0]
        self.n_chunks = -(-length // chunk)
        # delta * A <= 0 is floored at -40 only when some value could be below it
        self.floor = length > 0 and float(self.delta.max()) * float(self.A_t.abs().max()) > -_EXP_FLOOR
        chunks = min(per_block, self.n_chunks)
        shape = (batch, chunks, chunk, n_state, channels)
        names = ("a", "h") + (("g",) if backward else ())
        self.buffers = {name: du.new_empty(shape) for name in names}
        self.scratch = du.new_empty(batch, chunks, n_state, channels)

    def blocks(self):
        for c0 in range(0, self.n_chunks, self.per_block):
            yield _Block(self, c0, min(c0 + self.per_block, self.n_chunks))


class _Block:
    """Chunks [c0, c1) of a scan: P chunks of l steps. Past the end of the sequence the
    inputs are zero-padded (delta = 0 and du = 0: decay 1, no input, state unchanged).

    Shapes: b batch, p chunk, j step in a chunk, n state, d channel.
    """

    def __init__(self, scan: _Scan, c0: int, c1: int):
        self.scan, self.c0, self.c1 = scan, c0, c1
        length = scan.du.shape[1]
        self.t0, self.t1 = c0 * scan.chunk, min(c1 * scan.chunk, length)
        self.P = c1 - c0
        self.delta = self._chunks(scan.delta)  # [b, p, j, d]
        self.du = self._chunks(scan.du)
        self.B, self.C = self._chunks(scan.B), self._chunks(scan.C)  # [b, p, j, n]

    def _chunks(self, t: Tensor) -> Tensor:
        """[b, T, k] -> [b, p, j, k] for this block's steps, zero-padded past the end."""
        part = t[:, self.t0 : self.t1]
        missing = self.P * self.scan.chunk - part.shape[1]
        if missing:
            part = F.pad(part, (0, 0, 0, missing))
        return part.view(t.shape[0], self.P, self.scan.chunk, t.shape[2])

    def _buffer(self, name: str) -> Tensor:
        return self.scan.buffers[name][:, : self.P]

    def _write(self, out: Tensor, value: Tensor) -> None:
        """out[:, t0:t1] = value `[b, p, j, k]`, dropping the padded steps."""
        out[:, self.t0 : self.t1] = value.reshape(value.shape[0], -1, value.shape[-1])[:, : self.t1 - self.t0]

    def _decays(self) -> tuple[Tensor, Tensor]:
        """a = exp(delta A) `[b, p, j, n, d]`."""
        a = torch.mul(self.delta.unsqueeze(3), self.scan.A_t, out=self._buffer("a"))
        if self.scan.floor:
            a.clamp_(min=_EXP_FLOOR)
        return a.exp_()

    def _chunk_decays(self) -> Tensor:
        """Each chunk's total decay exp(A sum(delta)) `[b, p, n, d]`."""
        return (self.delta.sum(2).unsqueeze(2) * self.scan.A_t).clamp_(min=_EXP_FLOOR).exp_()

    def _inputs(self) -> Tensor:
        """x = B du `[b, p, j, n, d]`, in the buffer that then holds the states."""
        return torch.mul(self.B.unsqueeze(4), self.du.unsqueeze(3), out=self._buffer("h"))

    def _states(self, a: Tensor, starts: Tensor, x: Tensor) -> Tensor:
        """The states h `[b, p, j, n, d]`, computed in place of x, from each chunk's start
        state `[b, p, n, d]`."""
        a_steps, h_steps = a.unbind(2), x.unbind(2)
        h_steps[0].addcmul_(a_steps[0], starts)
        for j in range(1, len(h_steps)):
            h_steps[j].addcmul_(a_steps[j], h_steps[j - 1])
        return x

    def forward(self, starts: Tensor, y: Tensor) -> None:
        """Fill starts[:, 1:] from starts[:, 0] (`[b, p + 1, n, d]`) and this block's y."""
        a, x = self._decays(), self._inputs()
        if self.P > 1:
            # each chunk's end state from a zero start, all chunks side by side ...
            end = self.scan.scratch[:, : self.P]
            end.copy_(x[:, :, 0])
            for a_j, x_j in zip(a.unbind(2)[1:], x.unbind(2)[1:]):
                torch.addcmul(x_j, a_j, end, out=end)
            # ... then the true start states: the only loop over chunks
            chunk_decay = self._chunk_decays()
            for c in range(self.P):
                torch.addcmul(end[:, c], chunk_decay[:, c], starts[:, c], out=starts[:, c + 1])
        h = self._states(a, starts[:, :-1], x)
        if self.P == 1:  # a single chunk starts from a known state: step it directly
            starts[:, 1] = h[:, 0, -1]
        self._write(y, torch.matmul(self.C.unsqueeze(3), h).squeeze(3))

    def backward(self, starts: Tensor, g_end: Tensor, gy: Tensor, grads: SimpleNamespace) -> Tensor:
        """Write this block's gradients into `grads`; return dL/d(state before the block).

        starts: `[b, p, n, d]` saved start states of the chunks; g_end: `[b, n, d]`
        gradient of the state after the block; gy: `[B, T, D]` gradient of y.
        """
        a = self._decays()
        h = self._states(a, starts, self._inputs())
        gy = self._chunks(gy)  # [b, p, j, d]
        self._write(grads.C, torch.matmul(h, gy.unsqueeze(4)).squeeze(4))

        # the adjoint of h, g_t = C_t gy_t + a_{t+1} g_{t+1}, stepped like the states
        g = torch.mul(self.C.unsqueeze(4), gy.unsqueeze(3), out=self._buffer("g"))
        a_steps, g_steps = a.unbind(2), g.unbind(2)
        if self.P > 1:
            # each chunk's adjoint at its first step, from a zero gradient after it ...
            first = self.scan.scratch[:, : self.P]
            first.copy_(g_steps[-1])
            for a_next, g_j in zip(a_steps[:0:-1], g_steps[-2::-1]):
                torch.addcmul(g_j, a_next, first, out=first)
            # ... then the gradient flowing into each chunk's last state from later chunks
            first.mul_(a_steps[0])
            chunk_decay = self._chunk_decays()
            into_end = torch.empty_like(first)
            for c in reversed(range(self.P)):
                into_end[:, c] = g_end
                g_end = torch.addcmul(first[:, c], chunk_decay[:, c], g_end)
            g_steps[-1].add_(into_end)
        else:  # a single chunk: the gradient after it is known
            g_steps[-1].add_(g_end.unsqueeze(1))
        for a_next, g_j, g_after in zip(a_steps[:0:-1], g_steps[-2::-1], g_steps[:0:-1]):
            g_j.addcmul_(a_next, g_after)
        if self.P == 1:
            g_end = a_steps[0][:, 0] * g_steps[0][:, 0]
        return self._gradients(a, h, g, starts, g_end, grads)

    def _gradients(self, a, h, g, starts, g_start, grads) -> Tensor:
        """Gradients of the inputs from the adjoint g and the states h; returns g_start."""
        # x_t = B_t du_t
        self._write(grads.B, torch.matmul(g, self.du.unsqueeze(4)).squeeze(4))
        self._write(grads.du, torch.matmul(self.B.unsqueeze(3), g).squeeze(3))
        # dL/d(delta_t A) = g_t a_t h_{t-1}, then its two contractions (h is free after)
        q = g.mul_(a)
        q[:, :, 1:].mul_(h[:, :, :-1])
        q[:, :, 0].mul_(starts)
        grads.A_t.add_(torch.mul(q, self.delta.unsqueeze(3), out=h).sum((0, 1, 2)))
        self._write(grads.delta, q.mul_(self.scan.A_t).sum(3))
        return g_start
