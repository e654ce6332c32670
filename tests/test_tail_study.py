"""`benchmarks/quality/tail_study.py`: the evicted-only tail reads, at each position, the state of
the token `window` steps back, decayed to now (checked against the naive recurrence)."""

import pytest
import torch
from benchmark_scripts import benchmark_script

from recurformer import MixerConfig
from recurformer.mixers import HeadShape
from recurformer.ops.ssd.naive import ssd_naive


@pytest.fixture(scope="module")
def study():
    with benchmark_script("quality.tail_study") as module:
        yield module


def test_the_evicted_tail_reads_the_state_window_steps_back(study):
    torch.manual_seed(0)
    window, length = 3, 11
    mixer = study.EvictedTailMamba2(8, HeadShape(4, 2, 6), MixerConfig(kind="mamba2", window=window, ssd_state=5))
    x = torch.randn(2, length, 8)
    with torch.no_grad():
        got = mixer(x)
        z, xs, dt, B, C, _ = mixer.scan_inputs(x)
        dt, C = dt.float(), C.float()
        A = mixer.A.float()
        y = torch.zeros(2, length, 4, 6)
        for t in range(window, length):
            old = slice(0, t - window + 1)  # tokens 0 .. t - window
            _, state = ssd_naive(xs[:, old], dt[:, old], A, B[:, old], C[:, old], return_final_state=True)  # [B, H, P, N]
            decay = torch.exp((dt[:, t - window + 1:t + 1] * A).sum(1))  # [B, H]
            y[:, t] = torch.einsum("bhpn,bhn->bhp", state, C[:, t]) * decay[..., None]
        want = mixer._output(y, z)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got[:, window:].abs().sum() > 0  # the late positions read something


def test_the_evicted_tail_refuses_a_cache(study):
    mixer = study.EvictedTailMamba2(8, HeadShape(4, 2, 6), MixerConfig(kind="mamba2", window=3, ssd_state=5))
    with pytest.raises(NotImplementedError):
        mixer(torch.randn(1, 5, 8), state=mixer.allocate_state(1, torch.float32, "cpu"))
