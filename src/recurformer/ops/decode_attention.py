"""One decode step's attention over a long static K/V buffer, split along the keys.

[ours] A decode step has one query per head, so SDPA's GPU kernels, which share out work
by (row, head, block of queries), run a few dozen programs over the whole buffer: on an
H100 the original's decode at 128K tokens read its cache at about a twentieth of the
card's bandwidth (docs/results/gpu.md). Here the keys are cut into splits, each split's
queries of a KV group attend over it in one Triton program (online softmax, fp32), and the
splits' outputs are merged by their log-sum-exp ("flash decoding"). Each K/V head is read
once for all the query heads of its group. Two launches in all: the splits, then their merge.

    decode_attention(q, k, v, visible, scale, rotary=None)
        q `[B, G, Q, D]` (the Q query heads of each of G KV groups), k and v `[B, G, C, D]`,
        visible bool broadcastable to `[B, G, 1, C]` (True: the query sees that slot)
        -> `[B, G, Q, D]` in q's dtype; `rotary`: the token's (cos, sin), each `[B or 1, D]`,
        to rotate q with first (None: q is rotated; the kernel rotates it as it loads it)

On a CUDA tensor with Triton present: the split kernel (its first call compiles it; a
kernel that fails falls back to SDPA with a one-line notice, `ops/triton_kernels.py`); anywhere else:
SDPA, which is what the kernel is checked against.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .rope import Rotary, rotate, row_stride
from .triton_kernels import run, takes, triton

if triton is not None:
    import triton.language as tl

    from .rope import rotate_in_kernel

BLOCK_KEYS = 64  # keys a program loads at once
KERNEL = "split decode attention"


def decode_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float,
                     rotary: Rotary | None = None) -> Tensor:
    """See the module docstring."""
    if q.shape[2] <= 64 and takes(KERNEL, q, k, v):
        return run(KERNEL, split_decode_attention, sdpa_decode_attention, q, k, v, visible, scale, rotary)
    return sdpa_decode_attention(q, k, v, visible, scale, rotary)


def sdpa_decode_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float,
                          rotary: Rotary | None = None) -> Tensor:
    """The same through SDPA: the path off the GPU, and the kernel's oracle."""
    if rotary is not None:
        q = rotate(q.flatten(1, 2), *rotary).view(q.shape)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)


def split_decode_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float,
                           rotary: Rotary | None = None, splits: int | None = None) -> Tensor:
    """The split kernel itself (Triton: a GPU, or its interpreter with `TRITON_INTERPRET=1`);
    `splits`: how many pieces the keys are cut into (default: enough programs to fill the
    GPU twice over)."""
    batch, groups, queries, dim = q.shape
    length = k.shape[2]
    if splits is None:
        programs = 2 * (torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4)
        splits = max(1, min(math.ceil(length / BLOCK_KEYS), math.ceil(programs / (batch * groups))))
    span = math.ceil(math.ceil(length / splits) / BLOCK_KEYS) * BLOCK_KEYS  # keys per split
    splits = math.ceil(length / span)
    seen = visible.expand(batch, groups, 1, length).view(torch.uint8)
    partial = torch.empty(batch, groups, splits, queries, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, groups, splits, queries, dtype=torch.float32, device=q.device)
    cos, sin = (q, q) if rotary is None else rotary  # not read without `ROTATE`
    _split_kernel[(batch * groups, splits)](
        q, k, v, seen, partial, lse, cos, sin, 0 if rotary is None else row_stride(rotary),
        groups, queries, length, dim, span, scale,
        *q.stride(), *k.stride(), *v.stride(), seen.stride(0), seen.stride(1), seen.stride(3),
        BLOCK_Q=max(16, triton.next_power_of_2(queries)), BLOCK_N=BLOCK_KEYS,
        BLOCK_D=max(16, triton.next_power_of_2(dim)), IEEE=q.dtype == torch.float32, ROTATE=rotary is not None,
    )
    out = torch.empty(batch, groups, queries, dim, dtype=q.dtype, device=q.device)
    _merge_kernel[(batch * groups,)](partial, lse, out, splits, queries, dim,
                                     BLOCK_Q=triton.next_power_of_2(queries), BLOCK_D=triton.next_power_of_2(dim))
    return out


