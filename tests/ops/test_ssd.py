"""The chunked and compiled SSD against the naive oracle: outputs, final state and every
input gradient."""

import pytest
import torch
import torch.nn.functional as F
from operator_calls import operator_calls
from scan_checks import assert_matches, assert_scan_matches, run_with_grads

from recurformer.ops.ssd import (
    cuda_available,
    ssd,
    ssd_chunked,
    ssd_compiled,
    ssd_cuda,
    ssd_naive,
)
from recurformer.ops.ssd.chunked import linear_recurrence


def make_inputs(length, heads=4, head_dim=8, n_state=6, *, groups=2, batch=2, extras=True, seed=0,
                dt_scale=1.0, a_max=8.0):
    """Random SSD inputs: B shared by `groups` groups of heads, C per head; `extras` adds D
    and an initial state."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    inputs = {
        "x": randn(batch, length, heads, head_dim),
        "dt": F.softplus(randn(batch, length, heads) - 1.0) * dt_scale,
        "A": -(a_max * torch.rand(heads, generator=g) + 0.01),
        "B": randn(batch, length, groups, n_state),
        "C": randn(batch, length, heads, n_state),
    }
    if extras:
        inputs.update(D=randn(heads), initial_state=randn(batch, heads, head_dim, n_state))
    return inputs


def assert_same_scan(inputs, **kwargs):
    """The chunked scan against the naive loop."""
    assert_scan_matches(ssd_naive, ssd_chunked, inputs, **kwargs)


@pytest.mark.parametrize("length", [1, 63, 257, 1024])
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "D-state"])
def test_chunked_matches_naive(length, extras):
    assert_same_scan(make_inputs(length, extras=extras))


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64, 100])
def test_chunk_sizes_and_ragged_tails(chunk_size):
    """100 steps: chunks of 5 and 100 divide it, 16 and 64 leave a ragged tail, 1 is the recurrence."""
    assert_same_scan(make_inputs(100, seed=2), chunk_size=chunk_size)


@pytest.mark.parametrize("groups", [1, 4], ids=["one-group", "per-head"])
def test_b_shared_by_all_heads_or_per_head(groups):
    assert_same_scan(make_inputs(70, groups=groups, seed=4), chunk_size=16)


def test_stiff_decays_are_finite_and_exact():
    """dt up to ~20 and A down to -50: per-step decays down to exp(-1000), chunk sums
    of the exponents far below anything exp can represent."""
    inputs = make_inputs(257, dt_scale=10.0)
    inputs["A"] = torch.tensor([-0.5, -5.0, -20.0, -50.0])
    assert inputs["dt"].max() > 15
    assert_same_scan(inputs)


def test_mixed_slow_and_fast_decay():
    """A few steps with dt * A = -2000 among ones of about -0.01 (a state reset), and zero
    steps (padding: the state passes unchanged). Decay factors taken as differences of
    prefix sums of the exponents would lose about 1e-4 of their value after such a step."""
    inputs = make_inputs(300, seed=3, dt_scale=0.05)
    inputs["A"] = torch.tensor([-0.5, -1.0, -20.0, -1.0])
    inputs["dt"][0, [40, 41, 150, 151, 152, 260], 1] = 2000.0
    inputs["dt"][1, :30] = 0.0
    assert_same_scan(inputs, chunk_size=32)


def test_output_dtype_follows_x():
    inputs = make_inputs(40)
    inputs["x"] = inputs["x"].to(torch.bfloat16)
    y, state = ssd_chunked(**inputs, return_final_state=True)
    y_ref, state_ref = ssd_naive(**inputs, return_final_state=True)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert_matches(state, state_ref, "final state")
    torch.testing.assert_close(y, y_ref, atol=2e-2, rtol=2e-2)


def test_empty_sequence_returns_the_initial_state():
    inputs = make_inputs(0)
    y, state = ssd_chunked(**inputs, return_final_state=True)
    assert y.shape == (2, 0, 4, 8)
    assert torch.equal(state, inputs["initial_state"])


def test_bad_chunk_size_is_rejected():
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_chunked(**make_inputs(8), chunk_size=0)


def test_heads_not_divisible_by_groups_are_rejected():
    with pytest.raises(ValueError, match="4 heads cannot share 3 groups"):
        ssd_chunked(**make_inputs(8, groups=3))


@pytest.mark.parametrize("backend", ["naive", "torch", "compiled", "auto"])
def test_dispatcher_runs_cpu_backends(backend, request):
    if backend == "compiled":
        request.getfixturevalue("compiled")
    inputs = make_inputs(20)
    y = ssd(**inputs, backend=backend, chunk_size=8)
    assert_matches(y, ssd_naive(**inputs), f"backend={backend}")


def test_dispatcher_rejects_unknown_backend():
    with pytest.raises(ValueError, match="unknown ssd backend 'triton'"):
        ssd(**make_inputs(4), backend="triton")


@pytest.mark.skipif(cuda_available(), reason="checks the error raised when CUDA / mamba-ssm are missing")
def test_cuda_backend_without_cuda_raises_clearly():
    with pytest.raises(RuntimeError, match="backend='cuda' needs"):
        ssd_cuda(**make_inputs(4))


# --------------------------------------------------------------------------- compiled kernel


def assert_compiled_matches(inputs, tol=1e-4, **kwargs):
    """The compiled SSD against the naive loop: y, final state, every input gradient."""
    assert_scan_matches(ssd_naive, ssd_compiled, inputs, tol, dtypes=True, **kwargs)


@pytest.mark.parametrize("length", [1, 63, 257])
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "D-state"])
def test_compiled_matches_naive(compiled, length, extras):
    """Head dim 21 (a full and a partial vector of 16 rows), 19 states (lane sums of a
    full and a partial group), batch 2, chunks of 16 (ragged tails)."""
    assert_compiled_matches(make_inputs(length, head_dim=21, n_state=19, extras=extras), chunk_size=16)


@pytest.mark.parametrize("head_dim", [5, 40, 64, 80])
def test_compiled_head_sizes(compiled, head_dim):
    """One partial vector, 3 vectors (one partial), 4 full ones, and two work items per head."""
    assert_compiled_matches(make_inputs(70, head_dim=head_dim, seed=1), chunk_size=32)


@pytest.mark.parametrize("groups", [1, 4], ids=["one-group", "per-head"])
def test_compiled_b_shared_by_all_heads_or_per_head(compiled, groups):
    inputs = make_inputs(70, groups=groups, seed=4)
    inputs["C"] = inputs["C"][:, :, :2].contiguous()  # C in 2 groups, B in `groups`
    assert_compiled_matches(inputs, chunk_size=16)


def test_compiled_stiff_and_padding_steps(compiled):
    """Steps with dt A = -2000 among ones of about -0.01, and zero (padding) steps."""
    inputs = make_inputs(300, seed=3, dt_scale=0.05)
    inputs["A"] = torch.tensor([-0.5, -1.0, -20.0, -1.0])
    inputs["dt"][0, [40, 41, 150, 151, 152, 260], 1] = 2000.0
    inputs["dt"][1, :30] = 0.0
    assert_compiled_matches(inputs, chunk_size=32)


def test_compiled_bf16_inputs(compiled):
    """bf16 x, dt, B, C, D (fp32 A and state), computed in fp32; y and the gradients are
    rounded to bf16 (~4e-3 relative), so 1e-2 of the scale."""
    inputs = make_inputs(63, head_dim=21)
    for name in ("x", "dt", "B", "C", "D"):
        inputs[name] = inputs[name].to(torch.bfloat16)
    assert_compiled_matches(inputs, tol=1e-2, chunk_size=16)


def test_compiled_empty_sequence(compiled):
    inputs = make_inputs(0)
    y, state = ssd_compiled(**inputs, return_final_state=True)
    assert y.shape == (2, 0, 4, 8)
    assert torch.equal(state, inputs["initial_state"])


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (lambda i: i.update(dt=i["dt"][:, :, :3]), ValueError, r"ssd: dt must have shape \[2, 8, 4\] \[B, T, H\], got \[2, 8, 3\]"),
        (lambda i: i.update(B=i["B"][:, :, :, :5]), ValueError, r"ssd: C must have shape \[2, 8, 4, 5\]"),
        (lambda i: i.update(x=i["x"][0]), ValueError, "ssd: x must be a 4-d tensor"),
        (lambda i: i.update(B=i["B"][:, :, :1].expand(-1, -1, 3, -1)), ValueError, "ssd: 4 heads cannot share 3 groups evenly"),
        (lambda i: i.update(A=i["A"].double()), TypeError, "ssd: A must be float32 or bfloat16, got torch.float64"),
        (lambda i: i.update(initial_state=i["initial_state"].to("meta")), ValueError, "ssd: initial_state must be on the CPU"),
    ],
    ids=["shape", "state-size", "rank", "groups", "float64", "device"],
)
def test_compiled_rejects_bad_inputs_in_one_line(compiled, change, error, message):
    inputs = make_inputs(8)
    change(inputs)
    with pytest.raises(error, match=message) as raised:
        ssd_compiled(**inputs)
    assert "\n" not in str(raised.value)


def test_auto_picks_compiled_when_built(compiled):
    inputs = make_inputs(40)
    assert torch.equal(ssd(**inputs, backend="auto"), ssd_compiled(**inputs))


def test_compiled_threads_and_determinism(compiled):
    """The forward pass is the same with 1 or 2 threads (no sums across work items); the
    backward pass, whose per-thread sums depend on the thread count, repeats exactly.
    (Large enough for the kernels to use threads.)"""
    inputs = make_inputs(100, heads=6, head_dim=32, n_state=16, groups=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1, _, _ = run_with_grads(ssd_compiled, inputs, chunk_size=16)
        torch.set_num_threads(2)
        y2, _, grads = run_with_grads(ssd_compiled, inputs, chunk_size=16)
        _, _, again = run_with_grads(ssd_compiled, inputs, chunk_size=16)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y1, y2)
    assert all(torch.equal(grads[name], again[name]) for name in grads)


@pytest.mark.parametrize("length, block", [(1, 4), (4, 4), (5, 4), (100, 4), (300, 32)])
def test_linear_recurrence_matches_its_loop(length, block):
    """h_i = exp(e_i) h_{i-1} + x_i solved in blocks (here up to four levels of them) against
    the loop, with stiff decays among slow ones; gradients too."""
    g = torch.Generator().manual_seed(length)
    exponents = -torch.rand(2, 3, length, generator=g, dtype=torch.float64) * 0.2
    exponents[0, 1, ::7] = -500.0  # resets
    inputs = torch.randn(2, 3, length, 5, generator=g, dtype=torch.float64)
    exponents.requires_grad_(), inputs.requires_grad_()
    h, expected = linear_recurrence(exponents, inputs, block), []
    for i in range(length):
        previous = expected[-1] * torch.exp(exponents[:, :, i, None]) if expected else 0
        expected.append(previous + inputs[:, :, i])
    expected = torch.stack(expected, dim=2)
    torch.testing.assert_close(h, expected, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(h)
    got = torch.autograd.grad((h * weights).sum(), (exponents, inputs), materialize_grads=True)
    want = torch.autograd.grad((expected * weights).sum(), (exponents, inputs), materialize_grads=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_the_chunked_scan_does_not_loop_over_chunks():
    """Passing the state from chunk to chunk costs a few operators per level of blocks, not
    a few per chunk: on a GPU each is a kernel launch (a 32K prefill has 512 chunks a layer)."""
    def calls(length):
        inputs = make_inputs(length, heads=2, head_dim=2, n_state=2, groups=1, batch=1)
        return operator_calls(ssd_chunked, **inputs, chunk_size=1)

    assert calls(4096) - calls(16) < 100  # 4,080 more chunks; a loop adds several calls for each
