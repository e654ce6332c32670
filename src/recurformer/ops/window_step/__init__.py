"""The fused decode step of the window mixers (`window`, `window+mamba2`, `window+mamba`,
`window+linear`): for all replaced heads of a layer, the window's projections, RoPE, the
ring-buffer write and softmax, the tail's state update and output, and the gate, with the
state updated in place. Two implementations with one signature: `naive` (PyTorch, the
oracle) and `compiled` (one C++ call, CPU); `WindowStepKernel` is the compiled one with
its weights checked once, which the mixers keep between tokens. Where the kernels are not
built, the mixers run their own PyTorch step (docs/method.md, "The decode step").
"""

from .compiled import WindowStepKernel, window_step_compiled
from .naive import window_step_naive
from .parts import LinearTail, Mamba2Tail, MambaTail, Tail, WindowWeights

__all__ = [
    "LinearTail",
    "Mamba2Tail",
    "MambaTail",
    "Tail",
    "WindowStepKernel",
    "WindowWeights",
    "window_step_compiled",
    "window_step_naive",
]
