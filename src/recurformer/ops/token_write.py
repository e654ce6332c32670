"""A static decode step's key and value written into the kept heads' cache buffers.

    write_token(key_buffer, value_buffer, k, v, length, rotary=None)
        buffers `[B, G, C, D]` (written in place), the token's k and v `[B, G, D]`, `length`
        `[1]` (long, on the device: the slot to write, the same for every row); `rotary`: the
        token's (cos, sin), each `[B or 1, D]`, to rotate k with first (None: it is rotated)

[ours] `write_token_torch` is RoPE and two `index_copy_` (the path off the GPU, and the
oracle); on a GPU `write_token_triton` does it in one launch, one program per row and KV
group, where PyTorch launches seven: on a GPU the decode step is bound by its launches
(docs/results/gpu.md). A Triton kernel that fails to build falls back to PyTorch with a
one-line notice (`ops/triton_kernels.py`).
"""

from __future__ import annotations

from torch import Tensor

from .rope import Rotary, rotate, row_stride
from .triton_kernels import run, takes, triton

if triton is not None:
    import triton.language as tl

    from .rope import rotate_in_kernel

KERNEL = "cache write"


def write_token(key_buffer: Tensor, value_buffer: Tensor, k: Tensor, v: Tensor, length: Tensor,
                rotary: Rotary | None = None) -> None:
    """See the module docstring: Triton for CUDA tensors in inference, else PyTorch."""
    args = (key_buffer, value_buffer, k, v, length, rotary)
    if takes(KERNEL, k, v, key_buffer, value_buffer):
        run(KERNEL, write_token_triton, write_token_torch, *args)
    else:
        write_token_torch(*args)


def write_token_torch(key_buffer: Tensor, value_buffer: Tensor, k: Tensor, v: Tensor, length: Tensor,
                      rotary: Rotary | None = None) -> None:
    """The write in PyTorch (module docstring)."""
    if rotary is not None:
        k = rotate(k, *rotary)
    key_buffer.index_copy_(2, length, k[:, :, None].to(key_buffer.dtype))
    value_buffer.index_copy_(2, length, v[:, :, None].to(value_buffer.dtype))


def write_token_triton(key_buffer: Tensor, value_buffer: Tensor, k: Tensor, v: Tensor, length: Tensor,
                       rotary: Rotary | None = None) -> None:
    """The write as one Triton kernel (module docstring); a GPU, or Triton's interpreter."""
    batch, groups, dim = k.shape
    k, v = k.contiguous(), v.contiguous()
    cos, sin = (k, k) if rotary is None else rotary  # not read without `ROTATE`
    _cache_write_kernel[(batch * groups,)](
        k, v, key_buffer, value_buffer, length, cos, sin, 0 if rotary is None else row_stride(rotary), groups, dim,
        *key_buffer.stride(), *value_buffer.stride(), BLOCK_D=triton.next_power_of_2(dim), ROTATE=rotary is not None,
    )


if triton is not None:

    @triton.jit
    def _cache_write_kernel(k_ptr, v_ptr, keys_ptr, values_ptr, length_ptr, cos_ptr, sin_ptr, cos_stride, groups, dim,
                      skb, skg, skc, skd, svb, svg, svc, svd, BLOCK_D: tl.constexpr, ROTATE: tl.constexpr):
        """Program (row b, group g): the token's key (rotated first with `ROTATE`) and value
        written at slot `length`."""
        row_group = tl.program_id(0)
        b, g = row_group // groups, row_group % groups
        slot = tl.load(length_ptr)
        d = tl.arange(0, BLOCK_D)
        mask = d < dim
        source = row_group * dim
        key = tl.load(k_ptr + source + d, mask=mask, other=0.0)
        if ROTATE:
            partner = tl.load(k_ptr + source + (d + dim // 2) % dim, mask=mask, other=0.0)
            key = rotate_in_kernel(key, partner, d, dim, cos_ptr + b * cos_stride, sin_ptr + b * cos_stride, mask)
        value = tl.load(v_ptr + source + d, mask=mask, other=0.0)
        tl.store(keys_ptr + b * skb + g * skg + slot * skc + d * skd, key.to(keys_ptr.dtype.element_ty), mask=mask)
        tl.store(values_ptr + b * svb + g * svg + slot * svc + d * svd, value.to(values_ptr.dtype.element_ty),
                 mask=mask)
