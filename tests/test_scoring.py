import json
from types import SimpleNamespace

import pytest
import torch
from tiny_models import tiny_model, tiny_tokenizer

from recurformer import retrieval_probe
from recurformer.ablation import AblationConfig
from recurformer.config import ConfigError, groups_to_replace
from recurformer.run.stages import analyze_heads
from recurformer.scoring import (
    SCORERS,
    AnalysisConfig,
    HeadScores,
    SelectionConfig,
    RecencyStatistics,
    analyze,
    make_scorer,
    select_heads,
    select_layers,
    stats_attention,
)


def reference_statistics(attentions, window):
    """RR, sink and sink-excluded RR straight from full attention matrices [B, H, T, T]."""
    out = {}
    for layer, probs in enumerate(attentions):
        length = probs.shape[-1]
        i = torch.arange(length)[:, None]
        j = torch.arange(length)[None]
        band = ((j <= i) & (j > i - window)).float()
        rr = (probs * band).sum(-1).mean(-1).mean(0)
        sink = probs[..., 0].mean(-1).mean(0)
        no_sink_band = band.clone()
        no_sink_band[:, 0] = 0
        no_sink = ((probs * no_sink_band).sum(-1)[..., 1:] / (1 - probs[..., 1:, 0])).mean(-1).mean(0)  # 1 - sink: exact enough here
        out[layer] = (rr, sink, no_sink)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_streaming_statistics_equal_full_eager_attention(arch):
    model = tiny_model(arch, "eager")
    sequences = torch.randint(0, 97, (3, 90))
    scores = analyze(model, sequences, window=16, windows=(4, 64), progress=False)
    with torch.no_grad():
        attentions = model(sequences, output_attentions=True, use_cache=False).attentions
    for w in (4, 16, 64):
        for layer, (rr, sink, no_sink) in reference_statistics(attentions, w).items():
            torch.testing.assert_close(torch.tensor(scores.heads[f"rr_{w}"][layer], dtype=torch.float64), rr.double(), atol=1e-5, rtol=0)
            torch.testing.assert_close(torch.tensor(scores.heads[f"rr_{w}_no_sink"][layer], dtype=torch.float64), no_sink.double(), atol=1e-5, rtol=0)
            torch.testing.assert_close(torch.tensor(scores.heads["sink"][layer], dtype=torch.float64), sink.double(), atol=1e-5, rtol=0)
    assert model.config._attn_implementation == "eager"  # restored after the run


def test_an_attention_that_only_reads_the_previous_token_scores_one():
    """Queries and keys built so that query i matches key i-1 only: attention on the
    previous token (the first query can only read itself)."""
    length = 40
    key = torch.eye(length)[None, None] * 30.0  # [1, 1, T, T]: key j is the unit vector e_j
    query = torch.roll(torch.eye(length), shifts=-1, dims=1)[None, None] * 30.0  # query i = e_{i-1}
    query[..., 0, :] = key[..., 0, :]
    stats = RecencyStatistics(1, 1, (1, 2, 16))
    module = SimpleNamespace(num_key_value_groups=1, layer_idx=0)
    stats_attention(stats, module, query, key, torch.randn(1, 1, length, length), None, scaling=1.0)
    means = stats.means()
    assert means["rr_2"][0][0] == pytest.approx(1.0, abs=1e-6)
    assert means["rr_16"][0][0] == pytest.approx(1.0, abs=1e-6)
    assert means["rr_1"][0][0] == pytest.approx(1 / length, abs=1e-6)  # only query 0 reads itself


def make_scores(values):
    """HeadScores for a 3-layer model with 4 query heads in 2 KV groups, rr_16 = values."""
    heads = {"rr_16": values, "sink": [[0.0] * 4 for _ in values]}
    return HeadScores("toy", len(values), 4, 2, 16, [16], 1, 8, heads)


