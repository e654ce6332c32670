"""The chunked and compiled scans against the naive oracle: outputs, final state and every
input gradient."""

import pytest
import torch
import torch.nn.functional as F
from scan_checks import assert_matches, assert_scan_matches, run_with_grads

from recurformer.ops.selective_scan import (
    chunked,
    cuda_available,
    selective_scan,
    selective_scan_chunked,
    selective_scan_compiled,
    selective_scan_cuda,
    selective_scan_naive,
)


def make_inputs(length, channels, n_state, *, batch=2, extras=True, seed=0, delta_scale=1.0, a_min=-8.0):
    """Random scan inputs; `extras` adds D, the gate z and an initial state."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    inputs = {
        "u": randn(batch, length, channels),
        "delta": F.softplus(randn(batch, length, channels) - 1.0) * delta_scale,
        "A": a_min * torch.rand(channels, n_state, generator=g) - 0.01,
        "B": randn(batch, length, n_state),
        "C": randn(batch, length, n_state),
    }
    if extras:
        inputs.update(D=randn(channels), z=randn(batch, length, channels), initial_state=randn(batch, channels, n_state))
    return inputs


def assert_same_scan(inputs, **kwargs):
    """The chunked scan against the naive loop."""
    assert_scan_matches(selective_scan_naive, selective_scan_chunked, inputs, **kwargs)


@pytest.mark.parametrize("length", [1, 63, 257, 1024])
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "D-gate-state"])
def test_chunked_matches_naive(length, extras):
    channels, n_state = (8, 4) if length >= 1024 else (16, 8)
    assert_same_scan(make_inputs(length, channels, n_state, extras=extras))


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
@pytest.mark.parametrize("layout", ["one-block", "two-chunk-blocks", "sequential"])
def test_chunk_sizes_layouts_and_ragged_tails(chunk_size, layout, monkeypatch):
    batch, length, channels, n_state = 2, 100, 12, 6
    if layout == "two-chunk-blocks":  # states are also handed over between blocks
        monkeypatch.setattr(chunked, "_BLOCK_ELEMENTS", 2 * batch * n_state * channels * chunk_size)
    if layout == "sequential":  # one chunk per block, stepped directly
        monkeypatch.setattr(chunked, "_SEQUENTIAL_STEP", 1)
    assert_same_scan(make_inputs(length, channels, n_state, batch=batch), chunk_size=chunk_size)


def test_fast_decay_is_finite_and_exact():
    """delta up to 20 and A down to -50: decays down to exp(-1000) per step."""
    inputs = make_inputs(257, 12, 6, delta_scale=10.0, a_min=-50.0)
    assert inputs["delta"].max() > 15 and inputs["A"].min() < -45
    assert_same_scan(inputs)


def test_mixed_slow_and_fast_decay():
    """A few steps with delta = 20 among small ones (a state reset in some channels)."""
    inputs = make_inputs(300, 12, 6, seed=3, delta_scale=0.05, a_min=-50.0)
    inputs["delta"][0, [40, 41, 150, 151, 152, 260], 3] = 20.0
    assert_same_scan(inputs, chunk_size=32)


def test_output_dtype_follows_u():
    inputs = make_inputs(40, 8, 4)
    inputs["u"] = inputs["u"].to(torch.bfloat16)
    y, state = selective_scan_chunked(**inputs, return_final_state=True)
    y_ref, state_ref = selective_scan_naive(**inputs, return_final_state=True)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert_matches(state, state_ref, "final state")
    torch.testing.assert_close(y, y_ref, atol=2e-2, rtol=2e-2)


def test_bad_chunk_size_is_rejected():
    with pytest.raises(ValueError, match="chunk_size"):
        selective_scan_chunked(**make_inputs(8, 4, 2), chunk_size=0)


@pytest.mark.parametrize("backend", ["naive", "torch", "compiled", "auto"])
def test_dispatcher_runs_cpu_backends(backend, request):
    if backend == "compiled":
        request.getfixturevalue("compiled")
    inputs = make_inputs(20, 8, 4)
    y = selective_scan(**inputs, backend=backend)
    assert_matches(y, selective_scan_naive(**inputs), f"backend={backend}")


def test_dispatcher_rejects_unknown_backend():
    with pytest.raises(ValueError, match="unknown selective scan backend 'triton'"):
        selective_scan(**make_inputs(4, 4, 2), backend="triton")


@pytest.mark.skipif(cuda_available(), reason="checks the error raised when CUDA / mamba-ssm are missing")
def test_cuda_backend_without_cuda_raises_clearly():
    inputs = make_inputs(4, 4, 2, extras=False)
    with pytest.raises(RuntimeError, match="backend='cuda' needs"):
        selective_scan(**inputs, backend="cuda")


def test_cuda_backend_refuses_initial_state():
    with pytest.raises(NotImplementedError, match="initial_state"):
        selective_scan_cuda(**make_inputs(4, 4, 2))


# --------------------------------------------------------------------------- compiled kernel


def assert_compiled_matches(inputs, tol=1e-4, **kwargs):
    """The compiled scan against the naive loop: y, final state, every input gradient."""
    assert_scan_matches(selective_scan_naive, selective_scan_compiled, inputs, tol, dtypes=True, **kwargs)


@pytest.mark.parametrize("length", [1, 63, 257])
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "D-gate-state"])
def test_compiled_matches_naive(compiled, length, extras):
    """21 channels (a full and a partial vector of 16 lanes), 19 states (lane sums of
    a full and a partial group), batch 2."""
    assert_compiled_matches(make_inputs(length, 21, 19, extras=extras))


@pytest.mark.parametrize("chunk_size", [1, 5, 32, 300])
def test_compiled_chunk_sizes(compiled, chunk_size):
    """Saved states every 1, 5 or 32 steps (ragged last chunk), or only the first (300 > T)."""
    assert_compiled_matches(make_inputs(100, 12, 6, seed=2), chunk_size=chunk_size)


def test_compiled_stiff_decays(compiled):
    """delta up to 20 and A down to -50 (decays to exp(-1000)), and a few state resets."""
    inputs = make_inputs(257, 12, 6, delta_scale=10.0, a_min=-50.0)
    inputs["delta"][0, [40, 41, 150], 3] = 20.0
    assert_compiled_matches(inputs)


@pytest.mark.parametrize("extras", [False, True], ids=["plain", "D-gate-state"])
def test_compiled_bf16_inputs(compiled, extras):
    """bf16 u, delta, B, C, z, D (fp32 A and state): read as they are, computed in fp32.
    y and the gradients are rounded to bf16 (8 bits: ~4e-3 relative), so 1e-2 of the scale."""
    inputs = make_inputs(63, 21, 8, extras=extras)
    for name in ("u", "delta", "B", "C", "z", "D"):
        if name in inputs:
            inputs[name] = inputs[name].to(torch.bfloat16)
    assert_compiled_matches(inputs, tol=1e-2)


def test_compiled_empty_sequence(compiled):
    inputs = make_inputs(0, 8, 4)
    y, state = selective_scan_compiled(**inputs, return_final_state=True)
    assert y.shape == (2, 0, 8)
    assert torch.equal(state, inputs["initial_state"])


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (lambda i: i.update(B=i["B"][:, :, :3]), ValueError, r"selective_scan: B must have shape \[2, 8, 4\] \[B, T, N\], got \[2, 8, 3\]"),
        (lambda i: i.update(u=i["u"][0]), ValueError, "selective_scan: u must be a 3-d tensor"),
        (lambda i: i.update(initial_state=i["initial_state"].transpose(1, 2)), ValueError, "selective_scan: initial_state must have shape"),
        (lambda i: i.update(delta=i["delta"].double()), TypeError, "selective_scan: delta must be float32 or bfloat16, got torch.float64"),
        (lambda i: i.update(z=i["z"].to(torch.int32)), TypeError, "selective_scan: z must be float32 or bfloat16"),
        (lambda i: i.update(C=i["C"].to("meta")), ValueError, "selective_scan: C must be on the CPU"),
        (lambda i: i.update(D=[1.0] * 8), TypeError, "selective_scan: D must be a tensor, got list"),
    ],
    ids=["shape", "rank", "state-layout", "float64", "int", "device", "not-a-tensor"],
)
def test_compiled_rejects_bad_inputs_in_one_line(compiled, change, error, message):
    inputs = make_inputs(8, 8, 4)
    change(inputs)
    with pytest.raises(error, match=message) as raised:
        selective_scan_compiled(**inputs)
    assert "\n" not in str(raised.value)


def test_auto_picks_compiled_when_built(compiled):
    inputs = make_inputs(40, 8, 4)
    assert torch.equal(selective_scan(**inputs, backend="auto"), selective_scan_compiled(**inputs))


def test_auto_takes_the_torch_path_for_other_dtypes(compiled):
    """float64 is not a kernel dtype: auto runs the chunked scan instead of raising."""
    inputs = {k: v.double() for k, v in make_inputs(40, 8, 4).items()}
    assert torch.equal(selective_scan(**inputs, backend="auto"), selective_scan_chunked(**inputs))


def test_compiled_threads_and_determinism(compiled):
    """The forward pass is the same with 1 or 2 threads (no sums across work items); the
    backward pass, whose per-thread sums depend on the thread count, repeats exactly.
    (Large enough for the kernels to use threads.)"""
    inputs = make_inputs(400, 40, 16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1, _, _ = run_with_grads(selective_scan_compiled, inputs)
        torch.set_num_threads(2)
        y2, _, grads = run_with_grads(selective_scan_compiled, inputs)
        _, _, again = run_with_grads(selective_scan_compiled, inputs)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y1, y2)
    assert all(torch.equal(grads[name], again[name]) for name in grads)
