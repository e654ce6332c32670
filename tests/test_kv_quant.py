"""The KV cache formats of llama.cpp in PyTorch (`recurformer.kv_quant`): the q8_0 and q4_0 round
trips equal gguf-py's own quantize/dequantize bit for bit, the rotation leaves unquantized
attention unchanged, the bytes follow the block layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import GGMLQuantizationType, dequantize, quantize

from recurformer import kv_quant

GGML = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
QUANTIZE = {"q8_0": kv_quant.quantize_q8_0, "q4_0": kv_quant.quantize_q4_0}


def rows() -> torch.Tensor:
    """Rows of 128 values at several scales, with a block of zeros and blocks of one repeated
    value (where a rounding tie or a zero scale would show)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=generator) * torch.logspace(-3, 2, 64)[:, None]
    x[0, :32] = 0
    x[1, :32] = 0.5
    x[2, 32:64] = -3.0
    x[3] = torch.arange(128) / 4 - 16  # multiples of 1/4: exact products, halves among them
    return x


@pytest.mark.parametrize("cache_type", ["q8_0", "q4_0"])
def test_the_blocks_equal_gguf_pys_bit_for_bit(cache_type):
    x = rows()
    ours = kv_quant.block_bytes(cache_type, *QUANTIZE[cache_type](x)).numpy()
    theirs = quantize(x.numpy(), GGML[cache_type]).reshape(ours.shape)
    np.testing.assert_array_equal(ours, theirs)
    back = dequantize(theirs.reshape(x.shape[0], -1), GGML[cache_type])
    assert torch.equal(kv_quant.round_trip(x, cache_type), torch.from_numpy(back))


def test_the_rotation_leaves_unquantized_attention_unchanged():
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 40, 128, generator=generator) for _ in range(3))
    size = kv_quant.rotation_size(128, "k")
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    rotated = torch.nn.functional.scaled_dot_product_attention(kv_quant.rotate(q, size), kv_quant.rotate(k, size),
                                                               kv_quant.rotate(v, 64), is_causal=True)
    assert torch.allclose(kv_quant.rotate(rotated, 64), out, atol=1e-5)
    assert torch.allclose(kv_quant.rotate(kv_quant.rotate(k, size), size), k, atol=1e-6)


def test_the_rotation_sizes_are_the_pinned_builds():
    assert [kv_quant.rotation_size(d, "k") for d in (32, 64, 96, 128, 192, 256)] == [None, 64, None, 128, 64, 256]
    assert [kv_quant.rotation_size(d, "v") for d in (32, 64, 128, 256)] == [None, 64, 64, 64]


def test_a_rotated_quantized_cache_is_closer_for_rows_with_an_outlier():
    """What the rotation is for: one large value in a row spreads over the block."""
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(2))
    x[:, 5] *= 30
    plain = (kv_quant.round_trip(x, "q4_0") - x).pow(2).mean()
    rotated = (kv_quant.stored(x, "q4_0", "k") - x).pow(2).mean()
    assert rotated < 0.5 * plain


def test_bytes_follow_the_block_layout():
    assert kv_quant.cache_bytes("f16", 64) == 128
    assert kv_quant.cache_bytes("q8_0", 64) == 68
    assert kv_quant.cache_bytes("q4_0", 64) == 36
    scales, values = kv_quant.quantize_q4_0(torch.randn(3, 64))
    assert kv_quant.block_bytes("q4_0", scales, values).numel() == kv_quant.cache_bytes("q4_0", 3 * 64)


@pytest.mark.parametrize("cache_type, head_dim, message", [
    ("q5_1", 64, "unknown KV cache type 'q5_1': one of f16, q8_0, q4_0"),
    ("q8_0", 48, "a q8_0 cache stores blocks of 32 along the head dimension; the heads have 48"),
])
def test_a_cache_type_that_cannot_store_the_heads_is_named(cache_type, head_dim, message):
    with pytest.raises(ValueError, match=message):
        kv_quant.check_cache_type(cache_type, head_dim)


# the models the formats can block: head size 64
WIDE = dict(num_hidden_layers=3, hidden_size=256, intermediate_size=384)


@pytest.mark.parametrize("cache_type", ["q8_0", "q4_0"])
@pytest.mark.parametrize("kind", ["window+mamba2", "window"])
def test_a_conversions_stored_kv_decodes_as_its_whole_sequence_forward(kind, cache_type):
    """Decode steps (each token's key and value stored once, into the kept heads' cache and the
    window's ring) give the logits of one forward over the whole sequence: both store the same
    values. A rounding that lands on the other side of a q4_0 step changes a value by a whole
    step, so the bound is 1e-2 (measured: 1.4e-6 to 2.5e-3)."""
    from test_engine import greedy_generation
    from tiny_models import MIXERS, mixed_layout, open_gates, tiny_model

    from recurformer.stored_kv import store_kv_as
    from recurformer.surgery import convert

    model = tiny_model("llama", **WIDE)
    converted = store_kv_as(open_gates(convert(model, mixed_layout(model), MIXERS[kind])).eval(), cache_type)
    prompt = torch.randint(0, 97, (1, 100), generator=torch.Generator().manual_seed(0))
    tokens, steps = greedy_generation(converted, prompt, 20)
    with torch.no_grad():
        forward = converted(torch.cat([prompt, torch.tensor([tokens])], 1)).logits[0, 99:119].numpy()
        unquantized = store_kv_as(converted, None)(prompt).logits[0, -1].numpy()
    assert np.abs(steps - forward).max() / np.abs(forward).max() < 1e-2
    assert np.abs(forward[0] - unquantized).max() > 1e-3  # the cache type changed something


def test_an_original_models_stored_cache_keeps_llamas_key_order():
    """For the `llama` architecture llama.cpp's key rows hold transformers' dimensions
    interleaved (i, i + D/2, ...), so a block of 32 holds other numbers than in transformers'
    order; the cache quantizes them in llama.cpp's order."""
    from tiny_models import tiny_model

    from recurformer.cache import CACHE_ARGUMENT
    from recurformer.stored_kv import StoredKVCache, interleaved

    assert interleaved(8).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    model = tiny_model("llama", **WIDE)
    prompt = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        as_llama = model(prompt, **{CACHE_ARGUMENT: StoredKVCache("q4_0", "llama")}).logits
        as_qwen2 = model(prompt, **{CACHE_ARGUMENT: StoredKVCache("q4_0", "qwen2")}).logits
    assert not torch.allclose(as_llama, as_qwen2, atol=1e-4)


def test_a_head_size_a_cache_type_cannot_block_is_refused():
    from tiny_models import MIXERS, mixed_layout, tiny_model

    from recurformer.stored_kv import store_kv_as
    from recurformer.surgery import convert

    model = tiny_model("llama", num_hidden_layers=3)  # head size 12
    with pytest.raises(ValueError, match="the heads have 12"):
        store_kv_as(convert(model, mixed_layout(model), MIXERS["window"]), "q8_0")
