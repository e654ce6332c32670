import json

import pytest
import torch
from tiny_models import MIXERS, keeps_state, open_gates, spec_for, tiny_model
from transformers import AutoModelForCausalLM, DynamicCache, GPT2Config, GPT2LMHeadModel

import recurformer  # noqa: F401  (registers the Auto classes)
from recurformer.attention import packed_decode_attention
from recurformer.cache import CACHE_ARGUMENT, HybridCache
from recurformer.config import ConfigError, ReplacementSpec
from recurformer.mixers import MixerConfig
from recurformer.modeling import UnsupportedArchitectureError
from recurformer.surgery import convert, parameter_report


def logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, use_cache=False, **kwargs).logits


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_converting_zero_groups_reproduces_the_original(arch, attn):
    model = tiny_model(arch, attn)
    converted = convert(model, spec_for(model, 0.0))
    ids = torch.randint(0, 97, (2, 37))
    assert (logits(converted, ids) - logits(model, ids)).abs().max() <= 1e-5


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("beta", [0.5, 1.0])
def test_a_window_longer_than_the_sequence_reproduces_the_original(arch, attn, beta):
    """The window mixer is the replaced heads themselves, restricted to a window: with the
    window (and sinks) covering the whole sequence nothing changes."""
    model = tiny_model(arch, attn)
    converted = convert(model, spec_for(model, beta), MixerConfig(kind="window", window=64, sinks=3))
    ids = torch.randint(0, 97, (2, 64))
    assert (logits(converted, ids) - logits(model, ids)).abs().max() <= 1e-5


# Every (beta, prompt) pair for mamba; for mamba2 and window every beta and every prompt
# length once; for every other registered kind the shortest and the longest prompt, to keep
# the suite fast.
DECODE_CASES = [("mamba", beta, prompt) for beta in (0.25, 0.5, 1.0) for prompt in (1, 63, 300)] + [
    (mixer, beta, prompt) for mixer in ("mamba2", "window") for beta, prompt in ((0.25, 63), (0.5, 1), (0.5, 300), (1.0, 63))
] + [(mixer, beta, prompt) for mixer in sorted(set(MIXERS) - {"mamba", "mamba2", "window"})
     for beta, prompt in ((0.5, 1), (1.0, 300))]


@pytest.mark.parametrize("mixer, beta, prompt", DECODE_CASES)
def test_forward_equals_prefill_then_decode(arch, mixer, beta, prompt):
    model = tiny_model(arch)
    converted = open_gates(convert(model, spec_for(model, beta), MIXERS[mixer], init="random"))
    ids = torch.randint(0, 97, (2, prompt + 20))
    full = logits(converted, ids)
    with torch.no_grad():
        cache = HybridCache(model.config.num_hidden_layers)
        steps = [converted(ids[:, :prompt], **{CACHE_ARGUMENT: cache}, use_cache=True).logits]
        for t in range(prompt, ids.shape[1]):
            steps.append(converted(ids[:, t:t + 1], **{CACHE_ARGUMENT: cache}, use_cache=True).logits)
    assert cache.get_seq_length() == ids.shape[1]
    assert (torch.cat(steps, 1) - full).abs().max() <= 1e-4


@pytest.mark.parametrize("mixer", sorted(MIXERS))
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_left_padded_batch_equals_each_prompt_alone(arch, attn, mixer):
    model = tiny_model(arch, attn)
    converted = open_gates(convert(model, spec_for(model, 0.5), MIXERS[mixer], init="random"))
    prompts = [torch.randint(1, 97, (n,)) for n in (23, 9, 1)]
    width, decode = max(len(p) for p in prompts), 6
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    new_tokens = torch.randint(1, 97, (len(prompts), decode))
    with torch.no_grad():
        cache = HybridCache(2)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        batched = [converted(ids, attention_mask=mask, position_ids=positions, **{CACHE_ARGUMENT: cache}).logits[:, -1:]]
        for t in range(decode):
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=torch.long)], 1)
            position = positions[:, -1:] + 1 + t
            step = converted(new_tokens[:, t:t + 1], attention_mask=mask, position_ids=position, **{CACHE_ARGUMENT: cache})
            batched.append(step.logits)
        batched = torch.cat(batched, 1)
        for i, p in enumerate(prompts):
            alone = logits(converted, torch.cat([p, new_tokens[i]])[None])[:, len(p) - 1:]
            assert (batched[i] - alone[0]).abs().max() <= 1e-4, f"row {i}"


