"""The retrieval probe (`retrieval_probe.py`) and the `ablation-retrieval` scorer built on it:
needles in the calibration text, questions at its end, and only the answers' values counted."""

import pytest
import torch
from tiny_models import tiny_model, tiny_tokenizer

from recurformer import retrieval_probe
from recurformer.ablation import AblationConfig, counted_from, measure_ablation
from recurformer.config import ConfigError
from recurformer.data import DataError
from recurformer.retrieval_probe import probe_sequences
from recurformer.scoring import AnalysisConfig, analyze_text, make_scorer, select_heads

TEXT = ("The quick brown fox jumps over the lazy dog. A recurrent state has a fixed size; a KV cache grows with "
        "every token. Attention heads that only look at the last few tokens can be replaced. ") * 40


@pytest.fixture(autouse=True)
def two_needles(monkeypatch):
    """The tiny tokenizer spends ~150 tokens on a needle and its question: two fit the tiny
    model's 512 positions."""
    monkeypatch.setattr(retrieval_probe, "NEEDLES", 2)


def probes(length=400, rows=2, seed=0):
    tokenizer = tiny_tokenizer()
    ids = tokenizer(TEXT)["input_ids"]
    text = torch.tensor([ids[i * length:(i + 1) * length] for i in range(rows)])
    return tokenizer, text, probe_sequences(tokenizer, text, TEXT, seed)


def test_a_probe_is_as_long_as_its_text_and_counts_the_values_it_hid():
    tokenizer, text, (ids, counted) = probes()
    assert ids.shape == counted.shape == text.shape and counted.dtype == torch.bool
    for row in range(len(ids)):
        values = tokenizer.decode(ids[row][counted[row]]).split()
        assert len(values) == retrieval_probe.NEEDLES and all(len(v) == 7 and v.isdigit() for v in values)
        decoded = tokenizer.decode(ids[row])
        for value in values:
            assert decoded.count(f"is: {value}.") == 2  # in its needle, and as the answer
        first_question = decoded.index("What is")
        assert all(decoded.index(f"is: {value}.") < first_question for value in values)  # the needles come first
    assert not torch.equal(ids, probes(seed=1)[2][0])


def test_a_text_too_short_for_the_needles_is_a_one_line_error():
    with pytest.raises(DataError, match="leave no room .* use a longer --ablation-seq-len") as error:
        probes(length=250)
    assert "\n" not in str(error.value)


def test_counting_only_some_tokens_measures_their_nll_alone():
    """The default counts positions >= ablation_from; counting those explicitly gives the same
    costs, counting other tokens gives other costs."""
    model = tiny_model("llama")
    tokens = torch.randint(0, 97, (2, 96), generator=torch.Generator().manual_seed(0))
    settings = AblationConfig(ablation_sequences=2, ablation_seq_len=96, ablation_from=40, ablation_window=16,
                              ablation_sinks=2, ablation_rounds=1)
    default = measure_ablation(model, tokens, settings, progress=False)
    explicit = measure_ablation(model, tokens, settings, progress=False, counted=counted_from(tokens, 40))
    assert explicit.costs == default.costs and explicit.base == default.base
    few = torch.zeros_like(tokens, dtype=torch.bool)
    few[:, [50, 70, 90]] = True
    other = measure_ablation(model, tokens, settings, progress=False, counted=few)
    assert other.costs != default.costs
    with pytest.raises(ConfigError, match="`counted` must mark"):
        measure_ablation(model, tokens, settings, progress=False, counted=torch.zeros_like(few))


def test_the_retrieval_scorer_ranks_by_the_costs_on_the_probe(tmp_path):
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    settings = AblationConfig(ablation_sequences=2, ablation_seq_len=400, ablation_from=40, ablation_window=16,
                              ablation_sinks=2)
    scores = analyze_text(model, tokenizer, [TEXT], AnalysisConfig(sequences=1, seq_len=64), ablation=settings,
                          probes=("retrieval",))
    costs = scores.groups["ablation_retrieval"]
    assert "ablation" not in scores.groups and scores.ablation["probe"] == "retrieval"
    assert max(abs(c) for row in costs for c in row) > 1e-4
    cheapest = min(((l, g) for l in range(len(costs)) for g in range(len(costs[0]))), key=lambda lg: costs[lg[0]][lg[1]])
    assert select_heads(scores, 0.25, make_scorer("ablation-retrieval")).groups == [cheapest]
    scores.save(tmp_path / "scores.json")
    with pytest.raises(ConfigError, match="no ablation costs"):
        select_heads(scores, 0.5, make_scorer("ablation"))
