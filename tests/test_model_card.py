"""The model card (README.md) of converted and trained folders: its metadata block, its facts
for a tiny conversion from a hub id, the training it names, and a run's measured numbers."""

from __future__ import annotations

import json

import pytest
import yaml
from hub_cache import cache_folder
from tiny_models import save_tiny_model, spec_for

from recurformer.commands import train_command
from recurformer.loading import load_model, portable_name, save_model
from recurformer.mixers import MixerConfig
from recurformer.model_card import CARD, folder_facts, front_matter, render_model_card, source_facts
from recurformer.run.stages import metric_table
from recurformer.surgery import convert
from recurformer.train import TrainConfig

REPO = "tiny-org/tiny-llama"
# The numbers the card shows, as a run's metrics.json holds them (made up here).
RESULTS = {
    "quick": False, "baseline_window": 1169, "bench_context": 4096,
    "ppl_original": 19.2349, "ppl_final": 19.6993, "ppl_ratio": 1.02415, "ppl_baseline": 19.9123,
    "ppl_baseline_ratio": 1.03522, "ppl_ood_original": 27.1491, "ppl_ood_final": 27.3906, "ppl_ood_ratio": 1.00890,
    "ppl_ood_baseline": 27.4961, "ppl_ood_baseline_ratio": 1.01278, "cache_bytes_original": 188743680,
    "cache_bytes_final": 98386760, "cache_ratio": 0.52127, "decode_tokens_per_s_original": 21.1615,
    "decode_tokens_per_s_final": 27.6061, "decode_speedup": 1.30454,
}