def test_selection_is_global_top_beta_over_groups():
    scores = make_scores([[0.9, 0.7, 0.1, 0.2], [0.5, 0.5, 0.95, 0.85], [0.3, 0.3, 0.6, 0.8]])
    # group means: (0,0)=0.8 (0,1)=0.15 (1,0)=0.5 (1,1)=0.9 (2,0)=0.3 (2,1)=0.7
    assert select_heads(scores, 0.5, make_scorer("recency")).groups == [(0, 0), (1, 1), (2, 1)]
    assert select_heads(scores, 0.5, make_scorer("inverse")).groups == [(0, 1), (1, 0), (2, 0)]
    assert select_heads(scores, 0.0, make_scorer("recency")).groups == []
    assert len(select_heads(scores, 1.0, make_scorer("recency")).groups) == 6
    random_a = select_heads(scores, 0.5, make_scorer("random", seed=1)).groups
    assert random_a == select_heads(scores, 0.5, make_scorer("random", seed=1)).groups
    assert len(random_a) == 3


def test_the_joint_scorer_adds_the_ranks_of_both_costs():
    scores = make_scores([[0.5] * 4] * 3)
    # text cost ranks: (0,0) 0, (0,1) 1, (1,0) 2, (1,1) 3, (2,0) 4, (2,1) 5
    scores.groups["ablation"] = [[0.01, 0.02], [0.03, 0.04], [0.05, 0.06]]
    with pytest.raises(ConfigError, match="no text and retrieval ablation costs"):
        select_heads(scores, 0.5, make_scorer("ablation-joint"))
    # retrieval ranks: (2,1) 0, (1,1) 1, (0,1) 2, (2,0) 3, (1,0) 4, (0,0) 5 -> sums 5, 3, 6, 4, 7, 5
    scores.groups["ablation_retrieval"] = [[0.9, 0.3], [0.7, 0.2], [0.4, -0.1]]
    assert select_heads(scores, 0.5, make_scorer("ablation-joint")).groups == [(0, 0), (0, 1), (1, 1)]
    assert select_heads(scores, 0.5, make_scorer("ablation")).groups == [(0, 0), (0, 1), (1, 0)]
    assert select_heads(scores, 0.5, make_scorer("ablation-retrieval")).groups == [(0, 1), (1, 1), (2, 1)]


def test_the_default_selection_is_the_commands_ablation_scorer():
    """select_heads without a scorer ranks as `analyze`, `convert` and `run` do: by ablation
    cost, which scores of recency statistics alone do not have."""
    assert SelectionConfig().scorer == "ablation"
    with pytest.raises(ConfigError, match="these scores have no ablation costs"):
        select_heads(make_scores([[0.9, 0.7, 0.1, 0.2], [0.5, 0.5, 0.95, 0.85]]), 0.5)


def test_layer_selection_takes_whole_layers_by_mean_group_score():
    scores = make_scores([[0.9, 0.7, 0.1, 0.2], [0.5, 0.5, 0.95, 0.85], [0.3, 0.3, 0.6, 0.8]])
    # layer means: 0 -> 0.475, 1 -> 0.7, 2 -> 0.5
    recency = make_scorer("recency")
    assert select_layers(scores, 0.34, recency).groups == [(1, 0), (1, 1)]
    spec = select_layers(scores, 0.5, recency)  # 1.5 layers round to 2: the fraction is 2/3, not 1/2
    assert spec.groups == [(1, 0), (1, 1), (2, 0), (2, 1)] and spec.fraction == pytest.approx(2 / 3)
    assert select_layers(scores, 0.5, make_scorer("inverse")).groups == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert select_layers(scores, 0.0, recency).groups == [] and select_layers(scores, 1.0, recency).fraction == 1.0


@pytest.mark.parametrize("beta, expected", [(0.5, 45), (0.75, 68), (0.25, 23), (0.01, 1), (0.0, 0), (1.0, 90)])
def test_rounding_of_beta(beta, expected):
    assert groups_to_replace(90, beta) == expected


@pytest.mark.parametrize("beta", [-0.1, 1.5, float("nan"), "half"])
def test_beta_out_of_range_is_refused(beta):
    with pytest.raises(ConfigError, match="beta must be in"):
        groups_to_replace(10, beta)


