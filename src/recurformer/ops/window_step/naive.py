"""The fused window step in plain PyTorch, written for clarity (one row and one head at a
time): the oracle of `window_step/compiled.py`.

It is the math of the window mixers' `step` (mixers/window.py, window_recurrent.py,
window_linear.py) with the heads taken one by one. Projections and RoPE run in the
activations' dtype, the softmax and the tail sums in fp32, the branch of window+mamba and
window+mamba2 as `ops/step`'s naive steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..rope import rotate
from ..step import mamba2_step_naive, mamba_step_naive
from .parts import LinearTail, Mamba2Tail, MambaTail, Tail, WindowWeights


def window_step_naive(x: Tensor, cos: Tensor, sin: Tensor, state: dict[str, Tensor], window: WindowWeights,
                      tail: Tail = None) -> Tensor:
    """One token through a window mixer (and its tail), the state updated in place.

    Args:
        x: the layer's normalized hidden state `[B, d_in]`.
        cos, sin: the token's rotary embedding `[B or 1, D]`.
        state: the ring buffer `keys`, `values` `[B, S, G, D]` (activations' dtype) and
            `index` `[B, S]` (int64, -1 for an empty slot), S = sinks + window; with a
            mamba tail also `conv` and `ssm`, with the linear tail `tail_kv` and `tail_k`.
        window, tail: the weights (`window_step.parts`).

    Returns:
        The mixer's output `[B, H D]` in the dtype of `x`.
    """
    batch, heads, groups, dim = x.shape[0], window.heads, window.kv_heads, window.head_dim
    q = rotate(F.linear(x, window.q_weight, window.q_bias).view(batch, heads, dim), cos, sin)
    k = rotate(F.linear(x, window.k_weight, window.k_bias).view(batch, groups, dim), cos, sin)
    v = F.linear(x, window.v_weight, window.v_bias).view(batch, groups, dim)
    keys, values, index = state["keys"], state["values"], state["index"]
    out = torch.empty(batch, heads, dim, dtype=torch.float32)
    for b in range(batch):
        position = int(index[b].max()) + 1  # the row's real tokens so far
        slot = position if position < window.sinks else window.sinks + (position - window.sinks) % window.window
        if isinstance(tail, LinearTail) and index[b, slot] >= window.sinks:  # its token leaves the window
            for g in range(groups):
                phi = _features(keys[b, slot, g].float(), tail.feature_map[g])
                state["tail_kv"][b, g] += phi[:, None] * values[b, slot, g].float()
                state["tail_k"][b, g] += phi
        keys[b, slot], values[b, slot], index[b, slot] = k[b].to(keys.dtype), v[b].to(values.dtype), position
        filled = index[b] >= 0
        for h in range(heads):
            g = h // (heads // groups)
            scores = (keys[b, filled, g].float() @ q[b, h].float()) * window.scaling
            weights = torch.exp(scores - scores.max())
            num, den = weights @ values[b, filled, g].float(), weights.sum()
            out[b, h] = num / den
            if isinstance(tail, LinearTail):
                phi = _features(q[b, h].float(), tail.feature_map[g])
                alpha = tail.log_alpha[h].float().exp()
                hybrid = (num + alpha * (phi @ state["tail_kv"][b, g])) / (den + alpha * (phi @ state["tail_k"][b, g]))
                out[b, h] += tail.gate[h].float() * (hybrid - out[b, h])
    out = out.reshape(batch, heads * dim).to(x.dtype)
    if isinstance(tail, Mamba2Tail):
        branch = mamba2_step_naive(
            F.linear(x, tail.in_weight, tail.in_bias), state["conv"], state["ssm"], tail.conv_weight, tail.conv_bias,
            tail.dt_bias, tail.A_log, tail.D, tail.norm_weight, tail.groups, tail.eps,
        )
    elif isinstance(tail, MambaTail):
        branch = mamba_step_naive(
            F.linear(x, tail.in_weight, tail.in_bias), state["conv"], state["ssm"], tail.conv_weight, tail.conv_bias,
            tail.x_proj_weight, tail.dt_proj_weight, tail.dt_proj_bias, tail.A_log, tail.D,
        )
    else:
        return out
    return out + tail.gate * F.linear(branch, tail.out_weight, tail.out_bias)



def _features(x: Tensor, feature_map: Tensor) -> Tensor:
    """window+linear's feature map of one vector `[D]` (fp32) with a group's map `[D, F / 2]` -> `[F]`."""
    projected = x @ feature_map.float()
    return torch.cat([projected.softmax(-1), (-projected).softmax(-1)])
