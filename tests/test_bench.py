import json

import pytest
import torch
from tiny_models import save_tiny_model, spec_for, tiny_model

from recurformer.bench import cache_bytes, compare, max_context, median_measurements, new_cache
from recurformer.cache import CACHE_ARGUMENT
from recurformer.config import MixerConfig
from recurformer.memory import PeakMemory
from recurformer.cli import main
from recurformer.surgery import convert


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


def test_rounds_give_median_ratios_with_their_range():
    model = tiny_model("llama")
    converted = convert(model, spec_for(model, 0.5), init="random")
    result = compare({"original": (model, "dynamic"), "half": (converted, "hybrid")}, ["original"], [16, 32],
                     decode_steps=2, rounds=3)
    assert result["rounds"] == 3 and len(result["measurements"]) == 12
    for ratio in result["ratios"]:
        speedups = [
            next(m for m in result["measurements"] if m["model"] == "half" and m["round"] == i and m["context"] == ratio["context"])
            ["decode_tokens_per_s"] / next(m for m in result["measurements"] if m["model"] == "original" and m["round"] == i
                                           and m["context"] == ratio["context"])["decode_tokens_per_s"]
            for i in range(3)
        ]
        assert ratio["decode_speedup"] == pytest.approx(sorted(speedups)[1])
        assert (ratio["decode_speedup_min"], ratio["decode_speedup_max"]) == pytest.approx((min(speedups), max(speedups)))
    medians = median_measurements(result)
    assert len(medians) == 4 and all(row["rounds"] == 3 for row in medians)


def test_settled_peak_memory_counts_memory_an_earlier_measurement_left_resident():
    chunk = 16 << 20  # below glibc's largest mmap threshold: freed chunks stay in the heap

    def allocate():
        return [torch.ones(chunk // 4) for _ in range(4)]

    for _ in range(2):  # the first frees raise glibc's threshold; later chunks live in the heap
        with PeakMemory(interval=0.002, settle=True) as first:
            buffers = allocate()
        del buffers
    with PeakMemory(interval=0.002, settle=True) as second:
        buffers = allocate()
    del buffers
    assert first.growth >= 3 * chunk and second.growth >= 3 * chunk


def test_max_context_for_a_budget():
    assert max_context(kv_bytes=1000, state_bytes=0, context=10, budget_bytes=10_000) == 100
    assert max_context(kv_bytes=500, state_bytes=1000, context=10, budget_bytes=10_000) == 180
    assert max_context(kv_bytes=0, state_bytes=1000, context=10, budget_bytes=10_000) == -1


def test_bench_command(tmp_path, capsys):
    save_tiny_model(tmp_path / "model")
    (tmp_path / "text.txt").write_text(" ".join(["the quick brown fox jumps"] * 300))
    assert main(["analyze", str(tmp_path / "model"), "--data", str(tmp_path / "text.txt"), "--out", str(tmp_path / "s.json"),
                 "--sequences", "2", "--seq-len", "32", "--scorer", "recency"]) == 0
    assert main(["convert", str(tmp_path / "model"), "--scores", str(tmp_path / "s.json"), "--scorer", "recency", "--beta", "0.5",
                 "--out", str(tmp_path / "conv")]) == 0
    code = main(["bench", str(tmp_path / "conv"), "--context", "16,32", "--decode-steps", "2",
                 "--out", str(tmp_path / "bench.json"), "--plot", str(tmp_path / "bench.png")])
    assert code == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert {r["model"] for r in result["measurements"]} == {"original", "original+static-cache", str(tmp_path / "conv")}
    assert (tmp_path / "bench.png").stat().st_size > 1000


def test_cache_bytes_count_what_is_held_and_what_is_reserved():
    """A static cache reserves its full length; a dynamic one what it holds; a hybrid one its
    buffers, at least what it holds."""
    model = tiny_model("llama")
    prompt = torch.randint(0, 97, (1, 20))
    per_token = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * 12 * 4  # K and V, fp32
    with torch.no_grad():
        static = model(prompt, **{CACHE_ARGUMENT: new_cache(model, "static", 100)}, use_cache=True)[CACHE_ARGUMENT]
        dynamic = model(prompt, **{CACHE_ARGUMENT: new_cache(model, "dynamic", 100)}, use_cache=True)[CACHE_ARGUMENT]
        converted = convert(model, spec_for(model, 0.5), MixerConfig(kind="mamba"))
        hybrid = converted(prompt, **{CACHE_ARGUMENT: new_cache(converted, "hybrid", 100)}, use_cache=True)[CACHE_ARGUMENT]
    assert cache_bytes(dynamic) == (20 * per_token, 20 * per_token, 0)
    held, reserved, state = cache_bytes(static)
    assert (held, reserved, state) == (20 * per_token, 100 * per_token, 0)
    held, reserved, state = cache_bytes(hybrid)
    assert held == 20 * per_token // 2 and reserved >= held and state > 0


def test_bench_script_variants_name_their_shape():
    from benchmark_scripts import benchmark_script

    with benchmark_script("speed.bench") as script:
        assert script.parse_variant("mamba:0.75") == ("mamba", 0.75, {})
        assert script.parse_variant("window+mamba2:0.5:window=141:ssd_state=16") == (
            "window+mamba2", 0.5, {"window": 141, "ssd_state": 16})
        for bad in ("window:0.5:width=64", "window:0.5:window=-1", "window:0.5:window"):
            with pytest.raises(SystemExit, match="bad variant field"):
                script.parse_variant(bad)
        for bad in ("window", "window:half"):
            with pytest.raises(SystemExit, match="expected mixer:beta"):
                script.parse_variant(bad)
