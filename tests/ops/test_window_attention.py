"""Windowed attention: the blockwise PyTorch path and the compiled kernel against the naive
oracle (outputs and the gradients of q, k, v and the past's keys and values), at awkward
lengths, with GQA, left and inner padding, windows longer than the sequence, no sinks, a
starting ring buffer, and bf16 inputs."""

import pytest
import torch
from operator_calls import operator_calls

from recurformer.ops import kernels
from recurformer.ops.window import (
    token_positions,
    visible,
    window_attention,
    window_attention_blockwise,
    window_attention_compiled,
    window_attention_naive,
)

FAST = {"torch": window_attention_blockwise, "compiled": window_attention_compiled}


@pytest.fixture(params=sorted(FAST))
def backend(request):
    """Each fast backend; `compiled` only where the kernels build (the `compiled` fixture)."""
    if request.param == "compiled":
        request.getfixturevalue("compiled")
    return FAST[request.param]


def make_inputs(length, heads=4, groups=2, dim=8, batch=2, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, heads, dim, generator=g)
    k, v = (torch.randn(batch, length, groups, dim, generator=g) for _ in range(2))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def ring_buffer(earlier, window, sinks, groups=2, dim=8, seed=1, dtype=torch.float32):
    """The buffer a window mixer holds after `earlier[b]` real tokens in row b: keys, values
    `[B, sinks + window, G, D]` and the position of each slot's token (-1: empty)."""
    g = torch.Generator().manual_seed(seed)
    slots = sinks + window
    index = torch.full((len(earlier), slots), -1)
    for row, count in enumerate(earlier):
        for position in range(count):
            index[row, position if position < sinks else sinks + (position - sinks) % window] = position
    keys, values = (torch.randn(len(earlier), slots, groups, dim, generator=g).to(dtype) for _ in range(2))
    return keys, values, index


def run_with_grads(attention, q, k, v, window, sinks, mask=None, past=None):
    """(output, gradients of a fixed random projection of it w.r.t. q, k, v and the past's keys and values)."""
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    if past is not None:
        leaves += [t.clone().requires_grad_(True) for t in past[:2]]
        past = (leaves[3], leaves[4], past[2])
    out = attention(*leaves[:3], window, sinks, 0.3, mask, past)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((out.float() * weights).sum(), leaves)
    return out, grads


def assert_matches(actual, reference, what, tol):
    """Max abs error within `tol` of the reference's scale (at least 1)."""
    assert actual.dtype == reference.dtype, f"{what}: dtype {actual.dtype}, expected {reference.dtype}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual.float() - reference.float()).abs().max().item() if reference.numel() else 0.0
    scale = max(1.0, reference.abs().max().item() if reference.numel() else 0.0)
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol} * {scale:.3g}"


def assert_same(attention, inputs, window, sinks, mask=None, past=None, tol=1e-5):
    out_ref, grads_ref = run_with_grads(window_attention_naive, *inputs, window, sinks, mask, past)
    out, grads = run_with_grads(attention, *inputs, window, sinks, mask, past)
    assert out.shape == out_ref.shape
    assert_matches(out, out_ref, "output", tol)
    for name, grad, grad_ref in zip(("q", "k", "v", "past keys", "past values"), grads, grads_ref):
        assert_matches(grad, grad_ref, f"d/d {name}", tol)


def test_visible_is_the_window_mixer_rule():
    """Query 7 with window 3 and 2 sinks sees 0, 1 (sinks) and 5, 6, 7; query 1 sees 0, 1."""
    keys = torch.arange(10)
    assert visible(torch.tensor(7), keys, 3, 2).tolist() == [True, True, False, False, False, True, True, True, False, False]
    assert visible(torch.tensor(1), keys, 3, 2).tolist() == [True, True] + [False] * 8
    assert not visible(torch.tensor(-1), keys, 3, 2).any()  # a padding query sees nothing
    assert not visible(torch.tensor(5), torch.tensor(-1), 3, 2)  # nor is a padding key seen


def test_positions_skip_padding_and_continue_after_the_past():
    mask = torch.tensor([[0, 0, 1, 1], [1, 0, 1, 1]])
    index = torch.tensor([[-1, -1], [4, 3]])
    assert token_positions(mask, index, 2, 4).tolist() == [[-1, -1, 0, 1], [5, -1, 6, 7]]
    assert token_positions(None, None, 1, 3).tolist() == [[0, 1, 2]]


