"""The interface every mixer shares, checked for each kind: decoding, chunked prefill,
padding and gradients. Kind-specific checks live in test_<kind>_mixer.py."""

import pytest
import torch
from mixer_cases import CONFIGS, D_IN, make_mixer, positions_for, rope


def pe(rope_all, start, stop):
    cos, sin = rope_all
    return cos[:, start:stop], sin[:, start:stop]


@pytest.mark.parametrize("case", sorted(CONFIGS))
@pytest.mark.parametrize("prefix", [1, 17, 40])
def test_forward_equals_prefill_then_steps(case, prefix):
    mixer = make_mixer(case)
    x = torch.randn(2, 48, D_IN)
    rotary = rope(positions_for(2, 48))
    with torch.no_grad():
        full = mixer(x, position_embeddings=rotary)
        state = mixer.allocate_state(2, torch.float32, "cpu")
        outs = [mixer(x[:, :prefix], state, position_embeddings=pe(rotary, 0, prefix))]
        outs += [mixer.step(x[:, t], state, pe(rotary, t, t + 1))[:, None] for t in range(prefix, x.shape[1])]
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_prefill_in_pieces_equals_one_prefill(case):
    mixer = make_mixer(case)
    x = torch.randn(2, 30, D_IN)
    rotary = rope(positions_for(2, 30))
    with torch.no_grad():
        one = mixer.allocate_state(2, torch.float32, "cpu")
        y_one = mixer(x, one, position_embeddings=rotary)
        two = mixer.allocate_state(2, torch.float32, "cpu")
        y_two = torch.cat([mixer(x[:, :11], two, position_embeddings=pe(rotary, 0, 11)),
                           mixer(x[:, 11:], two, position_embeddings=pe(rotary, 11, 30))], 1)
    torch.testing.assert_close(y_two, y_one, atol=1e-5, rtol=1e-4)
    assert set(two) == set(one)
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_left_padding_does_not_change_outputs_or_state(case):
    mixer = make_mixer(case)
    lengths = [13, 6, 1]
    width = max(lengths)
    rows = [torch.randn(1, n, D_IN) for n in lengths]
    padded = torch.full((len(rows), width, D_IN), 5.0)  # padding may hold anything: the mask hides it
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        padded[i, width - row.shape[1]:] = row[0]
        mask[i, width - row.shape[1]:] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # as generate() makes them for left padding
    with torch.no_grad():
        state = mixer.allocate_state(len(rows), torch.float32, "cpu")
        y = mixer(padded, state, attention_mask=mask, position_embeddings=rope(positions))
        alone_states = []
        for i, row in enumerate(rows):
            n = row.shape[1]
            alone = mixer.allocate_state(1, torch.float32, "cpu")
            y_alone = mixer(row, alone, position_embeddings=rope(positions_for(1, n)))
            torch.testing.assert_close(y[i, width - n:], y_alone[0], atol=1e-5, rtol=1e-4)
            for name in alone:
                torch.testing.assert_close(state[name][i], alone[name][0], atol=1e-5, rtol=1e-4)
            alone_states.append(alone)
        assert torch.isfinite(y).all()  # padded positions included
        next_token = torch.randn(len(rows), D_IN)
        next_positions = positions[:, -1:] + 1
        y_next = mixer.step(next_token, state, rope(next_positions))
        for i, alone in enumerate(alone_states):
            alone_next = mixer.step(next_token[i:i + 1], alone, rope(next_positions[i:i + 1]))
            torch.testing.assert_close(y_next[i], alone_next[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_gradients_reach_every_parameter(case):
    mixer = make_mixer(case)
    if not list(mixer.parameters()):
        pytest.skip("a kind without parameters")
    mixer(torch.randn(2, 20, D_IN), position_embeddings=rope(positions_for(2, 20))).square().mean().backward()
    missing = [name for name, p in mixer.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_state_size_does_not_depend_on_the_length(case):
    mixer = make_mixer(case)
    sizes = set()
    for length in (3, 40):
        state = mixer.allocate_state(2, torch.float32, "cpu")
        with torch.no_grad():
            mixer(torch.randn(2, length, D_IN), state, position_embeddings=rope(positions_for(2, length)))
        sizes.add(tuple((name, tuple(t.shape)) for name, t in sorted(state.items())))
    assert len(sizes) == 1
