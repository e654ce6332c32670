"""KV caches stored as llama.cpp stores them: F16, or q8_0 / q4_0 blocks, rotated first.

llama.cpp (`-ctk` / `-ctv`) stores each cached key and value row in blocks of 32 along the head
dimension, one F16 scale per block: q8_0 as 32 int8 (34 bytes a block), q4_0 as 32 4-bit values
with an offset of 8 (18 bytes). Before a quantized cache stores them, the pinned build rotates
(`llama_kv_cache`, `attn_rot_k` / `attn_rot_v`) by an orthonormal Walsh-Hadamard matrix: keys
(and the queries, so that q.k is unchanged) in chunks of the largest power of two from 64 that
divides the head size, values in chunks of 64 (the attention's output rotated back), each only
when the head size is a multiple of 64. `stored` gives what attention then reads: the rotation,
the block round trip and the rotation back, so a PyTorch model attends over the values the
engine attends over. The round trips equal gguf-py's `gguf.quants` bit for bit.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

KV_CACHE_TYPES = ("f16", "q8_0", "q4_0")
BLOCK = 32
# bytes per stored value: a block's scale (F16) plus its 32 values
BYTES_PER_VALUE = {"f16": 2.0, "q8_0": (2 + 32) / BLOCK, "q4_0": (2 + 16) / BLOCK}


def check_cache_type(cache_type: str, head_dim: int) -> None:
    """A ValueError naming the problem if `cache_type` cannot store heads of `head_dim`."""
    if cache_type not in KV_CACHE_TYPES:
        raise ValueError(f"unknown KV cache type {cache_type!r}: one of {', '.join(KV_CACHE_TYPES)}")
    if cache_type != "f16" and head_dim % BLOCK:
        raise ValueError(f"a {cache_type} cache stores blocks of {BLOCK} along the head dimension; "
                         f"the heads have {head_dim}")


def _round_half_away(x: Tensor) -> Tensor:
    """C's roundf, as gguf-py computes it (float32)."""
    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())


def _blocks(x: Tensor) -> Tensor:
    return x.float().reshape(-1, BLOCK)


def quantize_q8_0(x: Tensor) -> tuple[Tensor, Tensor]:
    """x `[..., n]` (n a multiple of 32) -> (scales `[N]` float16, values `[N, 32]` int8), N blocks."""
    blocks = _blocks(x)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    return d[:, 0].half(), _round_half_away(blocks * inverse).to(torch.int8)


def dequantize_q8_0(scales: Tensor, values: Tensor) -> Tensor:
    """`[N]` float16, `[N, 32]` int8 -> `[N, 32]` float32."""
    return values.float() * scales.float()[:, None]


def quantize_q4_0(x: Tensor) -> tuple[Tensor, Tensor]:
    """x `[..., n]` -> (scales `[N]` float16, values `[N, 32]` uint8 in 0..15, offset 8)."""
    blocks = _blocks(x)
    largest = blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True))
    d = largest / -8
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    values = (blocks * inverse + 8.5).trunc().clamp(0, 15).to(torch.uint8)
    return d[:, 0].half(), values


def dequantize_q4_0(scales: Tensor, values: Tensor) -> Tensor:
    """`[N]` float16, `[N, 32]` uint8 -> `[N, 32]` float32."""
    return (values.float() - 8) * scales.float()[:, None]


def block_bytes(cache_type: str, scales: Tensor, values: Tensor) -> Tensor:
    """The blocks as llama.cpp lays them out in memory `[N, bytes per block]` uint8: the scale's
    two bytes, then q8_0's 32 int8 or q4_0's 16 bytes (value i in the low nibble of byte i, value
    16 + i in its high nibble)."""
    d = scales.view(torch.uint8).reshape(-1, 2)
    if cache_type == "q8_0":
        return torch.cat([d, values.view(torch.uint8)], dim=1)
    return torch.cat([d, values[:, :16] | (values[:, 16:] << 4)], dim=1)


def round_trip(x: Tensor, cache_type: str) -> Tensor:
    """x `[..., n]` as a `cache_type` cache gives it back (float32, x's shape)."""
    if cache_type == "f16":
        return x.half().float()
    quantize, dequantize = {"q8_0": (quantize_q8_0, dequantize_q8_0), "q4_0": (quantize_q4_0, dequantize_q4_0)}[cache_type]
    return dequantize(*quantize(x)).reshape(x.shape)


@lru_cache
def hadamard(n: int) -> Tensor:
    """The orthonormal Walsh-Hadamard matrix `[n, n]` (Sylvester's order, n a power of two), as
    llama.cpp builds it: symmetric, its own inverse. Made once per size (every layer's every
    step rotates); not to be changed in place."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def rotation_size(head_dim: int, which: str) -> int | None:
    """The chunk the pinned llama.cpp rotates a quantized cache's `which` ("k" or "v") rows in,
    or None where it does not rotate (a head size that is no multiple of 64)."""
    if head_dim % 64:
        return None
    if which == "v":
        return 64
    size = 64
    while head_dim % (2 * size) == 0:
        size *= 2
    return size


def rotate(x: Tensor, size: int) -> Tensor:
    """x `[..., D]` with each chunk of `size` along D multiplied by the Hadamard matrix."""
    h = hadamard(size).to(x.device, torch.float32)
    return (x.float().reshape(*x.shape[:-1], -1, size) @ h).reshape(x.shape)


def stored(x: Tensor, cache_type: str, which: str) -> Tensor:
    """Keys or values `[..., D]` (`which`: "k" or "v") as attention reads them back from a
    `cache_type` cache: rotated where llama.cpp rotates, stored, read and rotated back (the
    Hadamard matrix is its own inverse). In x's dtype."""
    size = rotation_size(x.shape[-1], which) if cache_type != "f16" else None
    y = rotate(x, size) if size else x
    y = round_trip(y, cache_type)
    return (rotate(y, size) if size else y).to(x.dtype)


def cache_bytes(cache_type: str, values: int) -> float:
    """Bytes that `values` cached numbers take as `cache_type` (scales included)."""
    return values * BYTES_PER_VALUE[cache_type]
