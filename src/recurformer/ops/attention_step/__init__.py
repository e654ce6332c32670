"""The decode step of a layer's kept heads: q/k/v projections, RoPE, the token's key and
value appended to the K/V cache buffers, softmax attention over the cache. Two
implementations with one signature: `naive` (PyTorch, the oracle) and `compiled` (one C++
call, CPU, the attention split along the cache over the threads); `AttentionStepKernel`
is the compiled one with its weights checked once. Where the kernels are not built,
`HybridAttention` runs its PyTorch path (docs/method.md, "The decode step").
"""

from .compiled import AttentionStepKernel, attention_step_compiled
from .naive import AttentionWeights, attention_step_naive

__all__ = ["AttentionStepKernel", "AttentionWeights", "attention_step_compiled", "attention_step_naive"]
