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
    print(worst)
""")


@needs_triton
def test_the_triton_step_matches_the_pytorch_step_in_the_interpreter():
    assert worst_error(CHECK) <= 1e-5


def test_tokens_fill_the_sinks_then_go_round_the_window():
    assert ring_slot(torch.arange(12), window=4, sinks=2).tolist() == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 2, 3]
