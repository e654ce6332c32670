"""Token eviction on the kept heads (`recurformer.eviction`): each press scores as its formula
says, an eviction keeps the best-scored tokens and leaves the mixer state, and a stream fed in
chunks with nothing to evict is the full forward."""

import pytest
import torch
import torch.nn.functional as F
from tiny_models import MIXERS, open_gates, spec_for, tiny_model
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from recurformer import convert
from recurformer.cache import CACHE_ARGUMENT, HybridCache
from recurformer.config import ConfigError
from recurformer.eviction import PRESSES, SNAP_WINDOW, Eviction, as_hybrid, average_rope, score


def ids(length: int, seed: int = 1) -> list[int]:
    return torch.randint(1, 97, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def feed(model, tokens: list[int], chunk: int, eviction=None) -> tuple[torch.Tensor, HybridCache]:
    """Logits `[T, V]` of `tokens` fed `chunk` at a time at their positions, evicting after each."""
    cache, out = HybridCache(model.config.text_config.num_hidden_layers), []
    with torch.no_grad():
        for start in range(0, len(tokens), chunk):
            piece = tokens[start:start + chunk]
            logits = model(input_ids=torch.tensor([piece]), position_ids=torch.arange(start, start + len(piece))[None],
                           use_cache=True, **{CACHE_ARGUMENT: cache}).logits[0]
            out.append(logits)
            if eviction is not None:
                eviction(cache, start + len(piece))
    return torch.cat(out), cache


def rotated_keys(module, hidden, embeddings):
    keys = module.k_proj(hidden).view(1, hidden.shape[1], -1, module.head_dim).transpose(1, 2)
    return apply_rotary_pos_emb(keys, keys, *embeddings)[0]


def test_the_original_as_a_hybrid_is_the_original():
    original = tiny_model("llama")
    hybrid = as_hybrid(original)
    tokens = torch.tensor([ids(40)])
    with torch.no_grad():
        torch.testing.assert_close(hybrid(tokens).logits, original(tokens).logits, atol=1e-5, rtol=1e-5)
    assert as_hybrid(hybrid) is hybrid


def layer_inputs(model, tokens: list[int]) -> dict[int, tuple]:
    """Each attention layer's input `[1, T, hidden]` and position embeddings in a forward of `tokens`."""
    inputs = {}

    def remember(module, args, kwargs):
        inputs[module.layer_idx] = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0],
                                    kwargs["position_embeddings"])

    hooks = [m.register_forward_pre_hook(remember, with_kwargs=True) for m in model.hybrid_attentions()]
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]))
    for hook in hooks:
        hook.remove()
    return inputs


@pytest.mark.parametrize("name", ["snapkv", "tova"])
def test_window_scores_are_the_models_own_attention(name):
    """SnapKV and TOVA score keys by the attention the last queries pay them: the same weights
    the model computes (eager attention, weights returned), pooled as the press pools."""
    original = tiny_model("llama", attn_implementation="eager")
    model = as_hybrid(original)
    context = ids(90)
    inputs = layer_inputs(model, context)
    with torch.no_grad():
        attentions = original(torch.tensor([context]), output_attentions=True).attentions
    rotary = model.get_decoder().rotary_emb
    window = SNAP_WINDOW if name == "snapkv" else 1
    for module in model.hybrid_attentions():
        hidden, embeddings = inputs[module.layer_idx]
        keys = rotated_keys(module, hidden, embeddings)
        scores = score(name, module, hidden, keys, keys, embeddings, rotary, 90)
        weights = attentions[module.layer_idx][:, :, -window:, :-window].mean(dim=-2)  # [1, Hq, T - window]
        if name == "snapkv":
            weights = F.avg_pool1d(weights, 5, padding=2, stride=1)
            expected = weights.view(1, keys.shape[1], -1, 90 - window).mean(dim=2)
        else:
            expected = weights.mean(dim=1, keepdim=True).expand(1, keys.shape[1], 90 - window)
        torch.testing.assert_close(scores[..., :-window], expected, atol=1e-5, rtol=1e-4)
        assert bool((scores[..., -window:] > scores[..., :-window].max()).all())
        # the last 64 tokens' inputs, which an eviction remembers, give the same scores
        recent = (hidden[:, -64:], tuple(e[:, -64:] for e in embeddings))
        torch.testing.assert_close(score(name, module, *recent[:1], keys, keys, recent[1], rotary, 90), scores)


