"""[ours] What our Triton kernels (the GPU's decode steps) share: Triton itself, None where it
is missing, and the rule each follows. A kernel runs where Triton imports, its tensors are on
a CUDA device and autograd records nothing (the kernels have no backward pass); one that
fails (a compiler that refuses it on this GPU, say) is reported in one line on stderr, and
its PyTorch path runs from then on.

    if takes("window step", q, keys):
        return run("window step", ring_step_triton, ring_step_torch, q, ...)

For checks on a machine without a GPU, `interpret_on_the_cpu()` has the kernels taken on CPU
tensors too, run by Triton's interpreter (`TRITON_INTERPRET=1` before this package imports).
"""

from __future__ import annotations

import os
import sys

from torch import Tensor

from .ssd.cuda import gradients_flow

try:  # the GPU path only; on the CPU the kernels' tests run Triton's interpreter
    import triton
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

_failed: dict[str, str] = {}  # kernel name -> why it could not run
_on_the_cpu = False  # `interpret_on_the_cpu`


def takes(name: str, *tensors: Tensor | None) -> bool:
    """Whether kernel `name` runs on `tensors` (the first one's device decides)."""
    return (triton is not None and name not in _failed and (tensors[0].is_cuda or _on_the_cpu)
            and not gradients_flow(*tensors))


def interpret_on_the_cpu() -> None:
    """From now on the kernels take CPU tensors too, through Triton's interpreter: the whole
    GPU path of a decode step checked on the CPU (tests, `benchmarks/speed/operator_calls`)."""
    global _on_the_cpu
    if triton is None or os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("interpret_on_the_cpu needs Triton and TRITON_INTERPRET=1 set before recurformer imports")
    _on_the_cpu = True


def run(name: str, kernel, fallback, *args):
    """`kernel(*args)`; if it fails, the one-line report, then `fallback(*args)` (and from then on)."""
    try:
        return kernel(*args)
    except Exception as error:  # noqa: BLE001 - a kernel that does not build must not stop decoding
        _failed[name] = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
        print(f"recurformer: the Triton {name} failed ({_failed[name]}); using PyTorch", file=sys.stderr)
        return fallback(*args)
