"""`attention_hook`: the one way the package runs a model's attention through its own function."""

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_model
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import repeat_kv

from recurformer.attention_hook import attention_hook


def recording(calls: list, label: str):
    """Causal attention (unpadded text) that appends (`label`, layer) to `calls` at each layer."""
    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        calls.append((label, module.layer_idx))
        size = module.num_key_value_groups
        out = F.scaled_dot_product_attention(query, repeat_kv(key, size), repeat_kv(value, size), is_causal=True,
                                             scale=scaling)
        return out.transpose(1, 2), None
    return attention


def test_the_hook_runs_every_layer_and_gives_the_same_output():
    model, tokens, calls = tiny_model("llama", "eager"), torch.randint(0, 97, (1, 12)), []
    with torch.no_grad():
        expected = model(tokens).logits
        with attention_hook(model, recording(calls, "hook")):
            torch.testing.assert_close(model(tokens).logits, expected)
    assert calls == [("hook", 0), ("hook", 1)]


def test_hooks_nest_and_leave_nothing_behind():
    model, tokens, calls = tiny_model("llama", "sdpa"), torch.randint(0, 97, (1, 12)), []
    registered = set(ALL_ATTENTION_FUNCTIONS)
    with torch.no_grad(), attention_hook(model, recording(calls, "outer")):
        with attention_hook(model, recording(calls, "inner")):
            model(tokens)
        model(tokens)
    assert [label for label, _ in calls] == ["inner", "inner", "outer", "outer"]
    assert model.config._attn_implementation == "sdpa"
    assert set(ALL_ATTENTION_FUNCTIONS) == registered


def test_the_model_is_restored_when_the_block_raises():
    model = tiny_model("llama", "sdpa")
    with pytest.raises(RuntimeError, match="stop"), attention_hook(model, recording([], "hook")):
        raise RuntimeError("stop")
    assert model.config._attn_implementation == "sdpa"