@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_generate_equals_manual_greedy_loop(arch, mixer):
    model = tiny_model(arch)
    converted = open_gates(convert(model, spec_for(model, 0.5), MIXERS[mixer], init="random"))
    converted.generation_config.eos_token_id = None  # all 15 tokens, whichever are drawn (the loop below has no EOS)
    ids = torch.randint(1, 97, (1, 12))
    out = converted.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=15, do_sample=False, pad_token_id=0)
    manual = ids
    for _ in range(15):
        manual = torch.cat([manual, logits(converted, manual)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, manual)


def test_generate_batched_left_padding_and_sampling():
    model = tiny_model("llama")
    converted = convert(model, spec_for(model, 0.5), init="random")
    prompts = [torch.randint(1, 97, (n,)) for n in (10, 4)]
    ids = torch.zeros(2, 10, dtype=torch.long)
    mask = torch.zeros(2, 10, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, 10 - len(p):], mask[i, 10 - len(p):] = p, 1
    out = converted.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    for i, p in enumerate(prompts):
        alone = converted.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(out[i, 10:], alone[0, len(p):])
    torch.manual_seed(0)
    sampled = converted.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=5, pad_token_id=0)
    assert sampled.shape == (2, 18)


SAVED_MIXERS = {
    **MIXERS,  # every registered kind; those below with values other than their defaults
    "mamba": MixerConfig(kind="mamba", d_state=4, expand=2.0),
    "mamba2": MixerConfig(kind="mamba2", ssd_state=6, ssd_chunk=8, ssd_norm=False),
    "window": MixerConfig(kind="window", window=7, sinks=1),
    "window+mamba": MixerConfig(kind="window+mamba", window=5, sinks=0, d_state=4),
    "window+mamba2": MixerConfig(kind="window+mamba2", window=7, sinks=1, ssd_state=6, ssd_chunk=8, ssd_norm=False),
    "window+linear": MixerConfig(kind="window+linear", window=6, sinks=2, feature_dim=3),
}


