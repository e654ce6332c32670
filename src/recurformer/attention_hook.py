"""`attention_hook`: run a model's attention layers through a function of ours for a while.

transformers picks each attention layer's function by name from its attention registry
(`config._attn_implementation`). Inside `with attention_hook(model, fn):` that name is a
fresh one registered for `fn`; on leaving, the model's previous implementation is back and
the name is gone. Hooks nest: an inner one replaces the outer one until it ends.

`fn` has the signature of transformers' attention functions:
`fn(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs)` with query
`[B, H, T, D]`, key and value `[B, Hkv, T, D]`, returning (output `[B, T, H, D]`, weights
or None).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

_names = itertools.count()  # makes each hook's registered name unique


@contextmanager
def attention_hook(model, function: Callable) -> Iterator[None]:
    """Within the block every attention layer of `model` computes with `function`."""
    name = f"recurformer_hook_{next(_names)}"
    ALL_ATTENTION_FUNCTIONS[name] = function
    previous = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        yield
    finally:
        model.config._attn_implementation = previous
        del ALL_ATTENTION_FUNCTIONS[name]
