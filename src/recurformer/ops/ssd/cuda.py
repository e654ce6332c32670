"""Optional GPU backend: mamba-ssm's fused SSD kernel (`mamba_chunk_scan_combined`) behind our signature.

mamba-ssm is imported lazily, inside the functions, so that this module (and the whole
package) imports on machines without it. Its layout is ours (`[B, T, H, P]`, state
`[B, H, P, N]`), but it wants B and C with the same number of groups.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .chunked import DEFAULT_CHUNK
from .naive import per_head


def _kernel():
    """mamba-ssm's `mamba_chunk_scan_combined`, or None when it does not import."""
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception:  # ImportError, or a broken build raising anything at import time
        return None
    return mamba_chunk_scan_combined


def cuda_available() -> bool:
    """True when mamba-ssm's SSD kernel imports and a CUDA device is present."""
    return torch.cuda.is_available() and _kernel() is not None


def ssd_cuda(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    initial_state: Tensor | None = None,
    return_final_state: bool = False,
    *,
    chunk_size: int = DEFAULT_CHUNK,
) -> Tensor | tuple[Tensor, Tensor]:
    """SSD on the GPU with mamba-ssm; shapes and results as in `ssd_naive`."""
    kernel = _kernel()
    if kernel is None or not torch.cuda.is_available():
        raise RuntimeError(
            "backend='cuda' needs a CUDA device and mamba-ssm "
            "(pip install 'recurformer[cuda]'); use backend='torch' on CPU"
        )
    if not x.is_cuda:
        raise RuntimeError(f"backend='cuda' needs tensors on a GPU, got x on {x.device}")
    if B.shape[2] != C.shape[2]:
        B, C = per_head(B, x.shape[2]), per_head(C, x.shape[2])
    out = kernel(
        x, dt, A.float(), B, C, chunk_size,
        D=None if D is None else D.float(),
        initial_states=None if initial_state is None else initial_state.float(),
        return_final_states=return_final_state,
    )
    if return_final_state:
        y, state = out
        return y.to(x.dtype), state.float()
    return out.to(x.dtype)
