"""The kept heads' decode step as one compiled call (`ops/csrc/attention_step.cpp`).

`AttentionStepKernel` checks the heads' weights once and keeps their addresses in a C
struct; calling it checks the activations, the rotary embedding and the cache buffers and
makes one ctypes call. `attention_step_compiled` is the same with the signature of
`attention_step_naive`. Dtypes: the activations, cos/sin, the buffers and the weights
share one dtype, fp32 or bf16 (weights of another dtype are converted once); the
arithmetic is fp32.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from .. import kernels
from ..window_step.compiled import token_inputs
from .naive import AttentionWeights

OP = "attention_step"
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class AttentionStepWeights(ctypes.Structure):
    """`struct AttentionStepWeights` of attention_step.cpp, field for field (all 8 bytes wide)."""

    _fields_ = [
        *((name, _i64) for name in ("bf16", "d_in", "heads", "kv_heads", "head_dim")),
        ("scaling", ctypes.c_double),
        *((name, _ptr) for name in ("q_weight", "q_bias", "k_weight", "k_bias", "v_weight", "v_bias")),
    ]


class AttentionStepKernel:
    """The compiled step of `weights` for `dtype` activations: built once (every weight
    checked, converted to `dtype` if it has another); `kernel(x, cos, sin, keys, values,
    length)` then runs one token as `attention_step_naive` does. It holds its weight
    tensors, so their addresses stay valid while it lives."""

    def __init__(self, weights: AttentionWeights, dtype: torch.dtype):
        self.lib = kernels.require(OP, AttentionStepWeights)
        if dtype is not torch.float32 and dtype is not torch.bfloat16:
            raise TypeError(f"{OP}: activations must be float32 or bfloat16, got {dtype}")
        heads, groups = weights.heads, weights.kv_heads
        if not isinstance(weights.q_weight, Tensor) or weights.q_weight.dim() != 2:
            raise ValueError(f"{OP}: q_weight must be a 2-d tensor [H D, d_in]")
        dim = weights.head_dim
        if not (heads >= 1 and groups >= 1 and heads % groups == 0 and dim >= 2 and dim % 2 == 0
                and weights.q_weight.shape[0] == heads * dim):
            raise ValueError(f"{OP}: {heads} query heads over {groups} KV groups do not fit q_weight "
                             f"{list(weights.q_weight.shape)} with an even head size")
        self.dtype, self.heads, self.groups, self.dim = dtype, heads, groups, dim
        self.d_in = weights.q_weight.shape[1]
        self._tensors: list[Tensor] = []  # what the struct points to, kept alive here
        w = AttentionStepWeights(bf16=dtype is torch.bfloat16, d_in=self.d_in, heads=heads, kv_heads=groups,
                                 head_dim=dim, scaling=float(weights.scaling))
        for name, tensor, rows in (("q", weights.q_weight, heads * dim), ("k", weights.k_weight, groups * dim),
                                   ("v", weights.v_weight, groups * dim)):
            self._set(w, f"{name}_weight", tensor, (rows, self.d_in), "[rows, d_in]")
            self._set(w, f"{name}_bias", getattr(weights, f"{name}_bias"), (rows,), "[rows]")
        self.weights = w

    def _set(self, w: AttentionStepWeights, field: str, tensor: Tensor | None, shape: tuple, layout: str) -> None:
        if tensor is None and field.endswith("bias"):
            return
        kernels.check(OP, field, tensor, shape, layout)
        tensor = kernels.prepare(tensor.detach(), self.dtype)
        self._tensors.append(tensor)
        setattr(w, field, tensor.data_ptr())

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, length: int,
                 starts: Tensor | None = None) -> Tensor:
        """x `[B, d_in]`, cos and sin `[B or 1, D]`, keys and values `[B, G, capacity, D]`
        (contiguous, written in place), `length` in [1, capacity], `starts` None or int64
        `[B]` in [0, length) (left padding: the first slot each row attends from) -> `[B, H D]`."""
        dtype = self.dtype
        x, cos, sin = token_inputs(x, cos, sin, dtype, self.d_in, self.dim, OP)
        batch = x.shape[0]
        capacity = keys.shape[2] if isinstance(keys, Tensor) and keys.dim() == 4 else -1
        for name, t in (("keys", keys), ("values", values)):
            if not (isinstance(t, Tensor) and t.dtype is dtype and t.shape == (batch, self.groups, capacity, self.dim)
                    and t.is_cpu and t.is_contiguous()):
                raise ValueError(f"{OP}: {name} must be a contiguous CPU {dtype} buffer [{batch}, {self.groups}, capacity, "
                                 f"{self.dim}] like keys, got {_describe(t)}")
        if not (isinstance(length, int) and 1 <= length <= capacity):
            raise ValueError(f"{OP}: length must be in [1, {capacity}], got {length!r}")
        if starts is not None and not (isinstance(starts, Tensor) and starts.dtype is torch.int64 and starts.is_cpu
                                       and starts.shape == (batch,) and starts.is_contiguous()
                                       and 0 <= int(starts.min()) and int(starts.max()) < length):
            raise ValueError(f"{OP}: starts must be a contiguous CPU int64 tensor [{batch}] of slots in [0, {length}), "
                             f"got {_describe(starts)}")
        out = x.new_empty(batch, self.heads * self.dim)
        kernels.run(
            OP, self.lib.rf_attention_step, ctypes.addressof(self.weights), x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            keys.data_ptr(), values.data_ptr(), out.data_ptr(), None if starts is None else starts.data_ptr(),
            batch, cos.shape[0], capacity, length, torch.get_num_threads(),
        )
        return out


def attention_step_compiled(x: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, length: int,
                            weights: AttentionWeights, starts: Tensor | None = None) -> Tensor:
    """`attention_step_naive` in one compiled call; arguments and results as there."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{OP}: x must be a tensor, got {type(x).__name__}")
    return AttentionStepKernel(weights, x.dtype)(x, cos, sin, keys, values, length, starts)


def _describe(value) -> str:
    return f"{value.dtype} shape {list(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
