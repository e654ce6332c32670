import json

import pytest

from recurformer.bench import compare, max_context
from recurformer.cli import main
from recurformer.surgery import convert
from tiny_models import save_tiny_model, spec_for, tiny_model


def test_compare_measures_every_contender_and_ratio():
    model = tiny_model("llama")
    converted = convert(model, spec_for(model, 0.5), init="random")
    result = compare(
        {"original": (model, "dynamic"), "static": (model, "static"), "half": (converted, "hybrid")},
        ["original", "static"], [16, 64], decode_steps=3,
    )
    assert len(result["measurements"]) == 6 and len(result["ratios"]) == 4
    rows = {(r["model"], r["context"]): r for r in result["measurements"]}
    for context in (16, 64):
        assert rows[("half", context)]["kv_bytes"] * 2 == rows[("original", context)]["kv_bytes"]
        assert rows[("half", context)]["state_bytes"] == rows[("half", 16)]["state_bytes"] > 0
        assert rows[("original", context)]["decode_tokens_per_s"] > 0
    ratio = next(r for r in result["ratios"] if r["baseline"] == "original" and r["context"] == 64)
    expected = rows[("half", 64)]["cache_bytes"] / rows[("original", 64)]["cache_bytes"]
    assert ratio["cache_bytes_ratio"] == pytest.approx(expected)


def test_max_context_for_a_budget():
    assert max_context(kv_bytes=1000, state_bytes=0, context=10, budget_bytes=10_000) == 100
    assert max_context(kv_bytes=500, state_bytes=1000, context=10, budget_bytes=10_000) == 180
    assert max_context(kv_bytes=0, state_bytes=1000, context=10, budget_bytes=10_000) == -1


def test_bench_command(tmp_path, capsys):
    save_tiny_model(tmp_path / "model")
    (tmp_path / "text.txt").write_text(" ".join(["the quick brown fox jumps"] * 300))
    assert main(["analyze", str(tmp_path / "model"), "--data", str(tmp_path / "text.txt"), "--out", str(tmp_path / "s.json"),
                 "--sequences", "2", "--seq-len", "32"]) == 0
    assert main(["convert", str(tmp_path / "model"), "--scores", str(tmp_path / "s.json"), "--beta", "0.5",
                 "--out", str(tmp_path / "conv")]) == 0
    code = main(["bench", str(tmp_path / "conv"), "--context", "16,32", "--decode-steps", "2",
                 "--out", str(tmp_path / "bench.json"), "--plot", str(tmp_path / "bench.png")])
    assert code == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert {r["model"] for r in result["measurements"]} == {"original", "original+static-cache", str(tmp_path / "conv")}
    assert (tmp_path / "bench.png").stat().st_size > 1000
