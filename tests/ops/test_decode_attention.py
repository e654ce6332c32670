"""The split-key decode attention (`ops/decode_attention`) against SDPA: on the CPU through
Triton's interpreter where Triton is installed (a subprocess: the interpreter is chosen when
the kernel is defined), on a GPU in fp32 and bf16 (tests/test_device.py, marked cuda)."""

import textwrap

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from triton_interpreter import needs_triton, worst_error

from recurformer.ops.decode_attention import decode_attention

CHECK = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from recurformer.ops.decode_attention import split_decode_attention
    torch.manual_seed(0)
    worst = 0.0
    # (rows, groups, queries per group, slots, head dim, splits): uneven splits, a split with
    # no visible key, one query, a head dim that is not a power of two
    for b, g, q, c, d, splits in [(1, 2, 4, 300, 12, None), (2, 3, 1, 129, 64, 3), (2, 1, 7, 64, 16, 1),
                                  (1, 4, 4, 1000, 128, 7), (2, 2, 3, 640, 32, 10)]:
        query, keys, values = torch.randn(b, g, q, d), torch.randn(b, g, c, d), torch.randn(b, g, c, d)
        slots = torch.arange(c)
        starts = torch.tensor([0, c // 2])[:b, None]  # the second row sees nothing in the first half
        seen = ((slots >= starts) & (slots < c - 5))[:, None, None, :]
        out = split_decode_attention(query, keys, values, seen, d**-0.5, splits=splits)
        ref = F.scaled_dot_product_attention(query, keys, values, attn_mask=seen, scale=d**-0.5)
        worst = max(worst, float((out - ref).norm() / ref.norm()))
        # the query rotated inside the kernel, by one (cos, sin) row for the batch or one per row,
        # as transformers rotates it before attention
        for rows in (1, b):
            cos, sin = torch.randn(rows, d), torch.randn(rows, d)
            turned, _ = apply_rotary_pos_emb(query, query, cos[:, None], sin[:, None])
            out = split_decode_attention(query, keys, values, seen, d**-0.5, (cos, sin), splits=splits)
            ref = F.scaled_dot_product_attention(turned, keys, values, attn_mask=seen, scale=d**-0.5)
            worst = max(worst, float((out - ref).norm() / ref.norm()))
    print(worst)
""")


@needs_triton
def test_the_split_kernel_matches_sdpa_in_the_interpreter():
    assert worst_error(CHECK) <= 1e-5


def test_off_the_gpu_it_is_sdpa():
    query, keys, values = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 20, 8), torch.randn(2, 2, 20, 8)
    seen = (torch.arange(20) < torch.tensor([[12], [20]]))[:, None, None, :]
    expected = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=seen, scale=0.3)
    torch.testing.assert_close(decode_attention(query, keys, values, seen, 0.3), expected)


def test_off_the_gpu_a_query_to_rotate_is_rotated_as_transformers_rotates_it():
    query, keys, values = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 20, 8), torch.randn(2, 2, 20, 8)
    seen = torch.ones(2, 1, 1, 20, dtype=torch.bool)
    cos, sin = torch.randn(2, 8), torch.randn(2, 8)
    turned, _ = apply_rotary_pos_emb(query, query, cos[:, None], sin[:, None])
    expected = torch.nn.functional.scaled_dot_product_attention(turned, keys, values, attn_mask=seen, scale=0.3)
    torch.testing.assert_close(decode_attention(query, keys, values, seen, 0.3, (cos, sin)), expected)
