"""The window mixer's decode step over its ring buffer (`ops/window/ring_step.py`): the
Triton step against the PyTorch one in fp32 through Triton's interpreter where Triton is
installed (a subprocess: the interpreter is chosen when the kernel is defined), and the
PyTorch step's slot rule."""

import textwrap

import torch
from triton_interpreter import needs_triton, worst_error

from recurformer.ops.window.ring_step import ring_slot

CHECK = textwrap.dedent("""
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from recurformer.ops.window.ring_step import ring_step_torch, ring_step_triton
    torch.manual_seed(0)
    worst = 0.0
    # (rows, query heads, groups, head dim, window, sinks, tokens already seen per row): an
    # empty buffer, one filling, one wrapped many times, no sinks, sizes not powers of two
    for rows, H, G, D, window, sinks, seen in [(3, 4, 2, 8, 5, 2, [0, 3, 40]), (2, 6, 3, 12, 70, 4, [69, 200]),
                                               (1, 2, 1, 16, 9, 0, [23])]:
        slots = sinks + window
        keys, values = torch.randn(rows, slots, G, D), torch.randn(rows, slots, G, D)
        index = torch.full((rows, slots), -1)
        for r, count in enumerate(seen):
            for n in range(count):
                index[r, n if n < sinks else sinks + (n - sinks) % window] = n
        q, k, v = torch.randn(rows, H, D), torch.randn(rows, G, D), torch.randn(rows, G, D)
        ours = [t.clone() for t in (keys, values, index)]
        ref = ring_step_torch(q, k, v, keys, values, index, window, sinks, D**-0.5)
        out = ring_step_triton(q, k, v, *ours, window, sinks, D**-0.5)
        assert torch.equal(ours[2], index), "the index"
        for a, b in ((out, ref), (ours[0], keys), (ours[1], values)):
            worst = max(worst, float((a - b).norm() / b.norm()))
        # q and k rotated inside the kernels (one (cos, sin) row for the batch, or one per row),
        # against the PyTorch step given them rotated as transformers rotates them
        for cos_rows in (1, rows):
            cos, sin = torch.randn(cos_rows, D), torch.randn(cos_rows, D)
            turned_q, turned_k = apply_rotary_pos_emb(q, k, cos, sin)
            ours = [t.clone() for t in (keys, values, index)]
            theirs = [t.clone() for t in (keys, values, index)]
            ref = ring_step_torch(turned_q, turned_k, v, *theirs, window, sinks, D**-0.5)
            out = ring_step_triton(q, k, v, *ours, window, sinks, D**-0.5, (cos, sin))
            assert torch.equal(ours[2], theirs[2]), "the index"
            for a, b in ((out, ref), (ours[0], theirs[0]), (ours[1], theirs[1])):
                worst = max(worst, float((a - b).norm() / b.norm()))
    print(worst)
""")


@needs_triton
def test_the_triton_step_matches_the_pytorch_step_in_the_interpreter():
    assert worst_error(CHECK) <= 1e-5


def test_tokens_fill_the_sinks_then_go_round_the_window():
    assert ring_slot(torch.arange(12), window=4, sinks=2).tolist() == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 2, 3]


def test_the_pytorch_step_rotates_q_and_k_as_transformers_does():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from recurformer.ops.window.ring_step import ring_step_torch

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    cos, sin = torch.randn(2, 8), torch.randn(2, 8)
    states = [[torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8), torch.tensor([[0, 1, 2, -1, -1, -1]] * 2)]
              for _ in range(2)]
    states[1] = [t.clone() for t in states[0]]
    turned_q, turned_k = apply_rotary_pos_emb(q, k, cos, sin)
    expected = ring_step_torch(turned_q, turned_k, v, *states[0], 4, 2, 0.3)
    torch.testing.assert_close(ring_step_torch(q, k, v, *states[1], 4, 2, 0.3, (cos, sin)), expected)
    for ours, theirs in zip(states[1], states[0]):
        torch.testing.assert_close(ours, theirs)
