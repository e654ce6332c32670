"""benchmarks/speed/decode_profile.py on tiny models: a left-padded batch decodes by parts
that add up to the step, from a prefill or from caches filled at random."""

import pytest
import torch
from benchmark_scripts import benchmark_script
from tiny_models import MIXERS, spec_for, tiny_model

from recurformer.surgery import convert


@pytest.mark.parametrize("fill", ["prefill", "random"])
def test_a_batch_profiles_by_parts_that_add_up_to_its_step(fill):
    original = tiny_model("llama").eval()
    converted = convert(tiny_model("llama"), spec_for(original, 0.5), MIXERS["window+mamba2"], init="random").eval()
    contenders = {"dynamic": (original, "dynamic"), "static": (original, "static"), "converted": (converted, "hybrid")}
    with benchmark_script("speed.decode_profile") as module:
        rows = module.profile(contenders, context=24, steps=3, warmup=1, progress=lambda line: None, batch=3, fill=fill)
        step = module.Decoder(converted, "hybrid", context=24, steps=1, batch=3, fill=fill).step()
    assert set(rows) == set(contenders)
    assert all(row["total"] > 0 for row in rows.values())
    assert rows["converted"][module.STEP] > 0 and rows["static"][module.STEP] == 0
    assert sum(step[part] for part in module.PARTS) == pytest.approx(step["total"], rel=1e-9)  # medians do not add up


def test_filling_at_random_holds_the_prompts_tokens_in_every_cache():
    original = tiny_model("llama").eval()
    converted = convert(tiny_model("llama"), spec_for(original, 0.5), MIXERS["window+mamba2"], init="random").eval()
    with benchmark_script("speed.decode_profile") as module:
        for model, kind in ((original, "dynamic"), (original, "static"), (converted, "hybrid")):
            decoder = module.Decoder(model, kind, context=20, steps=2, batch=2, fill="random")
            assert decoder.cache.get_seq_length() == 20, kind
            decoder.step()
            assert decoder.cache.get_seq_length() == 21 and decoder.mask.shape == (2, 21), kind
    states = [layer.mixer_state for layer in decoder.cache.layers if layer.mixer_state is not None]
    assert states and all(t.shape[0] == 2 for state in states for t in state.values())
    rings = [state["window.index"] for state in states]  # window+mamba2: sinks + window slots, each a position
    assert rings and all(bool((ring >= 0).all()) and ring.max() == 20 for ring in rings)  # full after 20 + 1 tokens
    kept = [layer.keys for layer in decoder.cache.layers if layer.keys is not None and layer.keys.shape[1] > 0]
    assert kept and all(k.shape[0] == 2 and torch.isfinite(k).all() for k in kept)


def test_full_rings_hold_the_positions_a_prefill_leaves_in_them():
    converted = convert(tiny_model("llama"), spec_for(tiny_model("llama"), 0.5), MIXERS["window+mamba2"], init="random").eval()
    with benchmark_script("speed.decode_profile") as module:
        prefilled = module.Decoder(converted, "hybrid", context=40, steps=1, batch=1, fill="prefill")
        filled = module.Decoder(converted, "hybrid", context=40, steps=1, batch=1, fill="random")
    for real, made in zip(prefilled.cache.layers, filled.cache.layers):
        if real.mixer_state is not None:
            assert torch.equal(real.mixer_state["window.index"], made.mixer_state["window.index"])
