"""The decode steps of `step/naive.py` as one compiled call each (`ops/csrc/step.cpp`).

Same signatures and results; the arithmetic is fp32, the SSM state must be fp32, and the
activations, the conv state and the weights are fp32 or bf16 (weights of another dtype
than the activations are converted for the call).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import kernels


def mamba_step_compiled(
    xz: Tensor,
    conv_state: Tensor,
    ssm_state: Tensor,
    conv_weight: Tensor,
    conv_bias: Tensor | None,
    x_proj_weight: Tensor,
    dt_proj_weight: Tensor,
    dt_proj_bias: Tensor,
    A_log: Tensor,
    D: Tensor,
) -> Tensor:
    """`mamba_step_naive` in one compiled call; shapes and results as there."""
    op = "mamba_step"
    lib = kernels.require(op)
    if not isinstance(xz, Tensor) or xz.dim() != 2 or xz.shape[1] % 2:
        raise ValueError(f"{op}: xz must be a 2-d tensor [B, 2 Di], got {_describe(xz)}")
    batch, channels = xz.shape[0], xz.shape[1] // 2
    width = _columns(op, conv_weight, "conv_weight")
    n_state = _columns(op, A_log, "A_log")
    dt_rank = _columns(op, dt_proj_weight, "dt_proj_weight")
    weights = {
        "conv_weight": (conv_weight, (channels, width), "[Di, K]"),
        "conv_bias": (conv_bias, (channels,), "[Di]"),
        "x_proj_weight": (x_proj_weight, (dt_rank + 2 * n_state, channels), "[R + 2N, Di]"),
        "dt_proj_weight": (dt_proj_weight, (channels, dt_rank), "[Di, R]"),
        "dt_proj_bias": (dt_proj_bias, (channels,), "[Di]"),
        "A_log": (A_log, (channels, n_state), "[Di, N]"),
        "D": (D, (channels,), "[Di]"),
    }
    xz = _check_states(op, "xz", xz, (conv_state, (batch, channels, width), "[B, Di, K]"),
                       (ssm_state, (batch, channels, n_state), "[B, Di, N]"))
    w = _weights(op, xz.dtype, weights)
    y = xz.new_empty(batch, channels)
    p = kernels.pointer
    kernels.run(
        op, lib.rf_mamba_step, xz.dtype == torch.bfloat16,
        p(xz), p(conv_state), p(ssm_state), p(w["conv_weight"]), p(w["conv_bias"]), p(w["x_proj_weight"]),
        p(w["dt_proj_weight"]), p(w["dt_proj_bias"]), p(w["A_log"]), p(w["D"]), p(y),
        batch, channels, width, n_state, dt_rank, torch.get_num_threads(),
    )
    return y


def mamba2_step_compiled(
    zxbcdt: Tensor,
    conv_state: Tensor,
    ssm_state: Tensor,
    conv_weight: Tensor,
    conv_bias: Tensor | None,
    dt_bias: Tensor,
    A_log: Tensor,
    D: Tensor,
    norm_weight: Tensor | None,
    groups: int,
    eps: float,
) -> Tensor:
    """`mamba2_step_naive` in one compiled call; shapes and results as there."""
    op = "mamba2_step"
    lib = kernels.require(op)
    if not isinstance(ssm_state, Tensor) or ssm_state.dim() != 4:
        raise ValueError(f"{op}: ssm_state must be a 4-d tensor [B, H, P, N], got {_describe(ssm_state)}")
    batch, heads, head_dim, n_state = ssm_state.shape
    if not (isinstance(groups, int) and groups >= 1 and heads % groups == 0):
        raise ValueError(f"{op}: {heads} heads cannot share {groups!r} groups evenly")
    channels = groups * head_dim + groups * n_state + heads * n_state
    width = _columns(op, conv_weight, "conv_weight")
    if not isinstance(zxbcdt, Tensor) or zxbcdt.dim() != 2:
        raise ValueError(f"{op}: zxbcdt must be a 2-d tensor [B, H P + G P + G N + H N + H], got {_describe(zxbcdt)}")
    kernels.check(op, "zxbcdt", zxbcdt, (batch, heads * head_dim + channels + heads), "[B, H P + G P + G N + H N + H]")
    weights = {
        "conv_weight": (conv_weight, (channels, width), "[G P + G N + H N, K]"),
        "conv_bias": (conv_bias, (channels,), "[G P + G N + H N]"),
        "dt_bias": (dt_bias, (heads,), "[H]"),
        "A_log": (A_log, (heads,), "[H]"),
        "D": (D, (heads,), "[H]"),
        "norm_weight": (norm_weight, (heads * head_dim,), "[H P]"),
    }
    zxbcdt = _check_states(op, "zxbcdt", zxbcdt, (conv_state, (batch, channels, width), "[B, G P + G N + H N, K]"),
                           (ssm_state, (batch, heads, head_dim, n_state), "[B, H, P, N]"))
    w = _weights(op, zxbcdt.dtype, weights)
    out = zxbcdt.new_empty(batch, heads * head_dim)
    p = kernels.pointer
    kernels.run(
        op, lib.rf_mamba2_step, zxbcdt.dtype == torch.bfloat16,
        p(zxbcdt), p(conv_state), p(ssm_state), p(w["conv_weight"]), p(w["conv_bias"]), p(w["dt_bias"]),
        p(w["A_log"]), p(w["D"]), p(w["norm_weight"]), float(eps), p(out),
        batch, heads, groups, head_dim, n_state, width, torch.get_num_threads(),
    )
    return out


def _describe(value) -> str:
    return f"shape {list(value.shape)}" if isinstance(value, Tensor) else type(value).__name__


def _columns(op: str, tensor, name: str) -> int:
    """The second size of a 2-d tensor argument, with a one-line error otherwise."""
    if not isinstance(tensor, Tensor) or tensor.dim() != 2:
        raise ValueError(f"{op}: {name} must be a 2-d tensor, got {_describe(tensor)}")
    return tensor.shape[1]


def _check_states(op: str, name: str, activations: Tensor, conv: tuple, ssm: tuple) -> Tensor:
    """Check the activations and the two states, given as (tensor, shape, layout): the conv
    state in the activations' dtype, the SSM state in fp32, both contiguous since they are
    written in place. Returns the activations, contiguous."""
    kernels.check(op, name, activations, None)
    (conv_state, *conv_shape), (ssm_state, *ssm_shape) = conv, ssm
    kernels.check(op, "conv_state", conv_state, *conv_shape)
    kernels.check(op, "ssm_state", ssm_state, *ssm_shape)
    if conv_state.dtype != activations.dtype:
        raise TypeError(f"{op}: conv_state must have the dtype of {name} ({activations.dtype}), got {conv_state.dtype}")
    if ssm_state.dtype != torch.float32:
        raise TypeError(f"{op}: ssm_state must be float32 for the compiled step, got {ssm_state.dtype}")
    for state_name, state in (("conv_state", conv_state), ("ssm_state", ssm_state)):
        if not state.is_contiguous():
            raise ValueError(f"{op}: {state_name} must be contiguous (it is updated in place)")
    return activations.contiguous()


def _weights(op: str, dtype: torch.dtype, weights: dict) -> dict:
    """Each weight checked, then as a contiguous tensor of the activations' dtype."""
    for name, (tensor, shape, layout) in weights.items():
        if tensor is not None or name not in ("conv_bias", "norm_weight"):
            kernels.check(op, name, tensor, shape, layout)
    return {name: kernels.prepare(tensor, dtype) for name, (tensor, _, _) in weights.items()}
