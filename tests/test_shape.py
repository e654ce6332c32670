"""The default shape of the window kinds (`mixers/shape.py`): every kind holds the default
cache budget per KV group, with its own tail; the rule's formula; SmolLM2's measured shape."""

import pytest
from tiny_models import ARCHITECTURES, tiny_model

from recurformer.config import ConfigError
from recurformer.mixers import HeadShape, MixerConfig, resolve_for_model, resolve_shape
from recurformer.mixers.shape import budget_bytes, state_bytes

WINDOW_KINDS = ("window", "window+mamba", "window+mamba2", "window+linear")


def slot_bytes(heads: HeadShape) -> int:
    """A ring-buffer slot: one key and one value per KV head (fp32) and the position (int64)."""
    return 2 * heads.num_kv_heads * heads.head_dim * 4 + 8


@pytest.mark.parametrize("kind", WINDOW_KINDS)
@pytest.mark.parametrize("group_size, head_dim", [(3, 64), (7, 64), (4, 128), (1, 12), (2, 8)])
def test_every_window_kind_holds_the_budget_to_the_nearest_slot(kind, group_size, head_dim):
    heads = HeadShape(group_size, 1, head_dim)
    config = resolve_shape(MixerConfig(kind=kind), heads)
    assert config.resolved and isinstance(config.window, int)
    gap = state_bytes(config, heads) - budget_bytes(config, heads)
    assert abs(gap) <= slot_bytes(heads) / 2, gap


def test_the_formula_for_a_group_of_g_heads_of_d_channels():
    """window+mamba2: the tail of head_dim / 4 values per head, the window grown by the bytes that
    frees against a full tail: 64 + round((tail(D) - tail(D/4)) / (8 D + 8))."""
    for g, d in ((3, 64), (7, 64), (4, 128)):
        n, k = d // 4, 4
        tail = lambda n: 4 * g * d * n + 4 * k * (d + n + g * n)  # noqa: E731 - ssm state + conv window
        config = resolve_shape(MixerConfig(), HeadShape(g, 1, d))
        assert (config.ssd_state, config.window) == (n, 64 + round((tail(d) - tail(n)) / (8 * d + 8)))


def test_smollm2_gets_the_measured_shape():
    heads = HeadShape(3, 1, 64)  # one of SmolLM2-135M's KV groups
    shapes = {kind: resolve_shape(MixerConfig(kind=kind), heads) for kind in WINDOW_KINDS}
    assert (shapes["window+mamba2"].window, shapes["window+mamba2"].ssd_state) == (141, 16)  # docs/mixers.md
    assert shapes["window"].window == 168 and shapes["window+mamba"].window == 139
    assert resolve_shape(MixerConfig(kind="mamba2"), heads).ssd_state == 64  # alone, the full head_dim


def test_given_values_are_kept_and_other_kinds_untouched():
    heads = HeadShape(3, 1, 64)
    given = MixerConfig(window=100, ssd_state=8)
    assert resolve_shape(given, heads) == given
    mamba = MixerConfig(kind="mamba")
    assert resolve_shape(mamba, heads) is mamba  # reads no shape field


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_each_tiny_family_gets_a_shape_from_its_own_heads(arch):
    model = tiny_model(arch)
    text = model.config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    config = resolve_for_model(MixerConfig(), text)
    heads = HeadShape(text.num_attention_heads // text.num_key_value_heads, 1, head_dim)
    assert config == resolve_shape(MixerConfig(), heads) and config.ssd_state == max(1, head_dim // 4)


def test_a_bad_window_is_refused():
    with pytest.raises(ConfigError, match="window must be 'auto' or a positive integer, got 'wide'"):
        MixerConfig(window="wide")
