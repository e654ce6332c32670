"""`benchmarks/quality/mixers.py`: the table is built only from finished runs trained alike."""

import json
from pathlib import Path

import pytest
from benchmark_scripts import benchmark_script


@pytest.fixture(scope="module")
def mixers():
    with benchmark_script("quality.mixers") as module:
        yield module


def fake_run(root: Path, folder: str, ppl_final: float, **changes) -> str:
    metrics = {
        "model": "smollm2-135m", "beta": 0.5, "scorer": "recency", "seed": 0, "quick": False, "mixer": folder,
        "replaced_groups": 45, "transfer_steps": 40, "transfer_tokens": 163840, "lm_steps": 16, "lm_tokens": 65536,
        "transfer_minutes": 8.0, "lm_minutes": 16.0, "ppl_tokens": 16368, "ppl_original": 22.96,
        "ppl_converted": 4000.0, "ppl_transfer": 150.0, "ppl_final": ppl_final, "ppl_ratio": ppl_final / 22.96,
        "hashhop_original": 0.12, "hashhop_final": 0.0, "mqar_original": 0.15, "mqar_final": 0.01,
        "params_original": 100, "params_converted": 105, "cache_bytes_final": 1000, "cache_ratio": 0.5,
        "decode_speedup": 1.5, "decode_speedup_vs_static_cache": 1.0, "prefill_time_ratio": 0.9,
        "bench_context": 4096, "bench_threads": 1, "params_ratio": 1.05, "transfer_s_per_step": 12.0,
        "lm_s_per_step": 60.0, **changes,
    }
    directory = root / folder
    directory.mkdir()
    (directory / "metrics.json").write_text(json.dumps(metrics))
    return str(directory)


def test_table_of_comparable_runs(mixers, tmp_path):
    runs = [fake_run(tmp_path, "mamba", 65.5), fake_run(tmp_path, "window", 40.25)]
    assert mixers.main([*runs, "--out", str(tmp_path / "table")]) == 0
    table = json.loads((tmp_path / "table.json").read_text())
    assert [r["mixer"] for r in table["runs"]] == ["mamba", "window"]
    assert table["runs"][0]["transfer_s_per_step"] == pytest.approx(12.0)
    assert table["runs"][1]["lm_s_per_step"] == pytest.approx(60.0)
    text = (tmp_path / "table.md").read_text()
    assert "| `window` | 1.050x |" in text and "Lowest final held-out perplexity: `window` (40.25)" in text
    assert "| **40.25** |" in text and "| 65.50 |" in text  # lower perplexity is better: the best is bold


def test_one_table_per_beta_and_evaluation(mixers, tmp_path):
    new = dict(ppl_context=2048, ppl_original=19.2, ppl_ood_original=28.4, ppl_ood_ratio=1.03, baseline_window=169,
               ppl_baseline_ratio=1.031)
    runs = [fake_run(tmp_path, "mamba", 65.5), fake_run(tmp_path, "window+mamba2", 19.7, **new),
            fake_run(tmp_path, "wm2-075", 20.5, mixer="window+mamba2", beta=0.75, **new)]
    assert mixers.main([*runs, "--out", str(tmp_path / "table")]) == 0
    text = (tmp_path / "table.md").read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == ["## beta 0.5, perplexity in windows of 2,048",
                        "## beta 0.5, perplexity in windows of 1,024 (an older version)",
                        "## beta 0.75, perplexity in windows of 2,048"]
    assert "(out-of-domain: 28.40)" in text and "| 169 |" in text


def test_columns_come_from_the_metric_table(mixers):
    from recurformer.metrics import by_key
    from recurformer.run import metric_table

    table = by_key(metric_table()[0])
    assert set(mixers.COLUMNS) <= set(table)


@pytest.mark.parametrize("change, message", [
    (dict(lm_steps=17), "lm_steps is 17 there and 16 here"),
    (dict(seed=1), "seed is 1 there and 0 here"),
    (dict(ppl_original=22.97), "ppl_original is 22.97 there and 22.96 here"),
    (dict(mixer="mamba"), "each run must differ in mixer or learning rates"),
])
def test_runs_trained_differently_are_refused(mixers, tmp_path, change, message):
    runs = [fake_run(tmp_path, "mamba", 65.5), fake_run(tmp_path, "window", 40.25, **change)]
    with pytest.raises(SystemExit, match=message):
        mixers.main([*runs, "--out", str(tmp_path / "table")])
    assert not (tmp_path / "table.md").exists()


def test_the_original_perplexity_may_differ_in_the_last_digits(mixers, tmp_path):
    """The same original, evaluated with logits summed in another order, is the same run."""
    runs = [fake_run(tmp_path, "mamba", 65.5), fake_run(tmp_path, "window", 40.25, ppl_original=22.96 * (1 + 1e-7))]
    assert mixers.main([*runs, "--out", str(tmp_path / "table")]) == 0
    assert (tmp_path / "table.md").exists()


def test_same_mixer_with_other_learning_rates_is_its_own_row(mixers, tmp_path):
    runs = [fake_run(tmp_path, "mamba2", 5631.0, lm_lr=1e-3), fake_run(tmp_path, "mamba2-slow", 80.0, mixer="mamba2", lm_lr=2e-4)]
    assert mixers.main([*runs, "--out", str(tmp_path / "table")]) == 0
    text = (tmp_path / "table.md").read_text()
    # labelled against mamba2's own defaults (5e-3, 2e-4), not mamba's
    assert "| `mamba2 (lr 0.005, 0.001)` |" in text and "| `mamba2` |" in text


def test_an_unfinished_run_is_refused(mixers, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="has no metrics.json"):
        mixers.main([str(tmp_path / "empty")])