@pytest.fixture
def converted(tmp_path, monkeypatch):
    """A tiny Llama in a hub cache (licence `mit` in its own card), converted at beta 0.5."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    files = save_tiny_model(tmp_path / "files")
    (files / "README.md").write_text("---\nlicense: mit\ntags:\n- tiny\n---\n# a tiny model\n")
    snapshot = cache_folder(tmp_path / "hub", REPO, files)
    original, tokenizer, _ = load_model(REPO, progress=False)
    spec = spec_for(original, 0.5)
    mixer = MixerConfig(kind="window+mamba2", window=16, ssd_state=8)
    model = convert(original, spec, mixer, source_model=portable_name(REPO))
    save_model(model, tokenizer, tmp_path / "converted")
    return {"dir": tmp_path / "converted", "spec": spec, "mixer": mixer, "config": original.config, "commit": snapshot.name}


def metadata_block(card: str) -> list[str]:
    lines = card.splitlines()
    assert lines[0] == "---"
    return lines[1:lines.index("---", 1)]


def test_the_card_of_a_conversion_states_its_facts(converted):
    card = (converted["dir"] / CARD).read_text()
    block = metadata_block(card)
    assert all(": " in line and not line.startswith(" ") for line in block)  # key: value lines
    metadata = yaml.safe_load("\n".join(block))
    assert metadata == {"base_model": REPO, "library_name": "recurformer", "license": "mit",
                        "pipeline_tag": "text-generation", "tags": ["recurformer", "hybrid-attention", "window+mamba2"]}
    assert front_matter(card)["license"] == "mit"

    spec, config, mixer = converted["spec"], converted["config"], converted["mixer"]
    total = config.num_hidden_layers * config.num_key_value_heads
    assert f"revision `{converted['commit']}`" in card
    assert f"Replaced: {len(spec.groups)} of {total} KV groups ({len(spec.groups) / total:.0%})" in card
    assert f"{config.num_hidden_layers} layers, {config.num_attention_heads} query heads in " \
           f"{config.num_key_value_heads} KV groups per layer" in card
    by_layer = "; ".join(f"{layer}: {', '.join(str(h) for h in spec.replaced_heads(layer))}"
                         for layer in range(spec.num_layers) if spec.replaced_heads(layer))
    assert f"(layer: heads): {by_layer}" in card
    assert f"`window+mamba2` (ssd_state {mixer.ssd_state}, window {mixer.window}, sinks {mixer.sinks}" in card
    assert "Not trained after the conversion" in card and "## Measured" not in card
    assert "import recurformer" in card and "AutoModelForCausalLM.from_pretrained(" in card
    assert not [p.name for p in converted["dir"].iterdir() if p.name.startswith(".")]  # no temporary files left


def test_a_trained_folder_card_names_its_training(converted, tmp_path):
    text = tmp_path / "train.txt"
    text.write_text("the quick brown fox jumps over the lazy dog . " * 200)
    sizes = dict(steps=2, seq_len=32, batch_size=2, precision="no")
    train_command(str(converted["dir"]), [str(text)], str(tmp_path / "transfer"), TrainConfig(stage="transfer", **sizes))
    train_command(str(tmp_path / "transfer"), [str(text)], str(tmp_path / "lm"),
                  TrainConfig(stage="lm", trainable="mixers", **sizes))
    stages = [json.loads((tmp_path / name / "train_summary.json").read_text()) for name in ("transfer", "lm")]

    transfer_card = (tmp_path / "transfer" / CARD).read_text()
    assert f"- `transfer` stage: {stages[0]['steps']:,} steps, {stages[0]['tokens']:,} tokens" in transfer_card
    lm_card = (tmp_path / "lm" / CARD).read_text()
    for stage in stages:
        assert f"- `{stage['stage']}` stage: {stage['steps']:,} steps, {stage['tokens']:,} tokens" in lm_card
    assert f"In all: {stages[0]['tokens'] + stages[1]['tokens']:,} training tokens" in lm_card
    assert yaml.safe_load("\n".join(metadata_block(lm_card)))["base_model"] == REPO  # the teacher's hub id carried on


def test_the_card_reads_metrics_a_run_records():
    metrics, _ = metric_table()
    assert set(RESULTS) <= {metric.key for metric in metrics}


def test_a_run_card_shows_the_measured_numbers(converted):
    results = RESULTS
    card = render_model_card({**folder_facts(converted["dir"]), "results": results})
    r = results
    assert f"window at equal cache ({r['baseline_window']:,} tokens)" in card
    assert (f"| perplexity, held-out text | {r['ppl_original']:.2f} | {r['ppl_final']:.2f} ({r['ppl_ratio']:.3f}x) | "
            f"{r['ppl_baseline']:.2f} ({r['ppl_baseline_ratio']:.3f}x) |") in card
    assert f"{r['ppl_ood_final']:.2f} ({r['ppl_ood_ratio']:.3f}x)" in card
    assert (f"| cache at {r['bench_context']:,} tokens | {r['cache_bytes_original'] / 2**20:,.1f} MiB | "
            f"{r['cache_bytes_final'] / 2**20:,.1f} MiB ({r['cache_ratio']:.3f}x) |") in card
    assert f"{r['decode_tokens_per_s_final']:.1f} ({r['decode_speedup']:.2f}x)" in card
    assert "quick run" not in card
    assert "A quick run" in render_model_card({**folder_facts(converted["dir"]), "results": {**results, "quick": True}})
    assert "## Measured" not in render_model_card({**folder_facts(converted["dir"]), "results": {"seed": 0}})


def test_a_registry_source_names_its_hub_repo_and_license():
    facts = source_facts("smollm2-135m")
    assert (facts["base_model"], facts["license"]) == ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")


def test_a_source_gone_missing_leaves_its_name_only(tmp_path):
    assert source_facts(str(tmp_path / "deleted-folder")) == {"source_model": str(tmp_path / "deleted-folder")}


def test_front_matter_reads_top_level_scalars_only():
    card = "---\nlicense: 'apache-2.0'\nlanguage:\n- en\ntags: [a, b]\nbase_model: org/name\n---\nlicense: no\n"
    assert front_matter(card) == {"license": "apache-2.0", "base_model": "org/name"}
    assert front_matter("# no metadata\nlicense: mit\n") == {}
