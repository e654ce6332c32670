import pytest
import torch

from recurformer.ops.conv import causal_conv1d, causal_conv1d_step


@pytest.mark.parametrize("length", [1, 5, 63])
@pytest.mark.parametrize("with_bias", [True, False])
def test_full_sequence_equals_stepping(length, with_bias):
    torch.manual_seed(0)
    batch, channels, width = 2, 6, 4
    x = torch.randn(batch, length, channels)
    weight = torch.randn(channels, width)
    bias = torch.randn(channels) if with_bias else None
    start = torch.randn(batch, channels, width)

    y, final = causal_conv1d(x, weight, bias, start)

    state, steps = start, []
    for t in range(length):
        y_t, state = causal_conv1d_step(x[:, t], weight, bias, state)
        steps.append(y_t)
    torch.testing.assert_close(y, torch.stack(steps, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, state)


def test_matches_torch_conv_with_zero_history():
    torch.manual_seed(0)
    x = torch.randn(1, 10, 3)
    weight = torch.randn(3, 4)
    conv = torch.nn.Conv1d(3, 3, 4, groups=3, padding=3, bias=False)
    conv.weight.data = weight.unsqueeze(1)
    expected = conv(x.transpose(1, 2))[:, :, :10].transpose(1, 2)
    y, _ = causal_conv1d(x, weight)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_state_holds_last_inputs():
    x = torch.arange(6.0).view(1, 6, 1)
    _, state = causal_conv1d(x, torch.ones(1, 3))
    assert state.flatten().tolist() == [3.0, 4.0, 5.0]
