"""Compiled CPU SSD (`ops/csrc/ssd.cpp`) behind the oracle's signature.

The recurrence itself, fused over time: per batch row, head and 16 rows of the `[P, N]`
state (the vector lanes), one loop over the sequence with that part of the state in L1,
parallel over (batch, head, row block); a scalar `exp` per step and head, two
multiply-adds per state value. The backward pass is written by hand: the forward pass
saves the state every `chunk_size` steps, the backward pass recomputes each chunk's
states from it and runs the adjoint recurrence in reverse. fp32 or bf16 inputs, fp32
arithmetic. See docs/scan.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import kernels
from .chunked import DEFAULT_CHUNK

_OP = "ssd"


def ssd_compiled(
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
    """SSD with the compiled kernel; same signature and results as `ssd_naive`.

    Args:
        x `[B, T, H, P]`, dt `[B, T, H]`, A `[H]`, B `[B, T, G, N]`, C `[B, T, G', N]`,
        D `[H]`, initial_state `[B, H, P, N]`: as in `ssd_naive`; fp32 or bf16 CPU tensors.
        chunk_size: steps between the states saved for the backward pass.

    Returns:
        y `[B, T, H, P]` in the dtype of `x`, and the final state `[B, H, P, N]` (fp32) if asked.

    Raises:
        RuntimeError when the kernels are unavailable; TypeError / ValueError (one line,
        naming the argument) for a tensor of the wrong dtype, device or shape.
    """
    lib = kernels.require(_OP)
    _check(x, dt, A, B, C, D, initial_state)
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"{_OP}: chunk_size must be a positive integer, got {chunk_size!r}")
    chunk_size = min(chunk_size, max(1, x.shape[1]))  # no chunk longer than the sequence
    tensors = (x, dt, A, B, C, D, initial_state)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        y, state = _Ssd.apply(*tensors, chunk_size, lib)
    else:
        y, state, _ = _forward(lib, *tensors, chunk_size, save=False)
    y = y.to(x.dtype)
    return (y, state) if return_final_state else y


def _check(x, dt, A, B, C, D, initial_state) -> None:
    for name, tensor, dims, layout in (("x", x, 4, "[B, T, H, P]"), ("B", B, 4, "[B, T, G, N]"),
                                       ("C", C, 4, "[B, T, G', N]")):
        if not isinstance(tensor, Tensor) or tensor.dim() != dims:
            got = f"shape {list(tensor.shape)}" if isinstance(tensor, Tensor) else type(tensor).__name__
            raise ValueError(f"{_OP}: {name} must be a {dims}-d tensor {layout}, got {got}")
    batch, length, heads, head_dim = x.shape
    n_state = B.shape[3]
    for name, groups in (("B", B.shape[2]), ("C", C.shape[2])):
        if groups < 1 or heads % groups:
            raise ValueError(f"{_OP}: {heads} heads cannot share {groups} groups evenly ({name})")
    expected = {
        "x": (x, (batch, length, heads, head_dim), "[B, T, H, P]"),
        "dt": (dt, (batch, length, heads), "[B, T, H]"),
        "A": (A, (heads,), "[H]"),
        "B": (B, (batch, length, B.shape[2], n_state), "[B, T, G, N]"),
        "C": (C, (batch, length, C.shape[2], n_state), "[B, T, G', N]"),
        "D": (D, (heads,), "[H]"),
        "initial_state": (initial_state, (batch, heads, head_dim, n_state), "[B, H, P, N]"),
    }
    for name, (tensor, shape, layout) in expected.items():
        if tensor is not None or name not in ("D", "initial_state"):
            kernels.check(_OP, name, tensor, shape, layout)


def _forward(lib, x, dt, A, B, C, D, s0, chunk: int, save: bool):
    """Run the forward kernel: (y in the streamed inputs' dtype, final state, saved
    tensors for the backward pass or None)."""
    io = kernels.io_dtype(x, dt, B, C)
    x, dt, B, C = (kernels.prepare(t, io) for t in (x, dt, B, C))
    A, D, s0 = (kernels.prepare(t, torch.float32) for t in (A, D, s0))
    batch, length, heads, head_dim = x.shape
    n_state = B.shape[3]
    y = torch.empty_like(x)
    s_last = x.new_empty(batch, heads, head_dim, n_state, dtype=torch.float32)
    checkpoints = None
    if save:  # the state before every chunk, in the kernel's own layout
        size = lib.rf_ssd_checkpoint_floats(heads, head_dim, n_state)
        checkpoints = x.new_empty(batch, -(-length // chunk), size, dtype=torch.float32)
    p = kernels.pointer
    kernels.run(
        _OP, lib.rf_ssd_forward, io == torch.bfloat16,
        p(x), p(dt), p(A), p(B), p(C), p(D), p(s0), p(y), p(s_last), p(checkpoints),
        batch, length, heads, head_dim, n_state, B.shape[2], C.shape[2], chunk, torch.get_num_threads(),
    )
    return y, s_last, (x, dt, A, B, C, D, checkpoints) if save else None


class _Ssd(torch.autograd.Function):
    """The compiled SSD with its hand-written backward pass."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, s0, chunk, lib):
        y, s_last, saved = _forward(lib, x, dt, A, B, C, D, s0, chunk, save=True)
        ctx.save_for_backward(*saved)
        ctx.chunk, ctx.lib, ctx.has_D = chunk, lib, D is not None
        return y, s_last

    @staticmethod
    def backward(ctx, gy, g_last):
        x, dt, A, B, C, D, checkpoints = ctx.saved_tensors
        D = D if ctx.has_D else None
        batch, length, heads, head_dim = x.shape
        groups_B, groups_C, n_state = B.shape[2], C.shape[2], B.shape[3]
        threads = torch.get_num_threads()
        gy = torch.zeros_like(x) if gy is None else gy.to(x.dtype).contiguous()
        g_last = None if g_last is None else g_last.float().contiguous()
        f32 = {"dtype": torch.float32}
        dx = torch.empty(x.shape, **f32)
        ddt = torch.zeros(threads, batch, length, heads, **f32)
        dB = torch.zeros(threads, batch, length, groups_B, n_state, **f32)
        dC = torch.zeros(threads, batch, length, groups_C, n_state, **f32)
        dA, dD = torch.zeros(threads, heads, **f32), torch.zeros(threads, heads, **f32)
        ds0 = torch.empty(batch, heads, head_dim, n_state, **f32)
        p = kernels.pointer
        kernels.run(
            _OP, ctx.lib.rf_ssd_backward, x.dtype == torch.bfloat16,
            p(x), p(dt), p(A), p(B), p(C), p(D), p(gy), p(g_last), p(checkpoints),
            p(dx), p(ddt), p(dB), p(dC), p(dA), p(dD), p(ds0),
            batch, length, heads, head_dim, n_state, groups_B, groups_C, ctx.chunk, threads,
        )
        grads = (dx, ddt.sum(0), dA.sum(0), dB.sum(0), dC.sum(0), dD.sum(0), ds0)
        return *(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), None, None
