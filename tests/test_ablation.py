"""The ablation scorers: a group's cost is what converting it (alone, or after the earlier
greedy rounds' groups) to a window costs."""

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_model, tiny_tokenizer

from recurformer.ablation import (
    AblationConfig,
    calibration_sequences,
    measure_ablation,
)
from recurformer.config import ConfigError, ReplacementSpec
from recurformer.data import DataError
from recurformer.mixers import MixerConfig
from recurformer.scoring import HeadScores, analyze, make_scorer, record_ablation, select_heads
from recurformer.surgery import convert

SETTINGS = AblationConfig(ablation_sequences=2, ablation_seq_len=96, ablation_from=40, ablation_window=16,
                          ablation_sinks=2, ablation_rounds=1)
WINDOW = MixerConfig(kind="window", window=16, sinks=2)


def tail_nll(model, tokens, start):
    with torch.no_grad():
        logits = model(tokens, use_cache=False).logits.float()
    return F.cross_entropy(logits[:, start - 1:-1].transpose(1, 2), tokens[:, start:]).item()


def test_a_cost_is_what_converting_that_group_alone_to_the_window_mixer_costs(arch):  # every family (conftest's arch)
    model = tiny_model(arch)
    tokens = torch.randint(0, 97, (2, 96), generator=torch.Generator().manual_seed(0))
    result = measure_ablation(model, tokens, SETTINGS, progress=False)
    costs, base = result.costs, result.base[0]
    assert base == pytest.approx(tail_nll(model, tokens, 40), abs=1e-5)
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    for layer in range(layers):
        for group in range(kv_heads):
            converted = convert(model, ReplacementSpec(layers, kv_heads, [(layer, group)]), WINDOW)
            assert costs[layer][group] == pytest.approx(tail_nll(converted, tokens, 40) - base, abs=1e-5)
    assert max(abs(c) for row in costs for c in row) > 1e-4  # the windows do change something


def test_a_group_whose_output_columns_are_zero_costs_nothing():
    model = tiny_model("llama")
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    size = model.config.num_attention_heads // model.config.num_key_value_heads
    with torch.no_grad():  # layer 0, KV group 1: its query heads' columns of o_proj
        model.model.layers[0].self_attn.o_proj.weight[:, size * head_dim:2 * size * head_dim] = 0
    tokens = torch.randint(0, 97, (2, 96), generator=torch.Generator().manual_seed(1))
    costs = measure_ablation(model, tokens, SETTINGS, progress=False).costs
    assert abs(costs[0][1]) <= 1e-6
    assert abs(costs[0][0]) > 1e-4


def test_costs_do_not_depend_on_how_the_groups_are_batched():
    model = tiny_model("mistral")  # 4 KV groups per layer
    tokens = torch.randint(0, 97, (2, 96), generator=torch.Generator().manual_seed(2))
    greedy = replace(SETTINGS, ablation_rounds=3)
    together = measure_ablation(model, tokens, greedy, progress=False)
    for per_batch in (1, 3):
        apart = measure_ablation(model, tokens, greedy, groups_per_batch=per_batch, progress=False)
        torch.testing.assert_close(torch.tensor(apart.costs), torch.tensor(together.costs), atol=1e-6, rtol=0)
        torch.testing.assert_close(torch.tensor(apart.marginal), torch.tensor(together.marginal), atol=1e-6, rtol=0)
        assert apart.order == together.order


def test_an_interrupted_greedy_run_resumes_from_the_checkpoint(tmp_path):
    model = tiny_model("mistral")  # 2 layers x 4 groups: round 0 takes 4, round 1 ranks the other 4
    tokens = torch.randint(0, 97, (2, 96), generator=torch.Generator().manual_seed(3))
    greedy = replace(SETTINGS, ablation_rounds=2)
    checkpoint = tmp_path / "partial.json"
    full = measure_ablation(model, tokens, greedy, checkpoint=checkpoint, progress=False)
    saved = json.loads(checkpoint.read_text())
    saved["costs"] = [c for c in saved["costs"] if c["round"] == 0 or c["layer"] == 0]  # stopped in round 1, layer 1
    checkpoint.write_text(json.dumps(saved))
    with torch.no_grad():  # a changed model shows which costs were recomputed
        model.model.layers[0].mlp.down_proj.weight.mul_(2)
    # (the fingerprint hashes layer 0's q_proj, which is unchanged: the checkpoint still applies)
    resumed = measure_ablation(model, tokens, greedy, checkpoint=checkpoint, progress=False)
    assert resumed.costs == full.costs  # round 0: read back, not recomputed
    second = [(l, g) for l in range(2) for g in range(4) if full.order[l][g] >= 4]
    assert {l for l, _ in second} == {0, 1}
    # round 1: layer 0 read back, layer 1 recomputed on the changed model
    assert [resumed.marginal[l][g] == full.marginal[l][g] for l, g in second] == [l == 0 for l, _ in second]
    other = AblationConfig(ablation_sequences=2, ablation_seq_len=96, ablation_from=50, ablation_rounds=2)
    with pytest.raises(ConfigError, match="other settings"):
        measure_ablation(model, tokens, other, checkpoint=checkpoint, progress=False)


