"""The fused window step as one compiled call (`ops/csrc/window_step.cpp`).

`WindowStepKernel` checks a mixer's weights once and keeps their addresses in a C struct;
calling it checks only what changes from token to token (the activations, the rotary
embedding, the state) and makes one ctypes call. `window_step_compiled` is the same with
the signature of `window_step_naive`, for tests and one-off calls.

Dtypes: the activations, cos/sin, keys/values and conv state share one dtype, fp32 or
bf16 (weights of another dtype are converted once, when the kernel is built); the SSM
state and the tail sums are fp32; the arithmetic is fp32.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from .. import kernels
from .parts import LinearTail, Mamba2Tail, MambaTail, Tail, WindowWeights

OP = "window_step"
TAIL_CODES = {type(None): 0, Mamba2Tail: 1, MambaTail: 2, LinearTail: 3}  # `enum Tail` in window_step.cpp

_i64, _f64, _ptr = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p


class WindowStepWeights(ctypes.Structure):
    """`struct WindowStepWeights` of window_step.cpp, field for field (all 8 bytes wide)."""

    _fields_ = [
        *((name, _i64) for name in ("bf16", "tail", "d_in", "heads", "kv_heads", "head_dim", "sinks", "window")),
        ("scaling", _f64),
        *((name, _ptr) for name in ("q_weight", "q_bias", "k_weight", "k_bias", "v_weight", "v_bias",
                                    "in_weight", "in_bias", "out_weight", "out_bias", "gate")),
        ("in_rows", _i64), ("branch_width", _i64),
        *((name, _ptr) for name in ("conv_weight", "conv_bias", "dt_bias", "A_log", "D", "norm_weight", "x_proj", "dt_proj")),
        *((name, _i64) for name in ("groups", "n_state", "conv_width", "dt_rank")),
        ("eps", _f64),
        ("feature_map", _ptr), ("log_alpha", _ptr),
        ("feature_dim", _i64),
    ]


class WindowStepKernel:
    """The compiled step of one mixer's weights (`window`, `tail`) for `dtype` activations.

    Built once (every weight checked, converted to `dtype` if it has another); then
    `kernel(x, cos, sin, state)` runs one token as `window_step_naive` does. It holds its
    weight tensors, so their addresses stay valid as long as it lives; a weight replaced or
    moved afterwards is not seen (the mixers rebuild the kernel when an address changes).
    """

    def __init__(self, window: WindowWeights, tail: Tail, dtype: torch.dtype):
        self.lib = kernels.require(OP, WindowStepWeights)
        if dtype is not torch.float32 and dtype is not torch.bfloat16:
            raise TypeError(f"{OP}: activations must be float32 or bfloat16, got {dtype}")
        if type(tail) not in TAIL_CODES:
            raise TypeError(f"{OP}: unknown tail {type(tail).__name__}")
        heads, groups, dim = window.heads, window.kv_heads, window.head_dim
        if not (heads >= 1 and groups >= 1 and heads % groups == 0 and dim >= 2 and dim % 2 == 0):
            raise ValueError(f"{OP}: {heads} query heads over {groups} KV groups of {dim} channels (even) do not fit")
        if window.sinks < 0 or window.window < 1:
            raise ValueError(f"{OP}: need sinks >= 0 and window >= 1, got {window.sinks} and {window.window}")
        self.dtype, self.tail = dtype, tail
        self.d_in = _columns(window.q_weight, "q_weight")
        self.heads, self.groups, self.dim, self.slots = heads, groups, dim, window.slots
        self.d_out = heads * dim
        self._tensors: list[Tensor] = []  # what the struct points to, kept alive here
        w = WindowStepWeights(bf16=dtype is torch.bfloat16, tail=TAIL_CODES[type(tail)], d_in=self.d_in, heads=heads,
                              kv_heads=groups, head_dim=dim, sinks=window.sinks, window=window.window,
                              scaling=window.scaling)
        d_in = self.d_in
        self._set(w, "q_weight", window.q_weight, (self.d_out, d_in), "[H D, d_in]")
        self._set(w, "k_weight", window.k_weight, (groups * dim, d_in), "[G D, d_in]")
        self._set(w, "v_weight", window.v_weight, (groups * dim, d_in), "[G D, d_in]")
        for name, bias, rows in (("q_bias", window.q_bias, self.d_out), ("k_bias", window.k_bias, groups * dim),
                                 ("v_bias", window.v_bias, groups * dim)):
            self._set(w, name, bias, (rows,), "[rows]", optional=True)
        ring = (self.slots, groups, dim)
        # the state: name -> (shape after the batch size, dtype), in the kernel's argument order
        self.state_shapes = {"keys": (ring, dtype), "values": (ring, dtype), "index": ((self.slots,), torch.int64)}
        if isinstance(tail, Mamba2Tail):
            self._mamba2(w, tail)
        elif isinstance(tail, MambaTail):
            self._mamba(w, tail)
        elif isinstance(tail, LinearTail):
            self._linear(w, tail)
        self.weights = w

    def _mamba2(self, w: WindowStepWeights, tail: Mamba2Tail) -> None:
        heads, groups, dim = self.heads, tail.groups, self.dim
        if not (isinstance(groups, int) and groups >= 1 and heads % groups == 0):
            raise ValueError(f"{OP}: {heads} heads cannot share {groups!r} groups evenly")
        channels, width = _columns(tail.conv_weight, "conv_weight", rows=True), _columns(tail.conv_weight, "conv_weight")
        n_state, rest = divmod(channels - groups * dim, groups + heads)  # channels = G P + G N + H N
        if n_state < 1 or rest:
            raise ValueError(f"{OP}: conv_weight has {channels} channels, not G P + (G + H) N for any N")
        w.in_rows, w.branch_width, w.groups, w.n_state, w.conv_width, w.eps = (
            heads * dim + channels + heads, heads * dim, groups, n_state, width, float(tail.eps))
        self._set(w, "conv_weight", tail.conv_weight, (channels, width), "[G P + G N + H N, K]")
        self._set(w, "conv_bias", tail.conv_bias, (channels,), "[channels]", optional=True)
        for name in ("dt_bias", "A_log", "D"):
            self._set(w, name, getattr(tail, name), (heads,), "[H]")
        self._set(w, "norm_weight", tail.norm_weight, (heads * dim,), "[H P]", optional=True)
        self._branch(w, tail)
        self.state_shapes.update(conv=((channels, width), self.dtype), ssm=((heads, dim, n_state), torch.float32))

    def _mamba(self, w: WindowStepWeights, tail: MambaTail) -> None:
        channels, width = _columns(tail.conv_weight, "conv_weight", rows=True), _columns(tail.conv_weight, "conv_weight")
        n_state, dt_rank = _columns(tail.A_log, "A_log"), _columns(tail.dt_proj_weight, "dt_proj_weight")
        w.in_rows, w.branch_width, w.n_state, w.conv_width, w.dt_rank = 2 * channels, channels, n_state, width, dt_rank
        self._set(w, "conv_weight", tail.conv_weight, (channels, width), "[Di, K]")
        self._set(w, "conv_bias", tail.conv_bias, (channels,), "[Di]", optional=True)
        self._set(w, "x_proj", tail.x_proj_weight, (dt_rank + 2 * n_state, channels), "[R + 2N, Di]")
        self._set(w, "dt_proj", tail.dt_proj_weight, (channels, dt_rank), "[Di, R]")
        self._set(w, "dt_bias", tail.dt_proj_bias, (channels,), "[Di]")
        self._set(w, "A_log", tail.A_log, (channels, n_state), "[Di, N]")
        self._set(w, "D", tail.D, (channels,), "[Di]")
        self._branch(w, tail)
        self.state_shapes.update(conv=((channels, width), self.dtype), ssm=((channels, n_state), torch.float32))

    def _branch(self, w: WindowStepWeights, tail: Mamba2Tail | MambaTail) -> None:
        """in_proj, out_proj and the gate, shared by the two mamba tails."""
        self._set(w, "in_weight", tail.in_weight, (w.in_rows, self.d_in), "[in_rows, d_in]")
        self._set(w, "in_bias", tail.in_bias, (w.in_rows,), "[in_rows]", optional=True)
        self._set(w, "out_weight", tail.out_weight, (self.d_out, w.branch_width), "[H D, width]")
        self._set(w, "out_bias", tail.out_bias, (self.d_out,), "[H D]", optional=True)
        self._set(w, "gate", tail.gate, (self.d_out,), "[H D]")

    def _linear(self, w: WindowStepWeights, tail: LinearTail) -> None:
        half = tail.feature_map.shape[-1] if isinstance(tail.feature_map, Tensor) and tail.feature_map.dim() == 3 else 0
        w.feature_dim = half
        self._set(w, "feature_map", tail.feature_map, (self.groups, self.dim, half), "[G, D, F / 2]")
        self._set(w, "log_alpha", tail.log_alpha, (self.heads,), "[H]")
        self._set(w, "gate", tail.gate, (self.heads,), "[H]")
        self.state_shapes.update(tail_kv=((self.groups, 2 * half, self.dim), torch.float32),
                                 tail_k=((self.groups, 2 * half), torch.float32))

    def _set(self, w: WindowStepWeights, field: str, tensor: Tensor | None, shape: tuple, layout: str,
             optional: bool = False) -> None:
        """Check one weight, convert it to the activations' dtype, keep it, store its address."""
        if tensor is None and optional:
            return
        kernels.check(OP, field, tensor, shape, layout)
        tensor = kernels.prepare(tensor.detach(), self.dtype)
        self._tensors.append(tensor)
        setattr(w, field, tensor.data_ptr())

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, state: dict[str, Tensor]) -> Tensor:
        """x `[B, d_in]`, cos and sin `[B or 1, D]`, the state as `window_step_naive`'s -> `[B, H D]`."""
        x, cos, sin = token_inputs(x, cos, sin, self.dtype, self.d_in, self.dim)
        batch = x.shape[0]
        address = {name: _state(state, name, (batch, *shape), dtype) for name, (shape, dtype) in self.state_shapes.items()}
        out = x.new_empty(batch, self.d_out)
        kernels.run(
            OP, self.lib.rf_window_step, ctypes.addressof(self.weights), x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            out.data_ptr(), address["keys"], address["values"], address["index"], address.get("conv"),
            address.get("ssm"), address.get("tail_kv"), address.get("tail_k"), batch, cos.shape[0],
            torch.get_num_threads(),
        )
        return out


