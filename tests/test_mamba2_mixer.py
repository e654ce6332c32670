"""Mamba-2 mixer specifics: its geometry, state sizes, reuse init and config errors."""

import pytest
import torch
from mixer_cases import D_IN

from recurformer import HeadShape, Mamba2Mixer, MixerConfig
from recurformer.config import ConfigError
from recurformer.mixers import ReplacedHeads


def test_shapes_and_state_sizes():
    heads = HeadShape(num_q_heads=6, num_kv_heads=2, head_dim=8)
    mixer = Mamba2Mixer(D_IN, heads, MixerConfig(kind="mamba2", ssd_state=5, d_conv=3))
    # z [6*8] | x [2*8] | B [2*5] | C [6*5] | dt [6]
    assert mixer.in_proj.weight.shape == (48 + 16 + 10 + 30 + 6, D_IN)
    state = mixer.allocate_state(3, torch.float32, "cpu")
    assert state["conv"].shape == (3, 16 + 10 + 30, 3)
    assert state["ssm"].shape == (3, 6, 8, 5)
    assert mixer(torch.randn(3, 7, D_IN)).shape == (3, 7, 48)
    assert mixer.step(torch.randn(3, D_IN), state).shape == (3, 48)


def test_default_state_size_is_the_head_dim():
    mixer = Mamba2Mixer(D_IN, HeadShape(2, 1, 12), MixerConfig(kind="mamba2"))
    assert mixer.allocate_state(1, torch.float32, "cpu")["ssm"].shape == (1, 2, 12, 12)


def reuse(n_state, proj_bias=False):
    torch.manual_seed(0)
    heads = HeadShape(num_q_heads=4, num_kv_heads=2, head_dim=8)
    mixer = Mamba2Mixer(D_IN, heads, MixerConfig(kind="mamba2", ssd_state=n_state, proj_bias=proj_bias))
    q, k, v = torch.randn(4, 8, D_IN), torch.randn(2, 8, D_IN), torch.randn(2, 8, D_IN)
    biases = (torch.randn(4, 8), torch.randn(2, 8), torch.randn(2, 8))
    before = mixer.in_proj.weight.detach().clone()
    mixer.init_from_heads(ReplacedHeads(q, k, v, *biases, group_size=2))
    return mixer, before, (q, k, v), biases


def test_reuse_maps_c_b_x_to_q_k_v():
    mixer, before, (q, k, v), (qb, kb, vb) = reuse(n_state=8, proj_bias=True)
    z, x_rows, B_rows, C_rows, dt = mixer.in_proj.weight.split([32, 16, 16, 32, 4])
    assert torch.equal(x_rows, v.reshape(16, D_IN))
    assert torch.equal(B_rows, k.reshape(16, D_IN))
    assert torch.equal(C_rows, q.reshape(32, D_IN))
    assert torch.equal(z, before[:32]) and torch.equal(dt, before[-4:])  # no counterpart: left as they were
    _, xb, Bb, Cb, _ = mixer.in_proj.bias.split([32, 16, 16, 32, 4])
    assert torch.equal(xb, vb.flatten()) and torch.equal(Bb, kb.flatten()) and torch.equal(Cb, qb.flatten())
    assert torch.equal(mixer.out_proj.weight, torch.eye(32))
    assert torch.equal(mixer.conv_weight[:, -1], torch.ones(64)) and not mixer.conv_weight[:, :-1].any()


def test_reuse_with_a_smaller_state_copies_the_leading_rows():
    mixer, before, (q, k, v), _ = reuse(n_state=3)
    _, _, B_rows, C_rows, _ = mixer.in_proj.weight.split([32, 16, 6, 12, 4])
    assert torch.equal(B_rows.view(2, 3, D_IN), k[:, :3])
    assert torch.equal(C_rows.view(4, 3, D_IN), q[:, :3])


def test_reuse_with_a_larger_state_keeps_the_extra_rows():
    mixer, before, (q, k, v), _ = reuse(n_state=10)
    B_rows = mixer.in_proj.weight[48:68].view(2, 10, D_IN)
    assert torch.equal(B_rows[:, :8], k)
    assert torch.equal(B_rows[:, 8:], before[48:68].view(2, 10, D_IN)[:, 8:])


def test_reuse_refuses_other_heads():
    mixer, *_ = reuse(n_state=8)
    with pytest.raises(ValueError, match="cannot take 2 / 1 heads"):
        mixer.init_from_heads(ReplacedHeads(torch.randn(2, 8, D_IN), torch.randn(1, 8, D_IN), torch.randn(1, 8, D_IN),
                                            None, None, None, group_size=2))


@pytest.mark.parametrize("field, value", [("ssd_state", 0), ("ssd_state", "full"), ("ssd_chunk", 0), ("ssd_norm", "yes")])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        MixerConfig(kind="mamba2", **{field: value})


def test_bad_head_shape_is_refused():
    with pytest.raises(ValueError, match="num_q_heads=3, num_kv_heads=2"):
        HeadShape(3, 2, 8)