def test_a_greedy_round_costs_what_converting_the_earlier_rounds_groups_and_that_one_costs():
    model = tiny_model("mistral")
    tokens = torch.randint(0, 97, (2, 96), generator=torch.Generator().manual_seed(4))
    result = measure_ablation(model, tokens, replace(SETTINGS, ablation_rounds=2), progress=False)
    groups = [(l, g) for l in range(2) for g in range(4)]
    alone = {(l, g): result.costs[l][g] for l, g in groups}
    order = sorted(groups, key=lambda g: result.order[g[0]][g[1]])
    first, rest = order[:4], order[4:]
    assert first == sorted(groups, key=lambda g: (alone[g], g))[:4]  # round 0: the cheapest alone
    assert all(result.marginal[l][g] == alone[(l, g)] for l, g in first)
    base = tail_nll(convert(model, ReplacementSpec(2, 4, first), WINDOW), tokens, 40)
    assert result.base == pytest.approx([tail_nll(model, tokens, 40), base], abs=1e-5)
    for layer, group in rest:
        both = convert(model, ReplacementSpec(2, 4, [*first, (layer, group)]), WINDOW)
        assert result.marginal[layer][group] == pytest.approx(tail_nll(both, tokens, 40) - base, abs=1e-5)
    assert rest == sorted(rest, key=lambda g: (result.marginal[g[0]][g[1]], g))  # round 1: cheapest given round 0


def test_rounds_beyond_the_number_of_groups_are_a_one_line_error():
    tokens = torch.randint(0, 97, (2, 96))
    with pytest.raises(ConfigError, match="--ablation-rounds 5 must be <= the model's 4 KV groups"):
        measure_ablation(tiny_model("llama"), tokens, replace(SETTINGS, ablation_rounds=5), progress=False)
    with pytest.raises(ConfigError, match="--ablation-rounds must be >= 1, got 0"):
        replace(SETTINGS, ablation_rounds=0)


def planted_retrieval_model():
    """A tiny Qwen2 whose layer 0, KV group 1 retrieves a marker token from far back.

    The group's queries are a constant (q bias) and its keys read a direction `u` that only
    the marker's embedding has, in the slowest RoPE pair (a rotation of ~0.1 rad over the
    sequence), so its heads put nearly all their mass on the marker wherever it is. Its
    values carry `u` too, and o_proj writes them along `w`, which raises the logits of the
    tokens that follow (lm_head rows of `FOLLOWERS` + w): the output matters.
    """
    model = tiny_model("qwen2")  # 6 query heads, 2 KV groups of 3, head_dim 8, hidden 48
    hidden, head_dim, size = 48, 8, 3
    generator = torch.Generator().manual_seed(5)
    u, w = torch.linalg.qr(torch.randn(hidden, 2, generator=generator))[0].T  # orthonormal
    slow = head_dim // 2 - 1  # the lowest-frequency rotary pair is (slow, slow + head_dim / 2)
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed -= (embed @ u)[:, None] * u  # no token but the marker has a component along u
        embed[MARKER] = u * embed[MARKER].norm()
        for proj in (attention.q_proj, attention.k_proj, attention.v_proj):
            rows = slice(size * head_dim, 2 * size * head_dim) if proj is attention.q_proj else slice(head_dim, 2 * head_dim)
            proj.weight[rows] = 0
            proj.bias[rows] = 0
        for head in range(size, 2 * size):
            attention.q_proj.bias[head * head_dim + slow] = 4.0
        attention.k_proj.weight[head_dim + slow] = 4.0 * u
        attention.v_proj.weight[head_dim] = u
        attention.o_proj.weight[:, size * head_dim:2 * size * head_dim] = 0
        attention.o_proj.weight[:, size * head_dim::head_dim] = 4.0 * w[:, None]
        model.lm_head.weight[FOLLOWERS] += 4.0 * w
    return model


