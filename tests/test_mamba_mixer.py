"""Mamba-1 specifics; the shared interface is checked for every mixer in test_mixers.py."""

import pytest
import torch

from recurformer import HeadShape, MambaMixer, MixerConfig
from recurformer.config import ConfigError


def test_shapes_and_state_sizes():
    mixer = MambaMixer(24, HeadShape(num_q_heads=2, num_kv_heads=1, head_dim=8), MixerConfig(d_state=8, expand=2.0))
    state = mixer.allocate_state(3, torch.float32, "cpu")
    assert state["conv"].shape == (3, 32, 4)
    assert state["ssm"].shape == (3, 32, 8)
    assert mixer(torch.randn(3, 7, 24)).shape == (3, 7, 16)
    assert mixer.step(torch.randn(3, 24), state).shape == (3, 16)


@pytest.mark.parametrize(
    "field, value",
    [("d_state", 0), ("d_conv", -1), ("expand", 0), ("dt_rank", "big"), ("dt_min", 1.0), ("scan_backend", "gpu"), ("kind", "rwkv")],
)
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ConfigError, match=field if field != "dt_min" else "dt_min"):
        MixerConfig(**{field: value})
