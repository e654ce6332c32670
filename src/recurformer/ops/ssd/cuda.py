"""Optional GPU backends of the SSD scan behind our signature: mamba-ssm's fused kernel
(`mamba_chunk_scan_combined`), else flash-linear-attention's chunked simple gated linear
attention (`chunk_simple_gla`), which is the same recurrence: a scalar decay per head.

Both are imported lazily, inside the functions, so that this module (and the whole package)
imports on machines without them. mamba-ssm takes our layout (`[B, T, H, P]`, state
`[B, H, P, N]`) but wants B and C with the same number of groups. flash-linear-attention
computes `S_t = exp(g_t) S_{t-1} + k_t v_t^T`, `o_t = scale * q_t S_t`: ours with q = C,
k = B (one per head), v = dt x, g = dt A, scale 1, and its state stored value-first
(`[B, H, P, N]`, ours); its Triton kernels need P and N of at least 16. [ours] It is taken
for bf16 / fp16 activations in inference only: in fp32 its dot products run in TF32
(1.5e-3 relative error measured on an H100, above the fp32 bound of 1e-4, where the
chunked PyTorch scan stays in fp32), and version 0.6.0 refuses its backward pass on Hopper
GPUs with Triton < 3.7.1 (its issue 640), where the chunked PyTorch scan trains instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .chunked import DEFAULT_CHUNK
from .naive import per_head

FLA_MIN_SIZE = 16  # the smallest head size and state size flash-linear-attention's kernels take


def _kernel():
    """mamba-ssm's `mamba_chunk_scan_combined`, or None when it does not import."""
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception:  # ImportError, or a broken build raising anything at import time
        return None
    return mamba_chunk_scan_combined


def _fla_kernel():
    """flash-linear-attention's `chunk_simple_gla`, or None when it does not import."""
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception:  # ImportError, or a Triton it does not work with
        return None
    return chunk_simple_gla


def fla_takes(x: Tensor, B: Tensor, backward: bool = False) -> bool:
    """Whether we run flash-linear-attention's kernel on these tensors: head size `P` and
    state size `N` of at least 16, bf16 or fp16 activations, no backward pass to come."""
    return (x.shape[-1] >= FLA_MIN_SIZE and B.shape[-1] >= FLA_MIN_SIZE and not backward
            and x.dtype in (torch.bfloat16, torch.float16))


def gradients_flow(*tensors: Tensor | None) -> bool:
    """Whether autograd records an op on `tensors` (a backward pass will follow)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def gpu_kernel(x: Tensor, B: Tensor, backward: bool = False) -> str | None:
    """The GPU kernel `ssd_cuda` runs on these tensors: `mamba-ssm`, `flash-linear-attention`, or None."""
    if not torch.cuda.is_available():
        return None
    if _kernel() is not None:
        return "mamba-ssm"
    return "flash-linear-attention" if _fla_kernel() is not None and fla_takes(x, B, backward) else None


def cuda_available(x: Tensor | None = None, B: Tensor | None = None, backward: bool = False) -> bool:
    """True when a CUDA device is present and mamba-ssm's SSD kernel imports, or
    flash-linear-attention's does and we run it on these tensors (`fla_takes`; `x`
    `[B, T, H, P]`, `B` `[B, T, G, N]`, None: any it takes; `backward`: gradients will flow)."""
    if x is None or B is None:
        return torch.cuda.is_available() and (_kernel() is not None or _fla_kernel() is not None)
    return gpu_kernel(x, B, backward) is not None


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
    """SSD on the GPU with mamba-ssm, else flash-linear-attention; shapes and results as in `ssd_naive`."""
    if not cuda_available(x, B, gradients_flow(x, dt, A, B, C, D, initial_state)):
        raise RuntimeError(
            "backend='cuda' needs a CUDA device and mamba-ssm, or flash-linear-attention with bf16/fp16 inputs, "
            "head and state sizes >= 16 and no backward pass (pip install 'recurformer[cuda]'); else use backend='torch'"
        )
    if not x.is_cuda:
        raise RuntimeError(f"backend='cuda' needs tensors on a GPU, got x on {x.device}")
    kernel = _kernel()
    if kernel is None:
        return _ssd_fla(x, dt, A, B, C, D, initial_state, return_final_state)
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


def _ssd_fla(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, initial_state: Tensor | None,
             return_final_state: bool) -> Tensor | tuple[Tensor, Tensor]:
    """`ssd_cuda` through flash-linear-attention's `chunk_simple_gla` (mapping in the module
    docstring), in its own chunk length (a performance setting, not a result one)."""
    heads = x.shape[2]
    q, k = per_head(C, heads).to(x.dtype), per_head(B, heads).to(x.dtype)
    v = (dt[..., None].float() * x.float()).to(x.dtype)
    g = dt.float() * A.float()  # log decay per step and head, fp32
    y, state = _fla_kernel()(
        q.contiguous(), k.contiguous(), v.contiguous(), g=g.contiguous(), scale=1.0,
        initial_state=None if initial_state is None else initial_state.float().contiguous(),
        output_final_state=return_final_state, state_v_first=True,
    )
    if D is not None:
        y = y.float() + x.float() * D.float()[:, None]
    y = y.to(x.dtype)
    return (y, state.float()) if return_final_state else y
