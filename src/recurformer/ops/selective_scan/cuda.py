"""Optional GPU backend: mamba-ssm's fused selective-scan kernel behind our signature.

mamba-ssm is imported lazily, inside the functions, so that this module (and the whole
package) imports on machines without it. Our layout is time-major per row (`[B, T, D]`);
the kernel wants channels first (`[B, D, T]`, and `[B, N, T]` for B and C).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _kernel():
    """mamba-ssm's `selective_scan_fn`, or None when it does not import."""
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except Exception:  # ImportError, or a broken build raising anything at import time
        return None
    return selective_scan_fn


def cuda_available() -> bool:
    """True when mamba-ssm's kernel imports and a CUDA device is present."""
    return torch.cuda.is_available() and _kernel() is not None


def selective_scan_cuda(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    initial_state: Tensor | None = None,
    return_final_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Selective scan on the GPU with mamba-ssm; shapes as in `selective_scan_naive`.

    Args:
        u, delta, z: `[B, T, D]`; A: `[D, N]`; B, C: `[B, T, N]`; D: `[D]`.
        initial_state: must be None (the kernel always starts from a zero state).

    Returns:
        y `[B, T, D]` in the dtype of `u`, and the final state `[B, D, N]` if asked.
    """
    if initial_state is not None:
        raise NotImplementedError(
            "the cuda selective scan (mamba-ssm) cannot start from an initial_state; "
            "use backend='torch' or 'naive'"
        )
    kernel = _kernel()
    if kernel is None or not torch.cuda.is_available():
        raise RuntimeError(
            "backend='cuda' needs a CUDA device and mamba-ssm "
            "(pip install 'recurformer[cuda]'); use backend='torch' on CPU"
        )
    if not u.is_cuda:
        raise RuntimeError(f"backend='cuda' needs tensors on a GPU, got u on {u.device}")
    channels_first = [t.transpose(1, 2).contiguous() for t in (u, delta, B, C)]
    z_cf = None if z is None else z.transpose(1, 2).contiguous()
    out = kernel(
        *channels_first[:2],
        A.float(),
        *channels_first[2:],
        D=None if D is None else D.float(),
        z=z_cf,
        delta_bias=None,
        delta_softplus=False,
        return_last_state=return_final_state,
    )
    if return_final_state:
        y, last_state = out
        return y.transpose(1, 2).to(u.dtype), last_state.float()
    return out.transpose(1, 2).to(u.dtype)