def test_unknown_scorer_is_refused():
    with pytest.raises(ConfigError, match="scorer: unknown 'attention'"):
        make_scorer("attention")


def test_scores_json_round_trip(tmp_path):
    scores = make_scores([[0.9, 0.7, 0.1, 0.2], [0.5, 0.5, 0.95, 0.85], [0.3, 0.3, 0.6, 0.8]])
    scores.save(tmp_path / "scores.json")
    again = HeadScores.load(tmp_path / "scores.json")
    assert again.heads == scores.heads and again.groups == scores.groups
    records = json.loads((tmp_path / "scores.json").read_text())["groups"]
    assert records[0] == {"layer": 0, "kv_head": 0, "rr_16": pytest.approx(0.8), "sink": 0.0}


@pytest.mark.parametrize("content, message", [("{", "truncated"), ("{]", "not valid JSON"),
                                              ('{"a": 1}', "not a recurformer scores file")])
def test_bad_scores_files_are_refused(tmp_path, content, message):
    path = tmp_path / "scores.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        HeadScores.load(path)
    with pytest.raises(ConfigError, match="not found"):
        HeadScores.load(tmp_path / "missing.json")


def test_sink_excluded_ratio_is_exact_when_the_sink_takes_almost_everything():
    length = 50
    scores = torch.randn(1, 1, length, length, dtype=torch.float64)
    scores[..., 0] += 30.0  # the first token takes all but ~1e-12 of every row
    causal = torch.ones(length, length, dtype=torch.bool).triu(1)
    probs64 = scores.masked_fill(causal, float("-inf")).softmax(-1)
    stats = RecencyStatistics(1, 1, (16,))
    stats.add(0, probs64.float())
    i, j = torch.arange(length)[:, None], torch.arange(length)[None]
    window = ((j <= i) & (j > i - 16) & (j > 0)).double()
    expected = ((probs64 * window).sum(-1)[..., 1:] / probs64[..., 1:, 1:].sum(-1)).mean()
    got = stats.means()["rr_16_no_sink"][0][0]
    assert 0.0 <= got <= 1.0
    assert got == pytest.approx(expected.item(), abs=1e-4)


TEXT = ("The quick brown fox jumps over the lazy dog. A recurrent state has a fixed size; a KV cache grows with "
        "every token. Attention heads that only look at the last few tokens can be replaced. ") * 40
CALIBRATION = AblationConfig(ablation_sequences=2, ablation_seq_len=400, ablation_from=40, ablation_window=16,
                             ablation_sinks=2, ablation_rounds=2)


@pytest.mark.parametrize("name", sorted(SCORERS))
def test_each_scorer_ranks_the_scores_analyzed_for_what_it_needs(name, tmp_path, monkeypatch):
    """`analyze_heads` (the `analyze` command's and `run`'s) measures what the scorer says it
    needs, and that is enough to rank; the head statistics alone are not, for a scorer that
    needs an ablation."""
    monkeypatch.setattr(retrieval_probe, "NEEDLES", 2)  # two needles fit the tiny model's positions
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()

    def scores_for(scorer: str) -> HeadScores:
        return analyze_heads(model, tokenizer, [TEXT], AnalysisConfig(sequences=1, seq_len=64),
                             SelectionConfig(scorer=scorer), CALIBRATION, "tiny", [], tmp_path / f"{scorer}.json",
                             tmp_path / "partial.json")

    scores = scores_for(name)
    assert len(select_heads(scores, 0.5, make_scorer(name)).groups) == 2
    assert not list(tmp_path.glob("partial*"))  # every probe's checkpoint removed once the scores are written
    if SCORERS[name].needs.ablation:
        assert scores.ablation["probe"] == "+".join(SCORERS[name].needs.probes)
        with pytest.raises(ConfigError, match="these scores have no"):
            select_heads(scores_for("recency"), 0.5, make_scorer(name))
