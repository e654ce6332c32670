"""The ablation scorer: each group's cost is what converting it alone to a window costs."""

import json

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_model, tiny_tokenizer

from recurformer.ablation import AblationConfig, ablation_costs, calibration_sequences, window_mask
from recurformer.config import ConfigError, MixerConfig, ReplacementSpec
from recurformer.data import DataError
from recurformer.scoring import HeadScores, analyze, make_scorer, select_heads
from recurformer.surgery import convert

SETTINGS = AblationConfig(ablation_sequences=2, ablation_seq_len=96, ablation_from=40, ablation_window=16,
                          ablation_sinks=2)


def tail_nll(model, tokens, start):
    with torch.no_grad():
        logits = model(tokens, use_cache=False).logits.float()
    return F.cross_entropy(logits[:, start - 1:-1].transpose(1, 2), tokens[:, start:]).item()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_a_cost_is_what_converting_that_group_alone_to_the_window_mixer_costs(arch):
    model = tiny_model(arch)
    tokens = torch.randint(0, 97, (2, 96), generator=torch.Generator().manual_seed(0))
    costs, base = ablation_costs(model, tokens, SETTINGS, progress=False)
    assert base == pytest.approx(tail_nll(model, tokens, 40), abs=1e-5)
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    window = MixerConfig(kind="window", window=16, sinks=2)
    for layer in range(layers):
        for group in range(kv_heads):
            converted = convert(model, ReplacementSpec(layers, kv_heads, [(layer, group)]), window)
            assert costs[layer][group] == pytest.approx(tail_nll(converted, tokens, 40) - base, abs=1e-5)
    assert max(abs(c) for row in costs for c in row) > 1e-4  # the windows do change something


def test_a_group_whose_output_columns_are_zero_costs_nothing():
    model = tiny_model("llama")
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    size = model.config.num_attention_heads // model.config.num_key_value_heads
    with torch.no_grad():  # layer 0, KV group 1: its query heads' columns of o_proj
        model.model.layers[0].self_attn.o_proj.weight[:, size * head_dim:2 * size * head_dim] = 0
    tokens = torch.randint(0, 97, (2, 96), generator=torch.Generator().manual_seed(1))
    costs, _ = ablation_costs(model, tokens, SETTINGS, progress=False)
    assert abs(costs[0][1]) <= 1e-6
    assert abs(costs[0][0]) > 1e-4


def test_costs_do_not_depend_on_how_the_groups_are_batched():
    model = tiny_model("mistral")  # 4 KV groups per layer
    tokens = torch.randint(0, 97, (2, 96), generator=torch.Generator().manual_seed(2))
    together, _ = ablation_costs(model, tokens, SETTINGS, progress=False)
    for per_batch in (1, 3):
        apart, _ = ablation_costs(model, tokens, SETTINGS, groups_per_batch=per_batch, progress=False)
        torch.testing.assert_close(torch.tensor(apart), torch.tensor(together), atol=1e-6, rtol=0)


def test_an_interrupted_run_resumes_from_the_checkpoint(tmp_path, monkeypatch):
    model = tiny_model("llama")
    tokens = torch.randint(0, 97, (2, 96), generator=torch.Generator().manual_seed(3))
    checkpoint = tmp_path / "partial.json"
    full, _ = ablation_costs(model, tokens, SETTINGS, checkpoint=checkpoint, progress=False)
    saved = json.loads(checkpoint.read_text())
    saved["costs"] = [c for c in saved["costs"] if c["layer"] == 0]  # as if stopped after layer 0
    checkpoint.write_text(json.dumps(saved))
    with torch.no_grad():  # a changed layer 0 shows whether layer 0 was recomputed
        model.model.layers[0].mlp.down_proj.weight.mul_(2)
    # (the fingerprint hashes layer 0's q_proj, which is unchanged: the checkpoint still applies)
    resumed, _ = ablation_costs(model, tokens, SETTINGS, checkpoint=checkpoint, progress=False)
    assert resumed[0] == full[0]  # read back, not recomputed
    assert resumed[1] != full[1]  # recomputed on the changed model
    other = AblationConfig(ablation_sequences=2, ablation_seq_len=96, ablation_from=50)
    with pytest.raises(ConfigError, match="other settings"):
        ablation_costs(model, tokens, other, checkpoint=checkpoint, progress=False)


def test_too_little_calibration_text_says_how_many_tokens_it_needs():
    model = tiny_model("llama")
    with pytest.raises(DataError, match=r"needs 2 x 96 = 192 tokens of calibration text, the data has \d+") as error:
        calibration_sequences(tiny_tokenizer(), ["a few words only"], SETTINGS, model.config)
    assert "\n" not in str(error.value)


def test_window_mask_matches_the_window_mixer_rule():
    mask = window_mask(10, 3, 2)
    assert mask[7].tolist() == [True, True, False, False, False, True, True, True, False, False]
    assert mask[1].tolist() == [True, True] + [False] * 8


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