def test_naive_is_a_plain_masked_softmax():
    """One row, one head, written out: query 3 with window 2 and 1 sink sees keys 0, 2, 3."""
    q, k, v = make_inputs(5, heads=1, groups=1, batch=1)
    out = window_attention_naive(q, k, v, 2, 1, scale=0.5)
    scores = torch.stack([q[0, 3, 0] @ k[0, j, 0] * 0.5 for j in (0, 2, 3)])
    expected = scores.softmax(0) @ v[0, [0, 2, 3], 0]
    torch.testing.assert_close(out[0, 3, 0], expected)


@pytest.mark.parametrize("length", [1, 63, 257])
@pytest.mark.parametrize("window, sinks", [(16, 2), (7, 0), (1, 3), (300, 4)], ids=["w16s2", "no-sinks", "w1s3", "longer"])
def test_matches_naive(backend, length, window, sinks):
    assert_same(backend, make_inputs(length), window, sinks)


@pytest.mark.parametrize("heads, groups, dim", [(3, 3, 8), (6, 2, 20), (9, 3, 64), (2, 1, 128)],
                         ids=["mha", "gqa-odd-dim", "smollm2", "wide"])
def test_head_shapes(backend, heads, groups, dim):
    """One to three query heads per KV head; head sizes that are not a whole vector (20),
    and more than four vectors (128)."""
    assert_same(backend, make_inputs(150, heads, groups, dim, seed=3), 41, 4)


def test_left_padding(backend):
    """Rows of 257, 200, 1 and 0 real tokens, padded on the left."""
    mask = torch.ones(4, 257, dtype=torch.long)
    mask[1, :57] = 0
    mask[2, :256] = 0
    mask[3] = 0
    assert_same(backend, make_inputs(257, batch=4, seed=4), 20, 3, mask=mask)


def test_padding_anywhere(backend):
    """Padding inside a row and at its end: the real tokens are numbered in order."""
    mask = torch.ones(2, 90, dtype=torch.bool)
    mask[0, 10:30] = False
    mask[0, 70:] = False
    mask[1, ::3] = False
    assert_same(backend, make_inputs(90, seed=5), 12, 2, mask=mask)


@pytest.mark.parametrize("length", [1, 63, 257])
def test_starting_ring_buffer(backend, length):
    """A buffer after 3, 40 and 0 earlier tokens (one not yet full, one wrapped, one empty),
    then a call with left padding."""
    window, sinks = 16, 2
    past = ring_buffer([3, 40, 0], window, sinks)
    mask = torch.ones(3, length, dtype=torch.long)
    mask[0, : length // 2] = 0
    assert_same(backend, make_inputs(length, batch=3, seed=6), window, sinks, mask=mask, past=past)


def test_ring_buffer_without_sinks(backend):
    assert_same(backend, make_inputs(70, seed=7), 9, 0, past=ring_buffer([50, 5], 9, 0))


def test_padding_queries_give_zeros(backend):
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    out = backend(*make_inputs(5), 3, 1, None, mask)
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2]))
    assert out[0, 2:].abs().sum() > 0


def test_empty_sequence(backend):
    out = backend(*make_inputs(0), 4, 1)
    assert out.shape == (2, 0, 4, 8)


def test_bf16_inputs(backend):
    """bf16 q, k, v and past: the oracle computes in fp32 from the same bf16 values; outputs
    and gradients are rounded to bf16 (~4e-3 relative) and the torch path's SDPA also
    computes in bf16, so 2e-2 of the scale."""
    inputs = make_inputs(257, 9, 3, 64, seed=8, dtype=torch.bfloat16)
    past = ring_buffer([30, 200], 40, 4, groups=3, dim=64, dtype=torch.bfloat16)
    assert_same(backend, inputs, 40, 4, past=past, tol=2e-2)