def window_step_compiled(x: Tensor, cos: Tensor, sin: Tensor, state: dict[str, Tensor], window: WindowWeights,
                         tail: Tail = None) -> Tensor:
    """`window_step_naive` in one compiled call; arguments and results as there."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{OP}: x must be a tensor, got {type(x).__name__}")
    return WindowStepKernel(window, tail, x.dtype)(x, cos, sin, state)


def token_inputs(x: Tensor, cos: Tensor, sin: Tensor, dtype: torch.dtype, d_in: int, dim: int,
                 op: str = OP) -> tuple[Tensor, Tensor, Tensor]:
    """x `[B, d_in]`, cos and sin `[B or 1, dim]`, checked (CPU, `dtype`) and contiguous;
    one-line errors otherwise. The decode steps' per-token check, so kept cheap."""
    if not (isinstance(x, Tensor) and x.dim() == 2 and x.shape[1] == d_in and x.dtype is dtype and x.is_cpu):
        kernels.check(op, "x", x, None)
        raise ValueError(f"{op}: x must be a CPU {dtype} tensor [B, {d_in}], got {x.dtype} {list(x.shape)}")
    batch = x.shape[0]
    for name, t in (("cos", cos), ("sin", sin)):
        if not (isinstance(t, Tensor) and t.dim() == 2 and t.shape[0] in (1, batch) and t.shape[1] == dim and t.is_cpu):
            raise ValueError(f"{op}: {name} must be a CPU tensor [1 or {batch}, {dim}], got {_describe(t)}")
    if cos.shape[0] != sin.shape[0]:
        raise ValueError(f"{op}: cos and sin must have the same rows, got {cos.shape[0]} and {sin.shape[0]}")
    return kernels.prepare(x, dtype), kernels.prepare(cos, dtype), kernels.prepare(sin, dtype)


