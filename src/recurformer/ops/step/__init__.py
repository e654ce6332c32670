"""Decode steps of the mamba and mamba2 mixers (everything between in_proj and out_proj for
one token), with one signature per mixer and three backends: `naive` (PyTorch, the oracle,
runs anywhere), `compiled` (one C++ call, CPU) and, for mamba2, `triton` (one Triton kernel,
GPU: `step/triton.py`). `auto` picks `compiled` when the kernels are built and the tensors
suit them (CPU, fp32 / bf16, fp32 SSM state), the Triton step for CUDA tensors in inference
when Triton imports (`cuda` asks for it too; `ops/triton_kernels.py`), else the PyTorch step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backends import pick_backend
from ..triton_kernels import run, takes
from .compiled import mamba2_step_compiled, mamba_step_compiled
from .naive import mamba2_step_naive, mamba_step_naive
from .triton import mamba2_step_triton


def _compiled(backend: str, activations: Tensor, conv_state: Tensor, ssm_state: Tensor, *weights) -> bool:
    fits = ssm_state.dtype == torch.float32 and conv_state.dtype == activations.dtype
    return pick_backend("decode step", backend, activations, conv_state, ssm_state, *weights, fits=fits) == "compiled"


def mamba_step(
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
    backend: str = "auto",
) -> Tensor:
    """One mamba decode step, shapes as in `mamba_step_naive`; `backend` as the mixer's
    `scan_backend`."""
    args = (xz, conv_state, ssm_state, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, dt_proj_bias, A_log, D)
    step = mamba_step_compiled if _compiled(backend, *args[:3], *args[3:]) else mamba_step_naive
    return step(*args)


def mamba2_step(
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
    backend: str = "auto",
) -> Tensor:
    """One mamba2 decode step, shapes as in `mamba2_step_naive`; `backend` as the mixer's
    `scan_backend`."""
    tensors = (zxbcdt, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight)
    if (backend in ("auto", "cuda") and ssm_state.dtype == torch.float32 and conv_state.is_contiguous()
            and ssm_state.is_contiguous() and takes("mamba2 step", *tensors)):
        return run("mamba2 step", mamba2_step_triton, mamba2_step_naive, *tensors, groups, eps)
    step = mamba2_step_compiled if _compiled(backend, *tensors) else mamba2_step_naive
    return step(*tensors, groups, eps)


__all__ = [
    "mamba2_step",
    "mamba2_step_compiled",
    "mamba2_step_naive",
    "mamba2_step_triton",
    "mamba_step",
    "mamba_step_compiled",
    "mamba_step_naive",
]
