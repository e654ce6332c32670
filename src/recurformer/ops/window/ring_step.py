"""The window mixer's decode step over its ring buffer: write the token, attend over the buffer.

    ring_step(q, k, v, keys, values, index, window, sinks, scale, rotary=None)
        q `[B, H, D]`, k and v `[B, G, D]`, the state's keys and values
        `[B, sinks + window, G, D]` and index `[B, sinks + window]` (each slot's token
        position, -1: empty; all updated in place) -> `[B, H, D]` in q's dtype; `rotary`:
        the token's (cos, sin), each `[B or 1, D]`, to rotate q and k with (None: they are
        rotated already)

The token at position n (one past the largest index) goes to slot n if n < sinks, else to
slot `sinks + (n - sinks) % window`; after the write the buffer holds exactly the tokens the
query may see, so the attention is a softmax over the filled slots, each KV group's query
heads as that group's queries. `ring_step_torch` is the PyTorch step (the oracle, and the
path off the GPU). [ours] On a GPU `ring_step_triton` does it in two launches (the write,
one program per row; the attention, one per row and group) where PyTorch issues 17
operator calls: on a GPU the decode step is bound by its launches (docs/results/gpu.md).
Given `rotary`, the kernels rotate k as they write it and q as they load it, where PyTorch's
RoPE would launch ten more. A Triton kernel that fails to build falls back to PyTorch with a
one-line notice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..rope import Rotary, rotate, row_stride
from ..triton_kernels import run, takes, triton

if triton is not None:
    import triton.language as tl

    from ..decode_attention import attend_block  # the online softmax over one block of keys
    from ..rope import rotate_in_kernel

KERNEL = "window step"


def ring_step(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, index: Tensor, window: int, sinks: int,
              scale: float, rotary: Rotary | None = None) -> Tensor:
    """See the module docstring: Triton for CUDA tensors in inference (contiguous buffers), else PyTorch."""
    args = (q, k, v, keys, values, index, window, sinks, scale, rotary)
    if keys.is_contiguous() and values.is_contiguous() and index.is_contiguous() and takes(KERNEL, q, k, v, keys, values):
        return run(KERNEL, ring_step_triton, ring_step_torch, *args)
    return ring_step_torch(*args)


def ring_slot(position: Tensor, window: int, sinks: int) -> Tensor:
    """The ring-buffer slot of the tokens at `position` (>= 0)."""
    return torch.where(position < sinks, position, sinks + (position - sinks).remainder(window))


def ring_step_torch(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, index: Tensor, window: int,
                    sinks: int, scale: float, rotary: Rotary | None = None) -> Tensor:
    """The step in PyTorch (module docstring)."""
    if rotary is not None:
        q, k = rotate(q, *rotary), rotate(k, *rotary)
    batch, heads, dim = q.shape
    groups = k.shape[1]
    position = index.max(dim=-1).values + 1  # [B]
    rows, slot = torch.arange(batch, device=q.device), ring_slot(position, window, sinks)
    keys[rows, slot] = k.to(keys.dtype)
    values[rows, slot] = v.to(values.dtype)
    index[rows, slot] = position
    out = F.scaled_dot_product_attention(
        q.reshape(batch, groups, heads // groups, dim), keys.transpose(1, 2).to(q.dtype),
        values.transpose(1, 2).to(q.dtype), attn_mask=(index >= 0)[:, None, None, :], scale=scale,
    )
    return out.reshape(batch, heads, dim)


def ring_step_triton(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, index: Tensor, window: int,
                     sinks: int, scale: float, rotary: Rotary | None = None) -> Tensor:
    """The step as two Triton kernels (module docstring); a GPU, or Triton's interpreter."""
    batch, heads, dim = q.shape
    slots, groups = keys.shape[1], keys.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    cos, sin = (q, q) if rotary is None else rotary  # not read without `ROTATE`
    cos_stride = 0 if rotary is None else row_stride(rotary)
    _write_kernel[(batch,)](k, v, keys, values, index, cos, sin, cos_stride, slots, groups * dim, dim, window, sinks,
                            BLOCK_S=triton.next_power_of_2(slots), BLOCK_GD=triton.next_power_of_2(groups * dim),
                            ROTATE=rotary is not None)
    out = torch.empty_like(q)
    queries = heads // groups
    _attend_kernel[(batch * groups,)](
        q, keys, values, index, out, cos, sin, cos_stride, groups, queries, slots, dim, scale,
        BLOCK_Q=max(16, triton.next_power_of_2(queries)), BLOCK_N=64, BLOCK_D=max(16, triton.next_power_of_2(dim)),
        IEEE=q.dtype == torch.float32, ROTATE=rotary is not None,
    )
    return out


