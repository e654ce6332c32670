"""What the selective-scan and SSD tests share: a scan's outputs with the gradient of every
input, and the check of one scan against its naive oracle."""

import torch


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


def assert_scan_matches(reference, scan, inputs, tol=1e-4, dtypes=False, **kwargs):
    """`scan` against `reference` (the naive loop): y, final state and every input's gradient
    within `tol` of the scale; with `dtypes`, also y in the reference's dtype, an fp32 state
    and each gradient in its input's dtype (the compiled kernels' contract)."""
    y_ref, state_ref, grads_ref = run_with_grads(reference, inputs)
    y, state, grads = run_with_grads(scan, inputs, **kwargs)
    assert y.shape == y_ref.shape and state.shape == state_ref.shape
    if dtypes:
        assert y.dtype == y_ref.dtype and state.dtype == torch.float32
        assert all(grads[name].dtype == inputs[name].dtype for name in inputs)
    assert_matches(y, y_ref, "y", tol)
    assert_matches(state, state_ref, "final state", tol)
    for name in inputs:
        assert_matches(grads[name], grads_ref[name], f"d/d{name}", tol)
