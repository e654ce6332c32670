"""The q/k/v projections a fused decode step reads: the kept heads' (`attention_step`) and
a window mixer's (`window_step`) share this layout."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class HeadProjections:
    """q_weight `[H D, d_in]`, k_weight and v_weight `[G D, d_in]`, their biases `[rows]` or
    None; H = `heads` query heads over G = `kv_heads` KV groups (query head h reads group
    h // (H / G)). The tensors are the module's parameters, not copies."""

    q_weight: Tensor
    q_bias: Tensor | None
    k_weight: Tensor
    k_bias: Tensor | None
    v_weight: Tensor
    v_bias: Tensor | None
    heads: int
    kv_heads: int

    @property
    def head_dim(self) -> int:
        return self.q_weight.shape[0] // self.heads