def _state(state: dict[str, Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The address of `state[name]` after checking it: a contiguous CPU tensor (it is
    written in place) of `shape` and `dtype`; one-line errors otherwise."""
    tensor = state.get(name)
    if isinstance(tensor, Tensor) and tensor.dtype is dtype and tensor.shape == shape and tensor.is_cpu and tensor.is_contiguous():
        return tensor.data_ptr()
    if not isinstance(tensor, Tensor):
        raise ValueError(f"{OP}: the state has no tensor {name!r}")
    if tensor.dtype is not dtype:
        raise TypeError(f"{OP}: state {name} must be {dtype}, got {tensor.dtype}")
    if tensor.shape != shape:
        raise ValueError(f"{OP}: state {name} must have shape {list(shape)}, got {list(tensor.shape)}")
    raise ValueError(f"{OP}: state {name} must be a contiguous CPU tensor (it is updated in place)")


def _columns(tensor, name: str, rows: bool = False) -> int:
    """The second (or, `rows`, the first) size of a 2-d tensor argument; one-line error otherwise."""
    if not isinstance(tensor, Tensor) or tensor.dim() != 2:
        raise ValueError(f"{OP}: {name} must be a 2-d tensor, got {_describe(tensor)}")
    return tensor.shape[0 if rows else 1]


def _describe(value) -> str:
    return f"shape {list(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
