import pytest
import torch

from recurformer import MambaMixer, MixerConfig
from recurformer.config import ConfigError


def make_mixer(backend="chunked", d_in=24, d_out=16, **overrides):
    torch.manual_seed(0)
    config = MixerConfig(d_state=8, scan_backend=backend, **overrides)
    mixer = MambaMixer(d_in, d_out, config)
    with torch.no_grad():  # make the gate, skip and decay matter, not the init defaults
        mixer.D.normal_()
        mixer.A_log.add_(torch.randn_like(mixer.A_log) * 0.3)
    return mixer


def test_shapes_and_state_sizes():
    mixer = make_mixer(d_in=24, d_out=16, expand=2.0)
    state = mixer.allocate_state(3, torch.float32, "cpu")
    assert state["conv"].shape == (3, 32, 4)
    assert state["ssm"].shape == (3, 32, 8)
    assert mixer(torch.randn(3, 7, 24)).shape == (3, 7, 16)
    assert mixer.step(torch.randn(3, 24), state).shape == (3, 16)


@pytest.mark.parametrize("backend", ["naive", "chunked"])
@pytest.mark.parametrize("prefix", [1, 17, 40])
def test_forward_equals_prefill_then_steps(backend, prefix):
    mixer = make_mixer(backend)
    x = torch.randn(2, 48, 24)
    with torch.no_grad():
        full = mixer(x)
        state = mixer.allocate_state(2, torch.float32, "cpu")
        outs = [mixer(x[:, :prefix], state)]
        outs += [mixer.step(x[:, t], state)[:, None] for t in range(prefix, x.shape[1])]
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-4)


def test_prefill_in_pieces_equals_one_prefill():
    mixer = make_mixer()
    x = torch.randn(2, 30, 24)
    with torch.no_grad():
        one = mixer.allocate_state(2, torch.float32, "cpu")
        y_one = mixer(x, one)
        two = mixer.allocate_state(2, torch.float32, "cpu")
        y_two = torch.cat([mixer(x[:, :11], two), mixer(x[:, 11:], two)], 1)
    torch.testing.assert_close(y_two, y_one, atol=1e-5, rtol=1e-4)
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=1e-5, rtol=1e-4)


def test_left_padding_does_not_change_outputs_or_state():
    mixer = make_mixer()
    lengths = [13, 6, 1]
    width = max(lengths)
    rows = [torch.randn(1, n, 24) for n in lengths]
    padded = torch.full((len(rows), width, 24), 5.0)  # padding may hold anything: the mask hides it
    mask = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        padded[i, width - row.shape[1]:] = row[0]
        mask[i, width - row.shape[1]:] = 1
    with torch.no_grad():
        state = mixer.allocate_state(len(rows), torch.float32, "cpu")
        y = mixer(padded, state, attention_mask=mask)
        alone_states = []
        for i, row in enumerate(rows):
            alone = mixer.allocate_state(1, torch.float32, "cpu")
            torch.testing.assert_close(y[i, width - row.shape[1]:], mixer(row, alone)[0], atol=1e-5, rtol=1e-4)
            for name in alone:
                torch.testing.assert_close(state[name][i], alone[name][0], atol=1e-5, rtol=1e-4)
            alone_states.append(alone)
        next_token = torch.randn(len(rows), 24)
        y_next = mixer.step(next_token, state)
        for i, alone in enumerate(alone_states):
            torch.testing.assert_close(y_next[i], mixer.step(next_token[i:i + 1], alone)[0], atol=1e-5, rtol=1e-4)


def test_gradients_reach_every_parameter():
    mixer = make_mixer()
    mixer(torch.randn(2, 20, 24)).square().mean().backward()
    missing = [name for name, p in mixer.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


@pytest.mark.parametrize(
    "field, value",
    [("d_state", 0), ("d_conv", -1), ("expand", 0), ("dt_rank", "big"), ("dt_min", 1.0), ("scan_backend", "gpu"), ("kind", "rwkv")],
)
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ConfigError, match=field if field != "dt_min" else "dt_min"):
        MixerConfig(**{field: value})
