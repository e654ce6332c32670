"""The `window` rival at equal cache bytes (recurformer.equal_cache)."""

import pytest
import torch
from tiny_models import spec_for, tiny_model

from recurformer.config import ReplacementSpec
from recurformer.equal_cache import equal_cache_window, mixer_state_bytes, window_baseline
from recurformer.mixers import MixerConfig
from recurformer.surgery import convert


@pytest.mark.parametrize("kind", ["mamba", "mamba2", "window", "window+mamba2", "window+linear"])
def test_state_bytes_do_not_depend_on_the_length(kind):
    model = convert(tiny_model("llama"), spec_for(tiny_model("llama"), 0.5), MixerConfig(kind=kind, window=8, sinks=2))
    with torch.no_grad():
        long = model(torch.randint(0, 97, (1, 40)), use_cache=True).past_key_values.nbytes()["mixer_state"]
    assert mixer_state_bytes(model) == long > 0


def test_a_window_model_is_its_own_rival():
    original = tiny_model("qwen2")
    converted = convert(original, spec_for(original, 0.5), MixerConfig(kind="window", window=24, sinks=2))
    assert equal_cache_window(original, converted) == 24


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_the_rival_holds_the_same_bytes_on_the_same_groups(arch):
    original = tiny_model(arch)
    converted = convert(original, spec_for(original, 0.5), MixerConfig(kind="window+mamba2", window=8, sinks=2),
                        source_model="somewhere/original")
    rival, window = window_baseline(original, converted)
    assert window > 8  # the tail's state buys a longer window
    config = MixerConfig.from_dict(rival.config.mixer)
    assert (config.kind, config.window, config.sinks) == ("window", window, 2)
    assert ReplacementSpec.from_dict(rival.config.replacement).groups == ReplacementSpec.from_dict(
        converted.config.replacement).groups
    assert rival.config.source_model == "somewhere/original"
    one_more = convert(original, ReplacementSpec.from_dict(converted.config.replacement),
                       MixerConfig(kind="window", window=window + 1, sinks=2))
    per_token = mixer_state_bytes(one_more) - mixer_state_bytes(rival)
    assert abs(mixer_state_bytes(rival) - mixer_state_bytes(converted)) <= per_token / 2
