"""The chunked scan against the naive oracle: outputs, final state and every input gradient."""

import pytest
import torch
import torch.nn.functional as F

from recurformer.ops.selective_scan import (
    chunked,
    cuda_available,
    selective_scan,
    selective_scan_chunked,
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


def run_with_grads(scan, inputs, **kwargs):
    """(y, final state, gradients of a fixed random projection of both w.r.t. every input)."""
    leaves = {name: t.clone().requires_grad_(True) for name, t in inputs.items()}
    y, state = scan(**leaves, return_final_state=True, **kwargs)
    g = torch.Generator().manual_seed(1)
    loss = (y * torch.randn(y.shape, generator=g)).sum() + (state * torch.randn(state.shape, generator=g)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return y, state, dict(zip(leaves, grads))


def assert_matches(actual, reference, what, tol=1e-4):
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual.float() - reference.float()).abs().max().item() if reference.numel() else 0.0
    scale = max(1.0, reference.abs().max().item() if reference.numel() else 0.0)
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol} * {scale:.3g}"


def assert_same_scan(inputs, **kwargs):
    y_ref, state_ref, grads_ref = run_with_grads(selective_scan_naive, inputs)
    y, state, grads = run_with_grads(selective_scan_chunked, inputs, **kwargs)
    assert y.shape == y_ref.shape and state.shape == state_ref.shape
    assert_matches(y, y_ref, "y")
    assert_matches(state, state_ref, "final state")
    for name in inputs:
        assert_matches(grads[name], grads_ref[name], f"d/d{name}")


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


@pytest.mark.parametrize("backend", ["naive", "chunked", "auto"])
def test_dispatcher_runs_cpu_backends(backend):
    inputs = make_inputs(20, 8, 4)
    y = selective_scan(**inputs, backend=backend)
    assert_matches(y, selective_scan_naive(**inputs), f"backend={backend}")


def test_dispatcher_rejects_unknown_backend():
    with pytest.raises(ValueError, match="unknown scan backend 'triton'"):
        selective_scan(**make_inputs(4, 4, 2), backend="triton")


@pytest.mark.skipif(cuda_available(), reason="checks the error raised when CUDA / mamba-ssm are missing")
def test_cuda_backend_without_cuda_raises_clearly():
    inputs = make_inputs(4, 4, 2, extras=False)
    with pytest.raises(RuntimeError, match="backend='cuda' needs"):
        selective_scan(**inputs, backend="cuda")


def test_cuda_backend_refuses_initial_state():
    with pytest.raises(NotImplementedError, match="initial_state"):
        selective_scan_cuda(**make_inputs(4, 4, 2))