MARKER, FOLLOWERS = 5, slice(20, 30)


def test_a_planted_retrieval_group_is_ranked_most_costly():
    model = planted_retrieval_model()
    tokens = torch.randint(20, 30, (2, 96), generator=torch.Generator().manual_seed(6))
    tokens[:, 10] = MARKER  # beyond the 2 sinks, out of the 16-token window of every scored position (>= 40)
    costs = measure_ablation(model, tokens, SETTINGS, progress=False).costs
    ranked = sorted(c for row in costs for c in row)
    assert costs[0][1] == ranked[-1] and costs[0][1] > 1.0 and costs[0][1] > 5 * abs(ranked[-2])
    greedy = measure_ablation(model, tokens, replace(SETTINGS, ablation_rounds=2), progress=False)
    assert greedy.order[0][1] == 3  # replaced last
    scores = scores_with_costs(model, costs)
    assert (0, 1) not in select_heads(scores, 0.75, make_scorer("ablation")).groups


def test_too_little_calibration_text_says_how_many_tokens_it_needs():
    model = tiny_model("llama")
    with pytest.raises(DataError, match=r"needs 2 x 96 = 192 tokens of calibration text, the data has \d+") as error:
        calibration_sequences(tiny_tokenizer(), ["a few words only"], SETTINGS, model.config)
    assert "\n" not in str(error.value)


def scores_with_costs(model, costs):
    scores = analyze(model, torch.randint(0, 97, (1, 32)), progress=False)
    scores.groups["ablation"] = costs
    scores.ablation = {"ablation_sequences": 1}
    return scores


def test_the_scorer_replaces_the_cheapest_groups_and_the_costs_survive_the_json(tmp_path):
    model = tiny_model("mistral")
    costs = [[0.3, -0.1, 0.2, 0.0], [0.05, 0.4, 0.1, 0.15]]
    scores = scores_with_costs(model, costs)
    spec = select_heads(scores, 0.25, make_scorer("ablation"))
    assert spec.groups == [(0, 1), (0, 3)]
    scores.save(tmp_path / "scores.json")
    loaded = HeadScores.load(tmp_path / "scores.json")
    assert loaded.groups["ablation"] == costs and loaded.ablation == scores.ablation
    torch.testing.assert_close(torch.tensor(loaded.groups["rr_16"]), torch.tensor(scores.groups["rr_16"]))
    assert "ablation" not in loaded.heads


def test_the_scorer_refuses_scores_without_costs():
    scores = analyze(tiny_model("llama"), torch.randint(0, 97, (1, 32)), progress=False)
    with pytest.raises(ConfigError, match="no ablation costs.*--scorer ablation"):
        select_heads(scores, 0.5, make_scorer("ablation"))



def test_the_greedy_scorer_follows_the_rounds_and_its_sets_are_nested(tmp_path):
    model = tiny_model("mistral")
    tokens = torch.randint(0, 97, (2, 96), generator=torch.Generator().manual_seed(7))
    config = replace(SETTINGS, ablation_rounds=2)
    result = measure_ablation(model, tokens, config, progress=False)
    scores = analyze(model, torch.randint(0, 97, (1, 32)), progress=False)
    record_ablation(scores, result, config)
    scores.save(tmp_path / "scores.json")
    loaded = HeadScores.load(tmp_path / "scores.json")
    assert loaded.ablation["round_base_nll"] == result.base and loaded.groups["ablation"] == result.costs
    chosen = {beta: set(select_heads(loaded, beta, make_scorer("ablation-greedy")).groups) for beta in (0.25, 0.5, 0.75)}
    assert chosen[0.5] == {(l, g) for l in range(2) for g in range(4) if result.order[l][g] < 4}  # round 0's set
    assert chosen[0.25] < chosen[0.5] < chosen[0.75]
    assert set(select_heads(loaded, 0.5, make_scorer("ablation")).groups) == chosen[0.5]
    assert chosen[0.75] != set(select_heads(loaded, 0.75, make_scorer("ablation")).groups)  # round 1 re-ranked


def test_the_greedy_scorer_refuses_scores_without_an_order():
    model = tiny_model("llama")
    scores = scores_with_costs(model, [[0.1, 0.2], [0.3, 0.4]])
    with pytest.raises(ConfigError, match="no greedy ablation order.*--scorer ablation-greedy"):
        select_heads(scores, 0.5, make_scorer("ablation-greedy"))