@pytest.mark.parametrize("mixer", sorted(SAVED_MIXERS))
def test_save_and_load_round_trip(arch, mixer, tmp_path):
    model = tiny_model(arch)
    converted = open_gates(convert(model, spec_for(model, 0.5), SAVED_MIXERS[mixer]))
    converted.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(converted)
    assert loaded.spec == converted.spec
    assert loaded.config.mixer_config() == SAVED_MIXERS[mixer]
    ids = torch.randint(0, 97, (2, 30))
    assert torch.equal(logits(loaded, ids), logits(converted, ids))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.pop("replacement"), "no 'replacement' spec"),
        (lambda c: c["replacement"].update(num_kv_heads=7), "replacement spec is for"),
        (lambda c: c["replacement"]["groups"].append([5, 0]), "layer 5 out of range"),
        (lambda c: c["mixer"].update(d_state=-3), "d_state"),
    ],
)
def test_loading_a_bad_spec_fails_clearly(tmp_path, edit, message):
    model = tiny_model("llama")
    convert(model, spec_for(model, 0.5)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_a_model_saved_before_the_new_mixers_loads(tmp_path):
    """Configs saved with only the Mamba fields get the new fields' defaults."""
    model = tiny_model("llama")
    converted = convert(model, spec_for(model, 0.5), MixerConfig(d_state=4))
    converted.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    old_fields = {"kind", "d_state", "d_conv", "expand", "dt_rank", "dt_min", "dt_max", "dt_init_floor", "conv_bias", "proj_bias", "scan_backend"}
    config["mixer"] = {k: v for k, v in config["mixer"].items() if k in old_fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.mixer_config() == MixerConfig(d_state=4)
    ids = torch.randint(0, 97, (1, 20))
    assert torch.equal(logits(loaded, ids), logits(converted, ids))


CACHE_CASES = [("mamba", beta) for beta in (0.25, 0.5, 1.0)] + [
    ("mamba2", 0.5), ("window", 0.5), ("window", 1.0), ("window+mamba", 0.5), ("window+mamba2", 1.0), ("window+linear", 0.5)
] + [(mixer, 0.5) for mixer in sorted(set(MIXERS) - {"mamba", "mamba2", "window", "window+mamba", "window+mamba2",
                                                      "window+linear"})]


@pytest.mark.parametrize("mixer, beta", CACHE_CASES)
def test_cache_bytes(arch, mixer, beta):
    model = tiny_model(arch)
    spec = spec_for(model, beta)
    converted = open_gates(convert(model, spec, MIXERS[mixer], init="random"))
    state_bytes = set()
    for length in (40, 200):
        ids = torch.randint(0, 97, (2, length))
        with torch.no_grad():
            original = model(ids, **{CACHE_ARGUMENT: DynamicCache()}, use_cache=True)[CACHE_ARGUMENT]
            hybrid = converted(ids, use_cache=True)[CACHE_ARGUMENT]
        original_kv = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v, _ in original)
        kept = 1 - spec.fraction
        assert hybrid.nbytes()["kv"] == kept * original_kv
        state_bytes.add(hybrid.nbytes()["mixer_state"])
    assert len(state_bytes) == 1
    if mixer == "window":  # per layer: keys and values of (sinks + window) tokens, and their positions
        slots = MIXERS["window"].window + MIXERS["window"].sinks
        head_dim = converted.hybrid_attentions()[0].head_dim
        replaced = [len(spec.replaced_heads(l)) for l in range(spec.num_layers)]
        assert state_bytes == {sum(2 * (2 * slots * g * head_dim * 4 + slots * 8) for g in replaced if g)}
    # the cache holds exactly the states the mixers allocate
    declared = sum(t.numel() * t.element_size() for attention in converted.hybrid_attentions() if attention.mixer
                   for t in attention.mixer.allocate_state(2, torch.float32, "cpu").values())
    assert state_bytes == {declared} and (declared > 0) == (beta > 0 and keeps_state(mixer))


def test_a_plain_dynamic_cache_is_refused():
    model = tiny_model("llama")
    converted = convert(model, spec_for(model, 0.5))
    with pytest.raises(TypeError, match="HybridCache"):
        converted(torch.randint(0, 97, (1, 5)), past_key_values=DynamicCache(), use_cache=True)


def test_the_cache_is_taken_under_either_name_and_returned_filled():
    """transformers 5.24 renamed the cache argument `past_key_values` to `cache`: the model
    takes it under both names (and a model built without it returns its own), and fills it."""
    model = tiny_model("llama")
    converted = convert(model, spec_for(model, 0.5), MixerConfig(kind="window+mamba"))
    ids = torch.randint(0, 97, (1, 5))
    reference = converted(ids, use_cache=True)
    for name in ("cache", "past_key_values"):
        cache = HybridCache(model.config.num_hidden_layers)
        out = converted(ids, use_cache=True, **{name: cache})
        assert out[CACHE_ARGUMENT] is cache
        assert torch.equal(out.logits, reference.logits)
        assert cache.get_seq_length() == 5 and cache.nbytes() == reference[CACHE_ARGUMENT].nbytes()
        assert cache.nbytes()["mixer_state"] > 0 and cache.nbytes()["kv"] > 0
    with pytest.raises(ValueError, match="not both"):
        converted(ids, use_cache=True, cache=HybridCache(2), past_key_values=HybridCache(2))


def test_unsupported_architecture_lists_the_supported_ones():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50))
    with pytest.raises(UnsupportedArchitectureError, match="llama, qwen2, mistral"):
        convert(gpt2, ReplacementSpec(1, 2, []))