if triton is not None:

    @triton.jit
    def _write_kernel(k_ptr, v_ptr, keys_ptr, values_ptr, index_ptr, cos_ptr, sin_ptr, cos_stride, slots, width, dim,
                      window, sinks, BLOCK_S: tl.constexpr, BLOCK_GD: tl.constexpr, ROTATE: tl.constexpr):
        """Program (row b): the token's position (one past the largest index), its slot, and
        its key (rotated first with `ROTATE`), value and position written there."""
        b = tl.program_id(0)
        js = tl.arange(0, BLOCK_S)
        index = tl.load(index_ptr + b * slots + js, mask=js < slots, other=-1)
        position = tl.max(index, axis=0) + 1
        slot = tl.where(position < sinks, position, sinks + (position - sinks) % window)
        i = tl.arange(0, BLOCK_GD)
        mask = i < width
        key = tl.load(k_ptr + b * width + i, mask=mask, other=0.0)
        if ROTATE:
            d = i % dim
            partner = tl.load(k_ptr + b * width + i - d + (d + dim // 2) % dim, mask=mask, other=0.0)
            key = rotate_in_kernel(key, partner, d, dim, cos_ptr + b * cos_stride, sin_ptr + b * cos_stride, mask)
        value = tl.load(v_ptr + b * width + i, mask=mask, other=0.0)
        tl.store(keys_ptr + (b * slots + slot) * width + i, key.to(keys_ptr.dtype.element_ty), mask=mask)
        tl.store(values_ptr + (b * slots + slot) * width + i, value.to(values_ptr.dtype.element_ty), mask=mask)
        tl.store(index_ptr + b * slots + slot, position)

    @triton.jit
    def _attend_kernel(q_ptr, keys_ptr, values_ptr, index_ptr, out_ptr, cos_ptr, sin_ptr, cos_stride, groups, queries,
                       slots, dim, scale, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       IEEE: tl.constexpr, ROTATE: tl.constexpr):
        """Program (row b, group g): the group's query heads (rotated first with `ROTATE`, in
        their dtype) over the filled slots (online softmax in fp32; the buffer read in the
        queries' dtype, as the PyTorch step casts it)."""
        row_group = tl.program_id(0)
        b, g = row_group // groups, row_group % groups
        iq, idim = tl.arange(0, BLOCK_Q), tl.arange(0, BLOCK_D)
        q_mask = (iq[:, None] < queries) & (idim[None, :] < dim)
        heads = groups * queries
        q_ptrs = q_ptr + (b * heads + g * queries + iq[:, None]) * dim + idim[None, :]
        query = tl.load(q_ptrs, mask=q_mask, other=0.0)
        if ROTATE:
            partner = tl.load(q_ptrs - idim[None, :] + (idim[None, :] + dim // 2) % dim, mask=q_mask, other=0.0)
            query = rotate_in_kernel(query, partner, idim[None, :], dim, cos_ptr + b * cos_stride,
                                     sin_ptr + b * cos_stride, q_mask).to(q_ptr.dtype.element_ty)
        best = tl.full((BLOCK_Q,), -1e30, tl.float32)
        total = tl.zeros((BLOCK_Q,), tl.float32)
        acc = tl.zeros((BLOCK_Q, BLOCK_D), tl.float32)
        for start in tl.range(0, slots, BLOCK_N):
            js = start + tl.arange(0, BLOCK_N)
            inside = js < slots
            seen = tl.load(index_ptr + b * slots + js, mask=inside, other=-1) >= 0
            kv_mask = inside[:, None] & (idim[None, :] < dim)
            offsets = ((b * slots + js[:, None]) * groups + g) * dim + idim[None, :]
            key = tl.load(keys_ptr + offsets, mask=kv_mask, other=0.0).to(q_ptr.dtype.element_ty)
            value = tl.load(values_ptr + offsets, mask=kv_mask, other=0.0).to(q_ptr.dtype.element_ty)
            best, total, acc = attend_block(query, key, value, seen, scale, best, total, acc, IEEE)
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(out_ptr + (b * heads + g * queries + iq[:, None]) * dim + idim[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)
