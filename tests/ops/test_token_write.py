"""A static decode step's key and value written into the kept heads' buffers
(`ops/token_write.py`): the PyTorch write against transformers' RoPE and `index_copy_`, and
the Triton write against the PyTorch one through Triton's interpreter where Triton is
installed (a subprocess: the interpreter is chosen when the kernel is defined)."""

import textwrap

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from triton_interpreter import needs_triton, worst_error

from recurformer.ops.token_write import write_token

CHECK = textwrap.dedent("""
    import torch
    from recurformer.ops.token_write import write_token_torch, write_token_triton
    torch.manual_seed(0)
    worst = 0.0
    # (rows, groups, slots, head dim, slot written, rows of (cos, sin) or None): a head dim that
    # is not a power of two, the first and the last slot, no rotation
    for b, g, c, d, slot, cos_rows in [(2, 3, 10, 12, 4, 2), (1, 1, 5, 16, 0, 1), (3, 2, 7, 8, 6, 1),
                                       (2, 2, 4, 8, 1, None)]:
        k, v = torch.randn(b, g, d), torch.randn(b, g, d)
        rotary = None if cos_rows is None else (torch.randn(cos_rows, d), torch.randn(cos_rows, d))
        buffers = [torch.randn(b, g, c, d) for _ in range(2)]
        theirs = [t.clone() for t in buffers]
        length = torch.tensor([slot])
        write_token_torch(*theirs, k, v, length, rotary)
        write_token_triton(*buffers, k, v, length, rotary)
        for a, r in zip(buffers, theirs):
            worst = max(worst, float((a - r).norm() / r.norm()))
    print(worst)
""")


@needs_triton
def test_the_triton_write_matches_the_pytorch_write_in_the_interpreter():
    assert worst_error(CHECK) <= 1e-6


def test_the_key_is_rotated_as_transformers_rotates_it_and_written_at_the_slot():
    torch.manual_seed(0)
    k, v = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    cos, sin = torch.randn(2, 8), torch.randn(2, 8)
    keys, values = torch.zeros(2, 3, 5, 8), torch.zeros(2, 3, 5, 8)
    write_token(keys, values, k, v, torch.tensor([3]), (cos, sin))
    turned, _ = apply_rotary_pos_emb(k, k, cos, sin)
    torch.testing.assert_close(keys[:, :, 3], turned)
    torch.testing.assert_close(values[:, :, 3], v)
    assert not keys[:, :, [0, 1, 2, 4]].any() and not values[:, :, [0, 1, 2, 4]].any()
