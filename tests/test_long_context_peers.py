"""The equal-cache comparison's measures (`benchmarks/peers/ours.py`) on tiny random
models: a prefilled cache scores the next tokens as the full forward does, and the greedy
answer after a context and a question is `generate`'s."""


import pytest
import torch
from benchmark_scripts import benchmark_script
from tiny_models import MIXERS, open_gates, spec_for, tiny_model

from recurformer import convert
from recurformer.evaluate.ppl_by_distance import position_nll


@pytest.fixture(scope="module")
def peers():
    with benchmark_script("peers.ours") as module:
        yield module


def models():
    original = tiny_model("llama")
    yield "original", original
    for kind in ("window", "window+mamba2"):
        yield kind, open_gates(convert(original, spec_for(original, 0.5), MIXERS[kind]))
    yield "all windowed", convert(original, spec_for(original, 1.0), MIXERS["window"])


@pytest.mark.parametrize("name, model", list(models()), ids=lambda v: v if isinstance(v, str) else "")
def test_prefilled_loss_is_the_full_forward_loss(peers, name, model):
    sequence = torch.randint(0, 97, (61,), generator=torch.Generator().manual_seed(1))
    prefix = 37  # past the tiny window (16 + 2 sinks), so the ring buffer has wrapped
    cache = peers.fresh_cache(model)
    nll = peers.prefilled_nll(model, sequence, prefix, cache)
    full = position_nll(model, sequence)[prefix:]
    assert nll.shape == (len(sequence) - prefix - 1,)
    torch.testing.assert_close(nll, full, atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == len(sequence) - 1


@pytest.mark.parametrize("name, model", list(models()), ids=lambda v: v if isinstance(v, str) else "")
def test_greedy_answer_is_generate(peers, name, model):
    ids = torch.randint(0, 97, (45,), generator=torch.Generator().manual_seed(2)).tolist()
    answer = peers.greedy_answer(model, ids, 40, peers.fresh_cache(model), new_tokens=5)
    generated = model.generate(torch.tensor([ids]), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert answer == generated[0, len(ids):].tolist()


@pytest.mark.parametrize("kind, window", [("window+mamba2", "(16 + 2 sinks)"), ("mamba", None)])
def test_trained_label_names_the_window_only_of_kinds_that_have_one(peers, kind, window):
    original = tiny_model("llama")
    converted = convert(original, spec_for(original, 0.5), MIXERS[kind])
    label = peers.trained_label(converted, "/runs/x/final")
    groups = len(converted.config.replacement["groups"])
    assert label.startswith(kind)
    assert f"{groups} of " in label and label.endswith("trained: `/runs/x/final`")
    assert ("sinks" in label) == (window is not None)
    if window:
        assert window in label


def test_add_row_keeps_rows_written_meanwhile(peers, tmp_path):
    out = tmp_path / "rows.json"
    peers.add_row(out, "digest", "first", {"method": "ours", "label": "a"})
    # another run of the script, started before "first" existed, adds its own row
    peers.add_row(out, "digest", "second", {"method": "ours", "label": "b"})
    rows = peers.load_results(out, "digest")["rows"]
    assert rows == {"first": {"method": "ours", "label": "a"}, "second": {"method": "ours", "label": "b"}}
    with pytest.raises(SystemExit, match="problem set"):
        peers.add_row(out, "other", "third", {})