def test_an_eviction_remembers_the_last_64_tokens_fed_across_forwards():
    model = as_hybrid(tiny_model("llama"))
    tokens = ids(100)
    hook = Eviction(model, "tova", 200)
    feed(model, tokens, 30)
    full = layer_inputs(model, tokens)
    for layer, (hidden, (cos, sin)) in hook.inputs.items():
        assert hidden.shape[1] == 64
        torch.testing.assert_close(hidden, full[layer][0][:, -64:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cos, full[layer][1][0][:, -64:])
    hook.reset()
    assert not hook.inputs
    hook.remove()


def test_the_average_rope_is_the_mean_rotation():
    rotary = tiny_model("llama").get_decoder().rotary_emb
    vector = torch.randn(1, 1, 1, 12)  # [B, H, T, D]: the llama tiny model's head_dim
    rotation = average_rope(rotary, vector, 30, 7)
    cos, sin = rotary(vector, torch.arange(30, 37)[None])
    rotated, _ = apply_rotary_pos_emb(vector.expand(1, 1, 7, 12), vector.expand(1, 1, 7, 12), cos, sin)
    torch.testing.assert_close(vector[0, 0] @ rotation.T, rotated[0, 0].mean(dim=0, keepdim=True), atol=1e-5,
                               rtol=1e-5)


def test_key_scores_follow_their_formulas():
    """knorm: the negated key norm; keydiff: the negated cosine to the mean normalized key;
    streaming: the 4 sinks, then the most recent; expected-attention: its future positions
    start at the stream's position, not at the cache's length."""
    model = as_hybrid(tiny_model("llama"))
    module = model.hybrid_attentions()[0]
    keys, values = torch.randn(1, 2, 30, 12), torch.randn(1, 2, 30, 12)
    hidden = torch.randn(1, 8, model.config.text_config.hidden_size)
    rotary = model.get_decoder().rotary_emb
    embeddings = rotary(hidden, torch.arange(22, 30)[None])
    torch.testing.assert_close(score("knorm", module, hidden, keys, values, embeddings, rotary, 30), -keys.norm(dim=-1))
    anchor = (keys / keys.norm(dim=-1, keepdim=True)).mean(dim=2, keepdim=True)
    cosine = (keys * anchor).sum(-1) / (keys.norm(dim=-1) * anchor.norm(dim=-1))
    torch.testing.assert_close(score("keydiff", module, hidden, keys, values, embeddings, rotary, 30), -cosine)
    streaming = score("streaming", module, hidden, keys, values, embeddings, rotary, 30)
    assert streaming.topk(10, dim=-1).indices.sort(dim=-1).values[0, 0].tolist() == [0, 1, 2, 3, *range(24, 30)]
    here = score("expected-attention", module, hidden, keys, values, embeddings, rotary, 30)
    later = score("expected-attention", module, hidden, keys, values, embeddings, rotary, 3000)
    assert bool((here[..., :4] > here[..., 4:].max()).all()) and not torch.allclose(here, later)
    with pytest.raises(ConfigError, match="unknown press 'h2o'"):
        score("h2o", module, hidden, keys, values, embeddings, rotary, 30)


@pytest.mark.parametrize("name", PRESSES)
def test_an_eviction_keeps_the_best_scored_tokens_and_leaves_the_mixer_state(name):
    original = tiny_model("llama")
    model = open_gates(convert(original, spec_for(original, 0.5), MIXERS["window+mamba2"]))
    hook = Eviction(model, name, 70)
    _, cache = feed(model, ids(90), 90)
    before = [(layer.keys.clone(), layer.values.clone(), {k: v.clone() for k, v in (layer.mixer_state or {}).items()})
              for layer in cache.layers]
    inputs = dict(hook.inputs)
    assert hook(cache, 90)
    for module in model.hybrid_attentions():
        layer = cache.layers[module.layer_idx]
        keys, values, state = before[module.layer_idx]
        assert layer.get_seq_length() == 70 and layer.keys.shape[2] == 70
        assert all(torch.equal(layer.mixer_state[k], v) for k, v in state.items())
        if module.has_attention:
            hidden, embeddings = inputs[module.layer_idx]
            best = score(name, module, hidden, keys, values, embeddings, hook.rotary, 90).topk(70, dim=-1).indices
            best = best.sort(dim=-1).values[..., None].expand(-1, -1, -1, keys.shape[-1])
            assert torch.equal(layer.keys, keys.gather(2, best)) and torch.equal(layer.values, values.gather(2, best))
    assert not hook(cache, 90)  # nothing more to evict
    hook.remove()


@pytest.mark.parametrize("kind", ["original", "window+mamba2"])
def test_a_stream_fed_in_chunks_is_the_full_forward_when_nothing_is_evicted(kind):
    original = tiny_model("llama")
    model = as_hybrid(original) if kind == "original" else open_gates(
        convert(original, spec_for(original, 0.5), MIXERS[kind]))
    tokens = ids(100)
    with torch.no_grad():
        full = model(torch.tensor([tokens])).logits[0]
    hook = Eviction(model, "tova", 200)
    chunked, _ = feed(model, tokens, 16, hook)
    torch.testing.assert_close(chunked, full, atol=1e-4, rtol=1e-4)
    hook.remove()


def test_evicting_a_model_without_kept_heads_changes_nothing():
    """Every group replaced: the replaced heads' state is all there is, and eviction leaves it."""
    original = tiny_model("llama")
    model = open_gates(convert(original, spec_for(original, 1.0), MIXERS["window+mamba2"]))
    tokens = ids(100)
    plain, _ = feed(model, tokens, 16)
    hook = Eviction(model, "knorm", 20)
    evicted, _ = feed(model, tokens, 16, hook)
    torch.testing.assert_close(evicted, plain, atol=1e-5, rtol=1e-5)
    hook.remove()


def test_an_evicted_stream_attends_to_what_it_kept_at_its_true_positions():
    """After a streaming eviction to 4 sinks + 12 recent tokens, the next chunk's logits are
    those of a forward that sees only those tokens at their own positions (one layer: its keys
    depend on the token and its position only, so the kept cache can be rebuilt from them)."""
    model = as_hybrid(tiny_model("llama", num_hidden_layers=1))
    tokens = ids(48)
    hook = Eviction(model, "streaming", 16)
    chunked, cache = feed(model, tokens, 16, hook)  # evicts to 16 after the 2nd and 3rd chunks
    hook.remove()
    kept = [0, 1, 2, 3, *range(20, 32)]  # after the second chunk: sinks + the 12 most recent
    reference = HybridCache(model.config.text_config.num_hidden_layers)
    with torch.no_grad():
        model(input_ids=torch.tensor([[tokens[i] for i in kept]]), position_ids=torch.tensor([kept]), use_cache=True,
              **{CACHE_ARGUMENT: reference})
        expected = model(input_ids=torch.tensor([tokens[32:]]), position_ids=torch.arange(32, 48)[None],
                         use_cache=True, **{CACHE_ARGUMENT: reference}).logits[0]
    torch.testing.assert_close(chunked[32:], expected, atol=1e-5, rtol=1e-5)


def test_a_press_must_keep_something():
    model = as_hybrid(tiny_model("llama"))
    with pytest.raises(ConfigError, match="the streaming press must keep at least 5 tokens per head, got 4"):
        Eviction(model, "streaming", 4)
    with pytest.raises(ConfigError, match="the snapkv press must keep at least 65 tokens per head, got 64"):
        Eviction(model, "snapkv", 64)
    with pytest.raises(ConfigError, match="unknown press 'h2o'"):
        Eviction(model, "h2o", 10)
