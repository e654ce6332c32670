"""Uneven eviction on the kept heads (`HybridLayer.keep_tokens` with counts, the kept-head
presses' `global` allocation): each head attends only the tokens it kept and those after them,
in every attention path (prefill over a cache, the packed decode step, eager attention)."""

import pytest
import torch
from benchmark_scripts import benchmark_script
from tiny_models import MIXERS, open_gates, spec_for, tiny_model, tiny_tokenizer

from recurformer import convert
from recurformer.cache import HybridCache
from recurformer.evaluate.generation import prefilled_answer


def hidden(tokens: int, size: int, seed: int) -> torch.Tensor:
    return torch.randn(1, tokens, size, generator=torch.Generator().manual_seed(seed))


def run(module, model, cache, states: torch.Tensor, start: int, mask=None) -> torch.Tensor:
    positions = torch.arange(start, start + states.shape[1])[None]
    embeddings = model.model.rotary_emb(states, positions)
    return module(states, embeddings, attention_mask=mask, cache=cache)[0]


def oracle(module, model, cache, states: torch.Tensor, start: int, kept: int, counts: torch.Tensor) -> torch.Tensor:
    """The layer's output, each query head attending by hand to its group's first `counts[g]`
    slots and to the `T` new tokens up to its own (the cache already holds their keys)."""
    layer = cache.layers[module.layer_idx]
    queries = states.shape[1]
    positions = torch.arange(start, start + queries)[None]
    cos, sin = model.model.rotary_emb(states, positions)
    q = module.q_proj(states).view(1, queries, -1, module.head_dim).transpose(1, 2)
    q = q * cos[:, None] + torch.cat([-q[..., module.head_dim // 2:], q[..., :module.head_dim // 2]], -1) * sin[:, None]
    outputs = []
    for head in range(q.shape[1]):
        group = head // module.num_key_value_groups
        rows = []
        for i in range(queries):
            slots = [j for j in range(int(counts[0, group]))] + list(range(kept, kept + i + 1))
            keys, values = layer.keys[0, group, slots], layer.values[0, group, slots]
            weights = (q[0, head, i] @ keys.T * module.scaling).softmax(-1)
            rows.append(weights @ values)
        outputs.append(torch.stack(rows))
    return module.o_proj(torch.stack(outputs, 1).reshape(1, queries, -1))


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("queries, masked", [(3, False), (3, True), (1, False)])
def test_each_head_attends_only_the_tokens_it_kept(implementation, queries, masked):
    original = tiny_model("llama", attn_implementation=implementation)
    model = convert(original, spec_for(original, 0.0), MIXERS["window"]).eval()
    module = model.hybrid_attentions()[0]
    size, context = model.config.text_config.hidden_size, 20
    cache = HybridCache(model.config.text_config.num_hidden_layers)
    with torch.no_grad():
        run(module, model, cache, hidden(context, size, 1), 0)
        heads = cache.layers[0].keys.shape[1]
        index = torch.stack([torch.randperm(context, generator=torch.Generator().manual_seed(h))[:8].sort().values
                             for h in range(heads)])[None]
        counts = torch.tensor([[8 - 3 * (h % 2) for h in range(heads)]])  # every other head keeps 5 of its 8 slots
        cache.layers[0].keep_tokens(index, counts)
        assert cache.layers[0].get_seq_length() == 8 and cache.layers[0].evicted[0, 1, 5:].all()
        states = hidden(queries, size, 2)
        mask = None
        if masked:  # transformers' bool mask of a prefill over a cache: True where a key is seen
            mask = torch.ones(queries, 8 + queries, dtype=torch.bool).tril(8)[None, None]
        got = run(module, model, cache, states, context, mask)
        expected = oracle(module, model, cache, states, context, 8, counts)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_equal_counts_hide_nothing():
    original = tiny_model("llama")
    model = convert(original, spec_for(original, 0.0), MIXERS["window"]).eval()
    cache = HybridCache(model.config.text_config.num_hidden_layers)
    with torch.no_grad():
        model(input_ids=torch.arange(1, 11)[None], cache=cache, use_cache=True)
    layer = cache.layers[0]
    heads = layer.keys.shape[1]
    layer.keep_tokens(torch.arange(6).expand(1, heads, 6), torch.full((1, heads), 6))
    assert layer.evicted is None and layer.attention_bias(8, torch.float32) is None
    with pytest.raises(ValueError, match="uneven"):
        layer.keep_tokens(torch.arange(6).expand(1, heads, 6), torch.tensor([[6] + [2] * (heads - 1)]))
        cache.make_static(16)


@pytest.fixture(scope="module")
def press():
    with benchmark_script("peers.kept_press") as module:
        yield module


def test_global_selection_ranks_every_heads_tokens_together(press):
    scores = {0: torch.tensor([[[9.0, 8, 7, 1], [0.5, 0.4, 6, 0.3]]]), 2: torch.tensor([[[5.0, 0.1, 0.2, 4]]])}
    chosen = press.global_selection(scores, kept=2)  # 2 per head on average: the best 6 of 12
    index, counts = chosen[0]
    assert counts.tolist() == [[3, 1]] and chosen[2][1].tolist() == [[2]]
    assert index.tolist() == [[[0, 1, 2], [2, 0, 1]]]  # the chosen first, in order, then the others
    assert chosen[2][0].tolist() == [[[0, 3, 1]]]
    assert press.global_selection(scores, kept=4)[0][1].tolist() == [[4, 4]]


def test_a_global_press_keeps_the_best_of_all_heads_on_average(press):
    original = tiny_model("llama")
    model = open_gates(convert(original, spec_for(original, 0.5), MIXERS["window+mamba2"]))
    context = torch.randint(1, 97, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    hook = press.KeptPress(model, "tova", 0.5, tiny_tokenizer(), allocation="global")
    cache = HybridCache(model.config.text_config.num_hidden_layers)
    with torch.no_grad():
        model(input_ids=torch.tensor([context]), cache=cache, use_cache=True)
    hook(cache, len(context))
    hook.remove()
    layers = [cache.layers[m.layer_idx] for m in model.hybrid_attentions()]
    widths = {layer.get_seq_length() for layer in layers}
    assert len(widths) == 1  # every layer counts the same past length
    kept = [layer.keys.shape[1] * widths.pop() - int(layer.evicted.sum()) if layer.evicted is not None
            else layer.keys.shape[1] * layer.keys.shape[2] for layer in layers]
    heads = sum(layer.keys.shape[1] for layer in layers)
    assert sum(kept) == 30 * heads
    question = [5, 6, 7, 8]
    compress = press.KeptPress(model, "tova", 1.0, tiny_tokenizer(), allocation="global")
    assert prefilled_answer(model, context, question, 3, eos=set(), compress=compress) == \
        prefilled_answer(model, context, question, 3, eos=set())
    with pytest.raises(ValueError, match="unknown allocation"):
        press.KeptPress(model, "snapkv", 0.5, allocation="layer")