def test_clipped_qkv_is_refused():
    """OLMo's `clip_qkv` clamps q, k and v: not Llama's attention, which the converted layers
    compute (an empty spec would no longer give the original's logits)."""
    model = tiny_model("llama")
    model.config.clip_qkv = 8.0
    with pytest.raises(UnsupportedArchitectureError, match="llama with clip_qkv=8.0: clipped q/k/v is not Llama's"):
        convert(model, ReplacementSpec(2, 2, []))


def test_spec_for_another_shape_is_refused():
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match="3 layers x 2 KV heads"):
        convert(model, ReplacementSpec(3, 2, []))


@pytest.mark.parametrize(
    "data, message",
    [
        ({"num_layers": 2, "num_kv_heads": 2, "groups": [[0, 2]]}, "kv_head 2 of layer 0 out of range"),
        ({"num_layers": 2, "num_kv_heads": 2, "groups": [[0, 1], [0, 1]]}, "duplicate"),
        ({"num_layers": 2, "num_kv_heads": 2, "groups": [["a", 1]]}, "pair of integers"),
        ({"num_layers": 2, "groups": []}, "missing field.*num_kv_heads"),
        ({"num_layers": 2, "num_kv_heads": 2, "groups": [], "beta": 1}, "unknown field.*beta"),
    ],
)
def test_spec_validation_names_the_problem(data, message):
    with pytest.raises(ConfigError, match=message):
        ReplacementSpec.from_dict(data)


def test_spec_json_round_trip():
    spec = ReplacementSpec(4, 3, [(3, 1), (0, 2)], source={"scorer": "recency", "beta": 0.2})
    again = ReplacementSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec and again.groups == [(0, 2), (3, 1)]


def test_reuse_init_copies_values_and_differs_from_random():
    model = tiny_model("llama")
    spec = ReplacementSpec(2, 2, [(0, 1)])
    mamba = MixerConfig(kind="mamba")
    reused = convert(model, spec, mamba, init="reuse").model.layers[0].self_attn.mixer
    random_init = convert(model, spec, mamba, init="random").model.layers[0].self_attn.mixer
    v_rows = model.model.layers[0].self_attn.v_proj.weight[12:24]  # KV head 1, head_dim 12
    assert torch.equal(reused.in_proj.weight[:12], v_rows)
    assert torch.equal(reused.in_proj.weight[12:24], v_rows)  # the group's second query head
    assert not torch.equal(random_init.in_proj.weight[:12], v_rows)


def test_parameter_report():
    model = tiny_model("llama")
    converted = convert(model, spec_for(model, 0.5))
    report = parameter_report(model, converted)
    assert report["original_total"] == sum(p.numel() for p in model.parameters())
    assert report["converted_attention"] == report["original_attention"] - 2 * (48 * 24 + 2 * 48 * 12)
    assert report["converted_total"] == report["original_total"] - report["original_attention"] + report["converted_attention"] + report["converted_mixer"]


