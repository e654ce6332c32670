"""The mamba2 decode step as one Triton kernel: the GPU's `mamba2_step`.

[ours] On a GPU a decode step replayed from a CUDA graph costs about as much per kernel as
it moves bytes, and the PyTorch step (`naive.py`) issues 46 operator calls per layer
(docs/results/gpu.md). Here one program per (row, group of heads) does all of it: the
conv's update of the group's channels (x, B and its heads' C), SiLU, softplus, each head's
state update and output, and each head's gated RMS norm. Arithmetic in fp32, rounded to the
activations' dtype where the PyTorch step rounds (the conv's output, SiLU, dt, y), so both
agree within the bf16 bound. The oracle is `mamba2_step_naive`; on the CPU the check runs in
Triton's interpreter (`tests/ops/test_step_triton.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..triton_kernels import triton

if triton is not None:
    import triton.language as tl


def mamba2_step_triton(
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
    """`mamba2_step_naive`'s signature and result (`[B, H P]` in zxbcdt's dtype); the conv
    and SSM states (contiguous; the SSM state fp32) updated in place."""
    batch, heads, head_dim, n_state = ssm_state.shape
    channels, width = conv_weight.shape
    zxbcdt, conv_weight = zxbcdt.contiguous(), conv_weight.contiguous()
    out = torch.empty(batch, heads * head_dim, dtype=zxbcdt.dtype, device=zxbcdt.device)
    _step_kernel[(batch, groups)](
        zxbcdt, conv_state, ssm_state, conv_weight, conv_bias if conv_bias is not None else conv_weight,
        dt_bias, A_log, D, norm_weight if norm_weight is not None else D, out,
        heads, groups, head_dim, n_state, channels, eps,
        HAS_BIAS=conv_bias is not None, HAS_NORM=norm_weight is not None, WIDTH=width,
        BLOCK_P=triton.next_power_of_2(head_dim), BLOCK_N=triton.next_power_of_2(n_state),
        BLOCK_W=triton.next_power_of_2(width),
    )
    return out


if triton is not None:

    @triton.jit
    def _round(x, like):
        """x in fp32, rounded to the dtype of the tensor `like` points into."""
        return x.to(like.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _conv_silu(in_ptr, state_ptr, weight_ptr, bias_ptr, channel, mask, HAS_BIAS: tl.constexpr, WIDTH: tl.constexpr,
                   BLOCK_W: tl.constexpr):
        """The conv's step for `channel` (a block of channel indices): shift the state by the
        new input, the weighted sum, bias, rounded, SiLU, rounded. The state is updated.

        Every tap is read before any is written, with a barrier between: a block smaller than
        the program's threads is held by several warps at once, and a warp that shifted the
        state before another had read it gave that one shifted taps (on a GPU only: fp32
        errors of 0.27 at a Llama-8B layer's sizes; the interpreter runs one thread)."""
        k = tl.arange(0, BLOCK_W)
        tap_mask = mask[:, None] & (k[None, :] < WIDTH)
        new = _round(tl.load(in_ptr + channel, mask=mask, other=0.0).to(tl.float32), state_ptr)
        older = tl.load(state_ptr + channel[:, None] * WIDTH + k[None, :] + 1,
                        mask=mask[:, None] & (k[None, :] < WIDTH - 1), other=0.0).to(tl.float32)
        taps = tl.where(k[None, :] == WIDTH - 1, new[:, None], older)  # the state shifted by one, the new input last
        weight = tl.load(weight_ptr + channel[:, None] * WIDTH + k[None, :], mask=tap_mask, other=0.0).to(tl.float32)
        total = tl.sum(taps * weight, axis=1)
        tl.debug_barrier()
        tl.store(state_ptr + channel[:, None] * WIDTH + k[None, :], taps.to(state_ptr.dtype.element_ty), mask=tap_mask)
        if HAS_BIAS:
            total += tl.load(bias_ptr + channel, mask=mask, other=0.0).to(tl.float32)
        total = _round(total, in_ptr)
        return _round(total / (1.0 + tl.exp(-total)), in_ptr)

    @triton.jit
    def _step_kernel(in_ptr, conv_ptr, ssm_ptr, conv_w_ptr, conv_b_ptr, dt_bias_ptr, a_log_ptr, d_ptr, norm_ptr,
                     out_ptr, heads, groups, head_dim, n_state, channels, eps,
                     HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, WIDTH: tl.constexpr,
                     BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
        """Program (row b, group g): the group's heads' step (module docstring)."""
        b, g = tl.program_id(0), tl.program_id(1)
        per_group = heads // groups
        row_in = in_ptr + b * (heads * head_dim + channels + heads)
        xbc_in = row_in + heads * head_dim
        conv = conv_ptr + b * channels * WIDTH
        ip, jn = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_N)
        p_mask, n_mask = ip < head_dim, jn < n_state
        x = _conv_silu(xbc_in, conv, conv_w_ptr, conv_b_ptr, g * head_dim + ip, p_mask, HAS_BIAS, WIDTH, BLOCK_W)
        b_channel = groups * head_dim + g * n_state + jn
        B = _conv_silu(xbc_in, conv, conv_w_ptr, conv_b_ptr, b_channel, n_mask, HAS_BIAS, WIDTH, BLOCK_W)
        for i in tl.range(0, per_group):
            h = g * per_group + i
            c_channel = groups * head_dim + groups * n_state + h * n_state + jn
            C = _conv_silu(xbc_in, conv, conv_w_ptr, conv_b_ptr, c_channel, n_mask, HAS_BIAS, WIDTH, BLOCK_W)
            dt = tl.load(xbc_in + channels + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
            dt = _round(dt, in_ptr)
            dt = _round(tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt))), in_ptr)
            decay = tl.exp(tl.maximum(dt * -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)), -80.0))
            state_ptrs = ssm_ptr + ((b * heads + h) * head_dim + ip[:, None]) * n_state + jn[None, :]
            state_mask = p_mask[:, None] & n_mask[None, :]
            state = tl.load(state_ptrs, mask=state_mask, other=0.0)
            state = state * decay + (dt * x)[:, None] * B[None, :]
            tl.debug_barrier()  # as in `_conv_silu`: every copy of a small tile read before it is written
            tl.store(state_ptrs, state, mask=state_mask)
            y = tl.sum(state * C[None, :], axis=1) + tl.load(d_ptr + h).to(tl.float32) * x
            y = _round(y, in_ptr)
            z = tl.load(row_in + h * head_dim + ip, mask=p_mask, other=0.0).to(tl.float32)
            gated = y * (z / (1.0 + tl.exp(-z)))
            if HAS_NORM:
                mean = tl.sum(tl.where(p_mask, gated * gated, 0.0), axis=0) / head_dim
                weight = tl.load(norm_ptr + h * head_dim + ip, mask=p_mask, other=0.0).to(tl.float32)
                gated = gated / tl.sqrt(mean + eps) * weight
            tl.store(out_ptr + (b * heads + h) * head_dim + ip, gated.to(out_ptr.dtype.element_ty), mask=p_mask)
