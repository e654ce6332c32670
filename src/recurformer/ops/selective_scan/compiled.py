"""Compiled CPU selective scan (`ops/csrc/selective_scan.cpp`) behind the oracle's signature.

One fused loop over time per batch row and 16 channels, state in registers, vectorized
over channels, parallel over (batch, channel block); D and the gate are applied in the
same loop. The backward pass is written by hand: the forward pass saves the state every
`chunk_size` steps (`[B, T / chunk_size, D, N]`, nothing of size `[B, T, D, N]`), and
the backward pass recomputes each chunk's states from it and runs the adjoint
recurrence in reverse. fp32 or bf16 inputs, fp32 arithmetic. See docs/scan.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import kernels

_OP = "selective_scan"
# Steps between saved states: the backward pass keeps one chunk's states and decays
# (2 x chunk x N x 16 floats per thread: 64 KB at N = 16; 32 was best of 8-64 here).
_DEFAULT_CHUNK = 32


def selective_scan_compiled(
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
    chunk_size: int = _DEFAULT_CHUNK,
) -> Tensor | tuple[Tensor, Tensor]:
    """Selective scan with the compiled kernel; same signature and results as `selective_scan_naive`.

    Args:
        u, delta `[B, T, D]`, A `[D, N]`, B, C `[B, T, N]`, D `[D]`, z `[B, T, D]`,
        initial_state `[B, D, N]`: as in `selective_scan_naive`; fp32 or bf16 CPU tensors.
        chunk_size: steps between the states saved for the backward pass.

    Returns:
        y `[B, T, D]` in the dtype of `u`, and the final state `[B, D, N]` (fp32) if asked.

    Raises:
        RuntimeError when the kernels are unavailable; TypeError / ValueError (one line,
        naming the argument) for a tensor of the wrong dtype, device or shape.
    """
    lib = kernels.require(_OP)
    _check(u, delta, A, B, C, D, z, initial_state)
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"{_OP}: chunk_size must be a positive integer, got {chunk_size!r}")
    chunk_size = min(chunk_size, max(1, u.shape[1]))  # no chunk longer than the sequence
    tensors = (u, delta, A, B, C, D, z, initial_state)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        y, state = _Scan.apply(*tensors, chunk_size, lib)
    else:
        y, state, _ = _forward(lib, *tensors, chunk_size, save=False)
    y = y.to(u.dtype)
    return (y, state) if return_final_state else y


def _check(u, delta, A, B, C, D, z, initial_state) -> None:
    if not isinstance(u, Tensor) or u.dim() != 3:
        raise ValueError(f"{_OP}: u must be a 3-d tensor [B, T, D], got {_describe(u)}")
    if not isinstance(A, Tensor) or A.dim() != 2:
        raise ValueError(f"{_OP}: A must be a 2-d tensor [D, N], got {_describe(A)}")
    batch, length, channels = u.shape
    n_state = A.shape[1]
    expected = {
        "u": (u, (batch, length, channels), "[B, T, D]"),
        "delta": (delta, (batch, length, channels), "[B, T, D]"),
        "A": (A, (channels, n_state), "[D, N]"),
        "B": (B, (batch, length, n_state), "[B, T, N]"),
        "C": (C, (batch, length, n_state), "[B, T, N]"),
        "D": (D, (channels,), "[D]"),
        "z": (z, (batch, length, channels), "[B, T, D]"),
        "initial_state": (initial_state, (batch, channels, n_state), "[B, D, N]"),
    }
    for name, (tensor, shape, layout) in expected.items():
        if tensor is not None or name in ("u", "delta", "A", "B", "C"):
            kernels.check(_OP, name, tensor, shape, layout)


def _describe(value) -> str:
    return f"shape {list(value.shape)}" if isinstance(value, Tensor) else type(value).__name__


def _forward(lib, u, delta, A, B, C, D, z, h0, chunk: int, save: bool):
    """Run the forward kernel: (y in the streamed inputs' dtype, final state, saved
    tensors for the backward pass or None)."""
    io = kernels.io_dtype(u, delta, B, C, z)
    u, delta, B, C, z = (kernels.prepare(t, io) for t in (u, delta, B, C, z))
    A, D, h0 = (kernels.prepare(t, torch.float32) for t in (A, D, h0))
    batch, length, channels = u.shape
    n_state = A.shape[1]
    y = torch.empty_like(u)
    h_last = u.new_empty(batch, channels, n_state, dtype=torch.float32)
    checkpoints = None
    if save:  # the state before every chunk, in the kernel's own layout
        size = lib.rf_selective_scan_checkpoint_floats(channels, n_state)
        checkpoints = u.new_empty(batch, -(-length // chunk), size, dtype=torch.float32)
    p = kernels.pointer
    kernels.run(
        _OP, lib.rf_selective_scan_forward, io == torch.bfloat16,
        p(u), p(delta), p(A), p(B), p(C), p(D), p(z), p(h0), p(y), p(h_last), p(checkpoints),
        batch, length, channels, n_state, chunk, torch.get_num_threads(),
    )
    saved = (u, delta, A, B, C, D, z, checkpoints) if save else None
    return y, h_last, saved


class _Scan(torch.autograd.Function):
    """The compiled scan with its hand-written backward pass."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, h0, chunk, lib):
        y, h_last, saved = _forward(lib, u, delta, A, B, C, D, z, h0, chunk, save=True)
        ctx.save_for_backward(*saved)
        ctx.chunk, ctx.lib, ctx.has = chunk, lib, (D is not None, z is not None)
        return y, h_last

    @staticmethod
    def backward(ctx, gy, g_last):
        u, delta, A, B, C, D, z, checkpoints = ctx.saved_tensors
        D, z = (t if has else None for t, has in zip((D, z), ctx.has))
        batch, length, channels = u.shape
        n_state = A.shape[1]
        threads = torch.get_num_threads()
        gy = torch.zeros_like(u) if gy is None else gy.to(u.dtype).contiguous()
        g_last = None if g_last is None else g_last.float().contiguous()
        f32 = {"dtype": torch.float32}
        du, ddelta = torch.empty(u.shape, **f32), torch.empty(u.shape, **f32)
        dz = torch.empty(u.shape, **f32) if z is not None else None
        dB = torch.zeros(threads, batch, length, n_state, **f32)
        dC = torch.zeros(threads, batch, length, n_state, **f32)
        dA = torch.empty(batch, channels, n_state, **f32)
        dD = torch.empty(batch, channels, **f32) if D is not None else None
        dh0 = torch.empty(batch, channels, n_state, **f32)
        p = kernels.pointer
        kernels.run(
            _OP, ctx.lib.rf_selective_scan_backward, u.dtype == torch.bfloat16,
            p(u), p(delta), p(A), p(B), p(C), p(D), p(z), p(gy), p(g_last), p(checkpoints),
            p(du), p(ddelta), p(dz), p(dB), p(dC), p(dA), p(dD), p(dh0),
            batch, length, channels, n_state, ctx.chunk, threads,
        )
        dD = None if dD is None else dD.sum(0)
        grads = (du, ddelta, dA.sum(0), dB.sum(0), dC.sum(0), dD, dz, dh0)
        return *(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), None, None
