"""Compiled kernels built from a module's parameters, kept between decode steps.

[ours] A fused decode step (`window_step`, `attention_step`) checks a module's weights
once and keeps their addresses; it is valid as long as those parameters keep their
storage. `KernelsByModule` keeps one kernel per module in a weak map (a module that is
copied or pickled carries none, and a freed module frees its kernel) and drops it when a
parameter's storage changes (`.to()`, a replaced parameter), so that it is rebuilt. An
in-place update (an optimizer step, `load_state_dict`) keeps the storage: the kernel
reads the new values.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from . import kernels


class KernelsByModule:
    """`module -> kernel`; a kernel has a `dtype` (the activations' dtype it was built for)
    and `lib` (the loaded kernels it calls)."""

    def __init__(self) -> None:
        self._kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, module: nn.Module, dtype: torch.dtype):
        """The kernel kept for `module` and `dtype` activations, if its parameters still have
        the storage it was built on and the kernels it calls are still the loaded ones
        (`kernels.reset()` in tests); else None. Costs a few microseconds."""
        kept = self._kept.get(module)
        if kept is None:
            return None
        parameters, addresses, kernel = kept
        if (kernel.dtype is dtype and kernel.lib is kernels.library()
                and tuple(table[name].data_ptr() for table, name in parameters) == addresses):
            return kernel
        return None

    def put(self, module: nn.Module, kernel, reads: list[nn.Module] | None = None) -> None:
        """Keep `kernel`, built from the parameters of `reads` (default: `module` and its
        submodules) as they are now."""
        modules = [m for part in (reads or [module]) for m in part.modules()]
        parameters = [(m._parameters, name) for m in modules for name, p in m._parameters.items() if p is not None]
        self._kept[module] = (parameters, tuple(table[name].data_ptr() for table, name in parameters), kernel)


def records_gradients(module: nn.Module, x: Tensor) -> bool:
    """Whether autograd would record a step of `module` on `x` (the compiled steps have no
    backward pass, so then the PyTorch path runs)."""
    return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters()))