if triton is not None:

    @triton.jit
    def attend_block(query, key, value, seen, scale, best, total, acc, IEEE: tl.constexpr):
        """One block of keys in an online softmax: `query` `[Q, D]`, `key` and `value` `[N, D]`,
        `seen` `[N]` (False: masked); the running max `best` and sum `total` `[Q]` and the
        unnormalized output `acc` `[Q, D]` (fp32) -> their updated values. fp32 inputs take
        full-precision products (`IEEE`; Triton's default for fp32 is TF32)."""
        if IEEE:
            scores = tl.dot(query, tl.trans(key), input_precision="ieee") * scale  # [Q, N]
        else:
            scores = tl.dot(query, tl.trans(key)).to(tl.float32) * scale
        scores = tl.where(seen[None, :], scores, -1e30)
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        weights = tl.where(seen[None, :], tl.exp(scores - new_best[:, None]), 0.0)
        rescale = tl.exp(best - new_best)
        total = total * rescale + tl.sum(weights, axis=1)
        if IEEE:
            acc = acc * rescale[:, None] + tl.dot(weights, value, input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(weights.to(value.dtype), value).to(tl.float32)
        return new_best, total, acc

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, seen_ptr, out_ptr, lse_ptr, cos_ptr, sin_ptr, cos_stride,
                      groups, queries, length, dim, span, scale,
                      sqb, sqg, sqq, sqd, skb, skg, skc, skd, svb, svg, svc, svd, smb, smg, smc,
                      BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
                      ROTATE: tl.constexpr):
        """Program (row x group, split): the group's queries (rotated first with `ROTATE`, in
        their dtype) over keys [split * span, +span) -> their softmax-weighted values,
        normalized within the split, and the split's log-sum-exp (-1e30 where it sees no key)."""
        row_group, split = tl.program_id(0), tl.program_id(1)
        b, g = row_group // groups, row_group % groups
        iq, idim = tl.arange(0, BLOCK_Q), tl.arange(0, BLOCK_D)
        q_mask = (iq[:, None] < queries) & (idim[None, :] < dim)
        q_rows = q_ptr + b * sqb + g * sqg + iq[:, None] * sqq
        query = tl.load(q_rows + idim[None, :] * sqd, mask=q_mask, other=0.0)
        if ROTATE:
            partner = tl.load(q_rows + ((idim[None, :] + dim // 2) % dim) * sqd, mask=q_mask, other=0.0)
            query = rotate_in_kernel(query, partner, idim[None, :], dim, cos_ptr + b * cos_stride,
                                     sin_ptr + b * cos_stride, q_mask).to(q_ptr.dtype.element_ty)
        best = tl.full((BLOCK_Q,), -1e30, tl.float32)
        total = tl.zeros((BLOCK_Q,), tl.float32)
        acc = tl.zeros((BLOCK_Q, BLOCK_D), tl.float32)
        start = split * span
        for offset in tl.range(0, span, BLOCK_N):
            keys = start + offset + tl.arange(0, BLOCK_N)
            inside = keys < length
            seen = tl.load(seen_ptr + b * smb + g * smg + keys * smc, mask=inside, other=0) != 0
            kv_mask = inside[:, None] & (idim[None, :] < dim)
            key = tl.load(k_ptr + b * skb + g * skg + keys[:, None] * skc + idim[None, :] * skd, mask=kv_mask, other=0.0)
            value = tl.load(v_ptr + b * svb + g * svg + keys[:, None] * svc + idim[None, :] * svd, mask=kv_mask, other=0.0)
            best, total, acc = attend_block(query, key, value, seen, scale, best, total, acc, IEEE)
        found = total > 0
        out = tl.where(found[:, None], acc / tl.where(found, total, 1.0)[:, None], 0.0)
        base = (row_group * tl.num_programs(1) + split) * queries
        tl.store(out_ptr + (base + iq[:, None]) * dim + idim[None, :], out, mask=q_mask)
        tl.store(lse_ptr + base + iq, tl.where(found, best + tl.log(tl.where(found, total, 1.0)), -1e30),
                 mask=iq < queries)

    @triton.jit
    def _merge_kernel(partial_ptr, lse_ptr, out_ptr, splits, queries, dim,
                      BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
        """Program (row x group): the splits' outputs weighted by exp(lse - the largest lse)
        (an empty split weighs 0), summed and normalized -> `[Q, D]` in the output's dtype."""
        row_group = tl.program_id(0)
        iq, idim = tl.arange(0, BLOCK_Q), tl.arange(0, BLOCK_D)
        q_mask = iq < queries
        mask = q_mask[:, None] & (idim[None, :] < dim)
        best = tl.full((BLOCK_Q,), -1e30, tl.float32)
        for split in tl.range(0, splits):
            best = tl.maximum(best, tl.load(lse_ptr + (row_group * splits + split) * queries + iq, mask=q_mask,
                                            other=-1e30))
        total = tl.zeros((BLOCK_Q,), tl.float32)
        acc = tl.zeros((BLOCK_Q, BLOCK_D), tl.float32)
        for split in tl.range(0, splits):
            base = (row_group * splits + split) * queries
            weight = tl.exp(tl.load(lse_ptr + base + iq, mask=q_mask, other=-1e30) - best)
            total += weight
            acc += weight[:, None] * tl.load(partial_ptr + (base + iq[:, None]) * dim + idim[None, :], mask=mask,
                                             other=0.0)
        tl.store(out_ptr + (row_group * queries + iq[:, None]) * dim + idim[None, :],
                 (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