def test_compiled_bf16_is_close_to_fp32(compiled):
    """The kernel's arithmetic is fp32 for bf16 inputs: its output is the fp32 result of the
    same values, rounded once (within 1e-2 relative; a bf16 score would be ~3x worse)."""
    q, k, v = make_inputs(257, 9, 3, 64, seed=9, dtype=torch.bfloat16)
    out = window_attention_compiled(q, k, v, 141, 4)
    exact = window_attention_naive(q.float(), k.float(), v.float(), 141, 4)
    assert_matches(out.float(), exact, "output", 1e-2)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (lambda i: i.update(k=i["k"][:, :, :1].expand(-1, -1, 3, -1)), ValueError, "4 query heads cannot share 3"),
        (lambda i: i.update(v=i["v"][:, :5]), ValueError, r"v must have shape \[2, 8, 2, 8\] \[B, T, G, D\], got \[2, 5, 2, 8\]"),
        (lambda i: i.update(q=i["q"][0]), ValueError, "q must be a 4-d tensor"),
        (lambda i: i.update(q=i["q"].double()), TypeError, "q must be float32 or bfloat16, got torch.float64"),
        (lambda i: i.update(window=0), ValueError, "window must be an integer >= 1, got 0"),
        (lambda i: i.update(sinks=-1), ValueError, "sinks must be an integer >= 0, got -1"),
        (lambda i: i.update(mask=torch.ones(2, 7)), ValueError, r"mask must have shape \[2, 8\]"),
        (lambda i: i.update(past=(torch.zeros(2, 3, 2, 8), torch.zeros(2, 3, 2, 8), torch.zeros(2, 4, dtype=torch.long))),
         ValueError, r"past index must be an integer tensor of shape \[2, 3\]"),
    ],
    ids=["groups", "shape", "rank", "float64", "window", "sinks", "mask", "past-index"],
)
def test_compiled_rejects_bad_inputs_in_one_line(compiled, change, error, message):
    q, k, v = make_inputs(8)
    inputs = {"q": q, "k": k, "v": v, "window": 4, "sinks": 1, "mask": None, "past": None}
    change(inputs)
    with pytest.raises(error, match=f"window_attention: {message}") as raised:
        window_attention_compiled(**inputs)
    assert "\n" not in str(raised.value)


def test_auto_picks_compiled_when_built(compiled):
    inputs = make_inputs(100)
    assert torch.equal(window_attention(*inputs, 10, 2, backend="auto"), window_attention_compiled(*inputs, 10, 2))


def test_auto_runs_the_torch_path_when_kernels_are_off(monkeypatch):
    monkeypatch.setenv(kernels.ENV, "torch")
    kernels.reset()
    try:
        inputs = make_inputs(100)
        assert torch.equal(window_attention(*inputs, 10, 2), window_attention_blockwise(*inputs, 10, 2))
        with pytest.raises(RuntimeError, match="window_attention: backend='compiled' is unavailable"):
            window_attention(*inputs, 10, 2, backend="compiled")
    finally:
        monkeypatch.delenv(kernels.ENV)
        kernels.reset()


def test_dispatcher_rejects_unknown_backend():
    with pytest.raises(ValueError, match="unknown window attention backend 'fast'; choose one of auto, naive, torch, compiled, cuda"):
        window_attention(*make_inputs(4), 2, 0, backend="fast")


def test_compiled_threads_and_determinism(compiled):
    """The forward pass is the same with 1 or 2 threads (no sums across work items); the
    backward pass, whose per-thread sums depend on the thread count, repeats exactly.
    (Large enough for the kernel to use threads.)"""
    inputs = make_inputs(600, 6, 2, 32, seed=10)
    past = ring_buffer([100, 7], 50, 4, groups=2, dim=32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        out1, _ = run_with_grads(window_attention_compiled, *inputs, 50, 4, None, past)
        torch.set_num_threads(2)
        out2, grads = run_with_grads(window_attention_compiled, *inputs, 50, 4, None, past)
        _, again = run_with_grads(window_attention_compiled, *inputs, 50, 4, None, past)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out1, out2)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))


@pytest.mark.parametrize("length", [1, 23, 24, 25, 300])
def test_every_length_against_the_window(length):
    """Lengths below, at and past one block of `window` queries, and a ragged last block,
    with a ring buffer, sinks and left padding."""
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :length // 4] = 0
    assert_same(window_attention_blockwise, make_inputs(length, seed=7), 24, 3, mask=mask,
                past=ring_buffer([40, 5], 24, 3))


def test_the_operations_do_not_grow_with_the_length():
    """One SDPA call for all blocks: on a GPU every operation is a kernel launch."""
    def calls(length):
        return operator_calls(window_attention_blockwise, *make_inputs(length, seed=1), 8, 2)

    assert calls(2048) == calls(64)
