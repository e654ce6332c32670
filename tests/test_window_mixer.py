"""Window mixer specifics: the banded attention it computes, its ring buffer, its init."""

import pytest
import torch
from mixer_cases import D_IN, HEADS, positions_for, rope
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from recurformer import HeadShape, MixerConfig, WindowMixer
from recurformer.config import ConfigError
from recurformer.mixers import ReplacedHeads


def make_window(window, sinks, heads=HEADS, seed=0):
    torch.manual_seed(seed)
    return WindowMixer(D_IN, heads, MixerConfig(kind="window", window=window, sinks=sinks))


def banded_reference(mixer, x, window, sinks):
    """Softmax attention of the mixer's heads with an explicit [T, T] band + sinks mask."""
    batch, length, _ = x.shape
    H, G, D = mixer.n_heads, mixer.n_kv_heads, mixer.head_dim
    q = mixer.q_proj(x).view(batch, length, H, D).transpose(1, 2)
    k = mixer.k_proj(x).view(batch, length, G, D).transpose(1, 2)
    v = mixer.v_proj(x).view(batch, length, G, D).transpose(1, 2)
    cos, sin = rope(positions_for(batch, length))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    allowed = (j <= i) & ((i - j < window) | (j < sinks))
    scores = (q @ k.transpose(-1, -2)) * D**-0.5
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (weights @ v).transpose(1, 2).reshape(batch, length, H * D)


@pytest.mark.parametrize("window, sinks", [(1, 0), (4, 0), (7, 3), (16, 16), (60, 4), (200, 0)])
def test_matches_an_explicit_banded_mask(window, sinks):
    mixer = make_window(window, sinks)
    x = torch.randn(2, 61, D_IN)
    with torch.no_grad():
        expected = banded_reference(mixer, x, window, sinks)
        full = mixer(x, position_embeddings=rope(positions_for(2, 61)))
        state = mixer.allocate_state(2, torch.float32, "cpu")
        rotary = rope(positions_for(2, 61))
        steps = [mixer(x[:, :9], state, position_embeddings=tuple(t[:, :9] for t in rotary))]
        steps += [mixer.step(x[:, t], state, tuple(t_[:, t:t + 1] for t_ in rotary))[:, None] for t in range(9, 61)]
    torch.testing.assert_close(full, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(steps, 1), expected, atol=1e-5, rtol=1e-4)


def test_ring_buffer_holds_the_sinks_and_the_last_window_tokens():
    mixer = make_window(window=5, sinks=2)
    state = mixer.allocate_state(1, torch.float32, "cpu")
    assert state["keys"].shape == (1, 7, 2, 8) and state["index"].shape == (1, 7)
    with torch.no_grad():
        mixer(torch.randn(1, 3, D_IN), state, position_embeddings=rope(positions_for(1, 3)))
        assert sorted(state["index"][0].tolist()) == [-1, -1, -1, -1, 0, 1, 2]
        mixer(torch.randn(1, 20, D_IN), state, position_embeddings=rope(positions_for(1, 20, start=3)))
    assert sorted(state["index"][0].tolist()) == [0, 1, 18, 19, 20, 21, 22]


def test_needs_position_embeddings():
    with pytest.raises(ValueError, match="position_embeddings"):
        make_window(4, 1)(torch.randn(1, 3, D_IN))


def test_init_from_heads_copies_the_projections_and_biases():
    heads = HeadShape(num_q_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True)
    mixer = make_window(4, 1, heads)
    q, k, v = torch.randn(4, 8, D_IN), torch.randn(2, 8, D_IN), torch.randn(2, 8, D_IN)
    qb, kb, vb = torch.randn(4, 8), torch.randn(2, 8), torch.randn(2, 8)
    mixer.init_from_heads(ReplacedHeads(q, k, v, qb, kb, vb, group_size=2))
    assert torch.equal(mixer.q_proj.weight, q.reshape(32, D_IN)) and torch.equal(mixer.q_proj.bias, qb.flatten())
    assert torch.equal(mixer.k_proj.weight, k.reshape(16, D_IN)) and torch.equal(mixer.k_proj.bias, kb.flatten())
    assert torch.equal(mixer.v_proj.weight, v.reshape(16, D_IN)) and torch.equal(mixer.v_proj.bias, vb.flatten())
    with pytest.raises(ValueError, match="bias"):
        make_window(4, 1).init_from_heads(ReplacedHeads(q, k, v, qb, kb, vb, group_size=2))


@pytest.mark.parametrize("field, value", [("window", 0), ("window", 2.5), ("sinks", -1), ("sinks", True)])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        MixerConfig(kind="window", **{field: value})
