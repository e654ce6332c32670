"""The compiled decode steps against their PyTorch twins: outputs and both states, token
after token, in fp32 and bf16; the dispatcher; one-line errors for bad arguments."""

import pytest
import torch

from recurformer.ops.step import (
    mamba2_step,
    mamba2_step_compiled,
    mamba2_step_naive,
    mamba_step,
    mamba_step_compiled,
    mamba_step_naive,
)

EPS = 1e-5


def randn(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


def mamba_case(batch, channels, width, n_state, dt_rank, *, bias=True, dtype=torch.float32, seed=0):
    """(weights, conv state, ssm state, inputs of 6 tokens) with Mamba-like magnitudes."""
    g = torch.Generator().manual_seed(seed)
    weights = {
        "conv_weight": randn(g, channels, width, scale=0.5),
        "conv_bias": randn(g, channels, scale=0.1) if bias else None,
        "x_proj_weight": randn(g, dt_rank + 2 * n_state, channels, scale=channels**-0.5),
        "dt_proj_weight": randn(g, channels, dt_rank, scale=dt_rank**-0.5),
        "dt_proj_bias": randn(g, channels) - 3.0,
        "A_log": torch.log(torch.arange(1.0, n_state + 1)).repeat(channels, 1) + randn(g, channels, n_state, scale=0.1),
        "D": randn(g, channels),
    }
    weights = {k: None if v is None else v.to(dtype) for k, v in weights.items()}
    tokens = [randn(g, batch, 2 * channels).to(dtype) for _ in range(6)]
    return weights, randn(g, batch, channels, width).to(dtype), randn(g, batch, channels, n_state), tokens


def mamba2_case(batch, heads, groups, head_dim, n_state, width, *, norm=True, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    channels = groups * head_dim + groups * n_state + heads * n_state
    weights = {
        "conv_weight": randn(g, channels, width, scale=0.5),
        "conv_bias": randn(g, channels, scale=0.1),
        "dt_bias": randn(g, heads) - 3.0,
        "A_log": torch.log(1.0 + 15.0 * torch.rand(heads, generator=g)),
        "D": randn(g, heads),
        "norm_weight": randn(g, heads * head_dim) if norm else None,
    }
    weights = {k: None if v is None else v.to(dtype) for k, v in weights.items()}
    tokens = [randn(g, batch, heads * head_dim + channels + heads).to(dtype) for _ in range(6)]
    return weights, randn(g, batch, channels, width).to(dtype), randn(g, batch, heads, head_dim, n_state), tokens


def run_steps(step, weights, conv, ssm, tokens, **extra):
    """Outputs of every token, and the final states (the given ones are left unchanged)."""
    conv, ssm = conv.clone(), ssm.clone()
    outputs = [step(x, conv, ssm, **weights, **extra) for x in tokens]
    return torch.stack(outputs), conv, ssm


def assert_same_steps(naive, compiled_step, case, tol, **extra):
    y_ref, conv_ref, ssm_ref = run_steps(naive, *case, **extra)
    y, conv, ssm = run_steps(compiled_step, *case, **extra)
    assert y.dtype == y_ref.dtype and conv.dtype == conv_ref.dtype
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(ssm, ssm_ref, atol=tol, rtol=tol)
    assert torch.equal(conv, conv_ref)  # the conv state only holds past inputs


# shapes: the SmolLM2 layer (384 channels, N 16, rank 36), and odd ones (partial vectors)
MAMBA_SHAPES = [(1, 384, 4, 16, 36), (2, 21, 3, 5, 4), (3, 40, 4, 19, 17)]
MAMBA2_SHAPES = [(1, 9, 3, 64, 64, 4), (2, 4, 2, 5, 7, 3), (3, 6, 1, 20, 17, 4)]


@pytest.mark.parametrize("shape", MAMBA_SHAPES, ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["conv-bias", "no-conv-bias"])
def test_compiled_mamba_step_matches_naive(compiled, shape, bias):
    assert_same_steps(mamba_step_naive, mamba_step_compiled, mamba_case(*shape, bias=bias), 1e-5)


@pytest.mark.parametrize("shape", MAMBA2_SHAPES, ids=str)
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no-norm"])
def test_compiled_mamba2_step_matches_naive(compiled, shape, norm):
    case = mamba2_case(*shape, norm=norm)
    assert_same_steps(mamba2_step_naive, mamba2_step_compiled, case, 1e-5, groups=shape[2], eps=EPS)


def test_compiled_steps_bf16(compiled):
    """bf16 activations, conv state and weights (fp32 SSM state): the PyTorch step rounds
    intermediate results to bf16, the compiled one computes in fp32; they agree to a few
    bf16 roundings (~4e-3 each)."""
    assert_same_steps(mamba_step_naive, mamba_step_compiled, mamba_case(*MAMBA_SHAPES[0], dtype=torch.bfloat16), 5e-2)
    shape = MAMBA2_SHAPES[0]
    case = mamba2_case(*shape, dtype=torch.bfloat16)
    assert_same_steps(mamba2_step_naive, mamba2_step_compiled, case, 5e-2, groups=shape[2], eps=EPS)


def test_auto_picks_compiled_when_built(compiled):
    weights, conv, ssm, tokens = mamba_case(*MAMBA_SHAPES[1])
    y = mamba_step(tokens[0], conv.clone(), ssm.clone(), **weights, backend="auto")
    assert torch.equal(y, mamba_step_compiled(tokens[0], conv.clone(), ssm.clone(), **weights))


@pytest.mark.parametrize("backend", ["auto", "naive", "torch"])
def test_torch_step_for_a_bf16_state_or_a_torch_backend(backend):
    """A bf16 SSM state is not a kernel layout: auto takes the PyTorch step, as do the
    scan backends other than `compiled`."""
    shape = MAMBA2_SHAPES[1]
    weights, conv, ssm, tokens = mamba2_case(*shape)
    ssm = ssm.to(torch.bfloat16)
    y = mamba2_step(tokens[0], conv.clone(), ssm.clone(), **weights, groups=shape[2], eps=EPS, backend=backend)
    assert torch.equal(y, mamba2_step_naive(tokens[0], conv.clone(), ssm.clone(), **weights, groups=shape[2], eps=EPS))


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (lambda w, s: s.update(ssm=s["ssm"].to(torch.bfloat16)), TypeError, "mamba_step: ssm_state must be float32"),
        (lambda w, s: s.update(conv=s["conv"][:, :, :2]), ValueError, r"mamba_step: conv_state must have shape \[2, 21, 3\]"),
        (lambda w, s: s.update(conv=s["conv"].to(torch.bfloat16)), TypeError, "mamba_step: conv_state must have the dtype of xz"),
        (lambda w, s: w.update(x_proj_weight=w["x_proj_weight"][:-1]), ValueError, "mamba_step: x_proj_weight must have shape"),
        (lambda w, s: w.update(D=w["D"].double()), TypeError, "mamba_step: D must be float32 or bfloat16"),
        (lambda w, s: s.update(xz=s["xz"][:, :-1]), ValueError, r"mamba_step: xz must be a 2-d tensor \[B, 2 Di\]"),
        (lambda w, s: s.update(ssm=s["ssm"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "ssm_state must be contiguous"),
    ],
    ids=["state-dtype", "conv-shape", "conv-dtype", "weight-shape", "weight-dtype", "xz", "non-contiguous-state"],
)
def test_compiled_step_rejects_bad_inputs_in_one_line(compiled, change, error, message):
    weights, conv, ssm, tokens = mamba_case(*MAMBA_SHAPES[1])
    states = {"xz": tokens[0], "conv": conv, "ssm": ssm}
    change(weights, states)
    with pytest.raises(error, match=message) as raised:
        mamba_step_compiled(states["xz"], states["conv"], states["ssm"], **weights)
    assert "\n" not in str(raised.value)


def test_compiled_mamba2_step_rejects_bad_groups(compiled):
    shape = MAMBA2_SHAPES[1]
    weights, conv, ssm, tokens = mamba2_case(*shape)
    with pytest.raises(ValueError, match="mamba2_step: 4 heads cannot share 3 groups evenly"):
        mamba2_step_compiled(tokens[0], conv, ssm, **weights, groups=3, eps=EPS)


def test_compiled_step_reads_strided_activations(compiled):
    """A non-contiguous xz (a slice) gives the result of its contiguous copy."""
    weights, conv, ssm, tokens = mamba_case(*MAMBA_SHAPES[1])
    wide = torch.cat([tokens[0], tokens[1]], dim=1)[:, : tokens[0].shape[1]]
    assert not wide.is_contiguous()
    y = mamba_step_compiled(wide, conv.clone(), ssm.clone(), **weights)
    assert torch.equal(y, mamba_step_compiled(tokens[0], conv.clone(), ssm.clone(), **weights))