def test_importing_the_package_alone_registers_the_auto_classes(tmp_path):
    import subprocess
    import sys

    model = tiny_model("llama")
    convert(model, spec_for(model, 0.5)).save_pretrained(tmp_path)
    code = (
        "import recurformer\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})\n"
        "print(type(m).__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "RecurFormerForCausalLM", result.stderr[-500:]


@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_beam_search_with_the_cache_equals_without(arch, mixer):
    """Beam search reorders the cache (K/V buffers and mixer states); recomputing every step
    without a cache must give the same beams."""
    model = tiny_model(arch)
    converted = open_gates(convert(model, spec_for(model, 0.5), MIXERS[mixer], init="random"))
    ids = torch.randint(1, 97, (2, 7))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    assert torch.equal(converted.generate(ids, use_cache=True, **kwargs), converted.generate(ids, use_cache=False, **kwargs))


def test_kv_buffers_grow_by_blocks():
    model = tiny_model("llama")
    converted = convert(model, spec_for(model, 0.5), init="random")
    with torch.no_grad():
        cache = converted(torch.randint(0, 97, (1, 300)), use_cache=True)[CACHE_ARGUMENT]
    sizes = cache.nbytes()
    per_token = sizes["kv"] / 300
    assert sizes["kv_reserved"] == per_token * 512  # 300 tokens -> two blocks of 256
    assert sizes["total"] == sizes["kv"] + sizes["mixer_state"]


def storage(cache, kv: bool = True) -> list[int]:
    """The data address of every mixer-state tensor of `cache` and (`kv`) every K/V buffer."""
    tensors = []
    for layer in cache.layers:
        tensors += [*(layer.mixer_state or {}).values(), *((layer._key_buffer, layer._value_buffer) if kv else ())]
    return [t.data_ptr() for t in tensors]


@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_decode_steps_write_into_the_buffers_they_have(mixer):
    """Within the reserved block a decode step neither reallocates nor concatenates: every
    buffer and state tensor keeps its storage, and `keys` is a view of the K/V buffer. The
    step past the block grows the K/V buffers, and only them."""
    model = tiny_model("llama")
    converted = open_gates(convert(model, spec_for(model, 0.5), MIXERS[mixer], init="random"))
    with torch.no_grad():
        cache = converted(torch.randint(0, 97, (2, 250)), use_cache=True)[CACHE_ARGUMENT]
        before, state = storage(cache), storage(cache, kv=False)
        for _ in range(6):  # 250 + 6 = 256 tokens: the first block, full
            converted(torch.randint(0, 97, (2, 1)), **{CACHE_ARGUMENT: cache}, use_cache=True)
        assert storage(cache) == before
        layer = next(layer for layer in cache.layers if layer.keys.shape[1] > 0)
        assert layer.keys.data_ptr() == layer._key_buffer.data_ptr() and layer.keys.shape[-2] == 256
        converted(torch.randint(0, 97, (2, 1)), **{CACHE_ARGUMENT: cache}, use_cache=True)
    assert storage(cache, kv=False) == state
    assert layer._key_buffer.shape[-2] == 512 and layer.keys.shape[-2] == 257


@pytest.mark.parametrize("mixer", ["mamba", "window+linear"])
def test_beam_reorder_permutes_rows_in_place(mixer):
    model = tiny_model("llama")
    converted = open_gates(convert(model, spec_for(model, 0.5), MIXERS[mixer], init="random"))
    with torch.no_grad():
        cache = converted(torch.randint(0, 97, (3, 20)), use_cache=True)[CACHE_ARGUMENT]
    before = storage(cache)
    rows = [(layer.keys.clone(), {k: t.clone() for k, t in layer.mixer_state.items()}) for layer in cache.layers]
    order = torch.tensor([2, 0, 0])
    cache.reorder_cache(order)
    assert storage(cache) == before
    for layer, (keys, state) in zip(cache.layers, rows):
        assert torch.equal(layer.keys, keys[order])
        for name, t in state.items():
            assert torch.equal(layer.mixer_state[name], t[order]), name


@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_crop_is_refused_once_a_mixer_state_exists(mixer):
    model = tiny_model("llama")
    converted = open_gates(convert(model, spec_for(model, 0.5), MIXERS[mixer], init="random"))
    with torch.no_grad():
        cache = converted(torch.randint(0, 97, (1, 10)), use_cache=True)[CACHE_ARGUMENT]
    with pytest.raises(ValueError, match="cannot be rolled back"):
        cache.crop(5)


@pytest.mark.parametrize("masked", [False, True])
def test_packed_decode_attention_equals_grouped_query_attention(masked):
    """A KV group's query heads packed as its queries give each head's own attention."""
    batch, heads, groups, length, dim = 3, 6, 2, 11, 8
    q, k, v = torch.randn(batch, heads, 1, dim), torch.randn(batch, groups, length, dim), torch.randn(batch, groups, length, dim)
    mask = torch.rand(batch, 1, 1, length) > 0.3 if masked else None
    if masked:
        mask[..., -1] = True
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    out = packed_decode_attention(q, k, v, mask, 0.3)
    assert out.shape == (batch, 1, heads, dim)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-6, rtol=1e-5)
