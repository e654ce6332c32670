"""When a window mixer's decode step runs as one compiled call (`ops/window_step`).

[ours] A window kind's `step` asks `compiled_step(mixer, x)` for its kernel and runs its
own PyTorch step when there is none. Kernels are kept per mixer between tokens
(`ops/module_kernels`) and rebuilt when a parameter's storage changes.
"""

from __future__ import annotations

from torch import Tensor

from ..ops import kernels
from ..ops.backends import pick_backend
from ..ops.module_kernels import KernelsByModule, records_gradients
from ..ops.window_step import WindowStepKernel
from .base import Mixer, PositionEmbeddings

_kernels = KernelsByModule()


def compiled_step(mixer: Mixer, x: Tensor) -> WindowStepKernel | None:
    """The compiled step of `mixer` (a window kind with `fused_step_parts`) for activations
    like `x` `[B, d_in]`, or None when its PyTorch step must run: the config's
    `scan_backend` is neither `auto` nor `compiled`; autograd records (the compiled step
    has no backward); or, with `auto`, the kernels are not built or the tensors do not
    suit them (CPU, fp32 or bf16 activations, every parameter in their dtype, an fp32
    `state_dtype` where the kind keeps a state). `compiled` with unsuitable tensors raises
    a one-line error."""
    backend = mixer.config.scan_backend  # already under its present name (MixerConfig)
    if (backend != "auto" and backend != "compiled") or records_gradients(mixer, x):
        return None
    kernel = _kernels.get(mixer, x.dtype)
    if kernel is not None:
        return kernel
    parameters = list(mixer.parameters())
    fp32_state = not mixer.config.reads("state_dtype") or mixer.config.state_dtype == "float32"
    fits = fp32_state and all(p.dtype == x.dtype for p in parameters)
    if pick_backend(f"{mixer.kind} step", "auto", x, fits=fits) != "compiled":
        if backend == "auto":
            return None
        kernels.require(f"{mixer.kind} step")
        raise TypeError(f"{mixer.kind} step: the compiled step needs CPU float32 or bfloat16 activations, parameters "
                        f"of their dtype and state_dtype float32; got {x.dtype} activations on {x.device}, state_dtype "
                        f"{mixer.config.state_dtype}, parameters of {sorted({str(p.dtype) for p in parameters})}")
    kernel = WindowStepKernel(*mixer.fused_step_parts(), x.dtype)
    _kernels.put(mixer, kernel)
    return kernel


def rotary(position_embeddings: PositionEmbeddings | None) -> tuple[Tensor, Tensor]:
    """A decode step's `(cos, sin)`, each `[B or 1, 1, D]`, as the kernel takes them: `[B or 1, D]`."""
    if position_embeddings is None:
        raise ValueError("the window mixer needs position_embeddings=(cos, sin): it applies RoPE as the heads it replaces did")
    cos, sin = position_embeddings
    return cos[:, 0], sin[:, 0]
