import json

import pytest
import torch
from tiny_models import save_tiny_model, spec_for, tiny_model, tiny_tokenizer

from recurformer import attention
from recurformer.bench import (BenchConfig, against_original, cache_bytes, compare, max_context, measure, median_measurements,
                               new_cache, padded_prompts)
from recurformer.cache import CACHE_ARGUMENT
from recurformer.cli import main
from recurformer.config import ConfigError
from recurformer.memory import PeakMemory
from recurformer.mixers import MixerConfig
from recurformer.ops.attention_step import AttentionStepKernel
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


def test_padded_prompts_are_left_padded_rows_of_different_lengths():
    ids, mask = padded_prompts(97, batch=4, context=16, seed=0)
    assert ids.shape == mask.shape == (4, 16)
    assert mask.sum(1).tolist() == [16, 14, 12, 10]  # context - i * context // (2 * batch)
    for row in range(4):
        padding = 16 - int(mask[row].sum())
        assert mask[row, :padding].sum() == 0 and mask[row, padding:].all() and ids[row, :padding].eq(0).all()
    alone, none_padded = padded_prompts(97, batch=1, context=16, seed=0)
    assert none_padded.all() and torch.equal(alone, ids[:1])


def test_batches_give_per_sequence_and_total_speed_and_the_largest_batch_in_a_budget():
    model = tiny_model("llama")
    # A window of 8 tokens: at 32 tokens the converted cache is then smaller than the original's.
    converted = convert(model, spec_for(model, 0.5), MixerConfig(kind="window+mamba2", window=8), init="random")
    budget = 1 << 20
    result = compare({"original": (model, "dynamic"), "static": (model, "static"), "half": (converted, "hybrid")},
                     ["original", "static"], [16, 32], decode_steps=2, budget_bytes=budget, batches=[1, 3])
    assert result["batches"] == [1, 3] and result["dtype"] == "float32"
    rows = {(r["model"], r["context"], r["batch"]): r for r in result["measurements"]}
    assert len(rows) == len(result["measurements"]) == 3 * 2 * 2
    for (name, context, batch), row in rows.items():
        assert row["decode_total_tokens_per_s"] == pytest.approx(batch * row["decode_tokens_per_s"])
        assert row["compile_s"] is None
        # Every row holds `context` slots of K/V, padding included; the state is per row.
        alone = rows[(name, context, 1)]
        assert (row["kv_bytes"], row["state_bytes"]) == (batch * alone["kv_bytes"], batch * alone["state_bytes"])
    assert len(result["ratios"]) == 2 * 2 * 2  # (half against each baseline) x contexts x batches
    ratio = next(r for r in result["ratios"] if (r["baseline"], r["context"], r["batch"]) == ("static", 32, 3))
    assert ratio["decode_speedup"] == pytest.approx(
        rows[("half", 32, 3)]["decode_total_tokens_per_s"] / rows[("static", 32, 3)]["decode_total_tokens_per_s"])
    for entry in result["cache_budget"]:  # from the measured bytes at the longest context
        row = rows[(entry["model"], 32, 1)]
        assert entry["context"] == 32 and entry["bytes_per_sequence"] == row["cache_bytes"]
        assert entry["max_batch"] == budget // row["cache_bytes"] > 0
    budgets = {b["model"]: b["max_batch"] for b in result["cache_budget"]}
    assert budgets["half"] > budgets["original"] == budgets["static"]
    medians = median_measurements(result)
    assert {(m["model"], m["batch"]) for m in medians} == {(n, b) for n in ("original", "static", "half") for b in (1, 3)}


@pytest.mark.parametrize("decoder", ["bench", "generate"])
def test_a_batched_decode_keeps_the_fast_paths(monkeypatch, decoder):
    """With left padding every decode step still takes the mixer's `step` and a one-query
    attention of the kept heads (their compiled step where the kernels are built, else the
    packed attention), in every layer, in the benchmark and in `generate`."""
    model = tiny_model("llama")
    converted = convert(model, spec_for(model, 0.5), MixerConfig(kind="window+mamba2", window=8, sinks=1, ssd_chunk=8),
                        init="random")
    calls = {"step": 0, "forward": 0, "attention": 0}
    packed, compiled_step = attention.packed_decode_attention, AttentionStepKernel.__call__

    def counting(*args, _call=packed, **kwargs):
        calls["attention"] += 1
        return _call(*args, **kwargs)

    monkeypatch.setattr(attention, "packed_decode_attention", counting)
    monkeypatch.setattr(AttentionStepKernel, "__call__", lambda *a, **k: counting(*a, _call=compiled_step, **k))
    for layer in converted.hybrid_attentions():
        for method in ("step", "forward"):
            original = getattr(layer.mixer, method)
            monkeypatch.setattr(layer.mixer, method, lambda *a, _o=original, _m=method, **k: (
                calls.__setitem__(_m, calls[_m] + 1), _o(*a, **k))[1])
    if decoder == "bench":
        measure(converted, "half", context=12, cache="hybrid", decode_steps=3, warmup=1, batch=3)
    else:
        ids, mask = padded_prompts(97, batch=3, context=12)
        converted.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    layers = converted.hybrid_attentions()
    with_mixer, with_heads = sum(layer.mixer is not None for layer in layers), sum(layer.has_attention for layer in layers)
    assert with_mixer and with_heads
    assert calls == {"step": 4 * with_mixer, "forward": with_mixer, "attention": 4 * with_heads}  # 4 steps after the prefill


def test_a_compiled_baseline_that_cannot_compile_is_skipped_with_its_reason(monkeypatch):
    model = tiny_model("llama")
    converted = convert(model, spec_for(model, 0.5), init="random")

    def no_compiler(config):
        def fail(*args, **kwargs):
            raise RuntimeError("InductorError: no working C++ compiler\nmore detail")
        return fail

    monkeypatch.setattr(model, "get_compiled_call", no_compiler)
    result = against_original({"half": converted}, model, BenchConfig(contexts=(16,), decode_steps=2, compile=True))
    assert result["skipped"] == [{"model": "original+static-cache+compiled",
                                  "reason": "torch.compile failed: RuntimeError: InductorError: no working C++ compiler"}]
    assert result["baselines"] == ["original", "original+static-cache"]
    assert {r["model"] for r in result["measurements"]} == {"original", "original+static-cache", "half"}


@pytest.mark.slow
def test_the_compiled_static_cache_baseline_is_timed_apart_from_its_compilation():
    model = tiny_model("llama")
    converted = convert(model, spec_for(model, 0.5), init="random")
    result = against_original({"half": converted}, model, BenchConfig(contexts=(16, 24), batches=(1, 2), decode_steps=2,
                                                                      compile=True))
    assert result["skipped"] == [] and "original+static-cache+compiled" in result["baselines"]
    compiled = [r for r in result["measurements"] if r["model"] == "original+static-cache+compiled"]
    assert len(compiled) == 4 and all(r["decode_tokens_per_s"] > 0 and r["compile_s"] >= 0 for r in compiled)
    assert result["compile_s"]["original+static-cache+compiled"] > 0
    assert any(r["baseline"] == "original+static-cache+compiled" for r in result["ratios"])


def test_the_benchmark_refuses_a_model_in_another_dtype():
    model = tiny_model("llama")
    converted = convert(model, spec_for(model, 0.5), init="random")
    with pytest.raises(ConfigError, match="the original is in torch.float32, the benchmark in bfloat16"):
        against_original({"half": converted}, model, BenchConfig(contexts=(16,), dtype="bfloat16"))


@pytest.fixture(scope="module")
def converted_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    save_tiny_model(root / "model")
    model = tiny_model("llama")
    converted = convert(model, spec_for(model, 0.5), init="random", source_model=str(root / "model"))
    converted.save_pretrained(root / "conv")
    tiny_tokenizer().save_pretrained(root / "conv")
    return root


def test_bench_command_with_batches_in_bfloat16(converted_dir, capsys):
    out = converted_dir / "batched.json"
    code = main(["bench", str(converted_dir / "conv"), "--context", "16", "--batch", "1,2", "--decode-steps", "2",
                 "--dtype", "bfloat16", "--out", str(out), "--plot", str(converted_dir / "batched.png")])
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["dtype"] == "bfloat16" and result["batches"] == [1, 2]  # against_original checks every model's dtype
    assert {(r["model"], r["batch"]) for r in result["measurements"]} == {
        (name, batch) for name in ("original", "original+static-cache", str(converted_dir / "conv")) for batch in (1, 2)}
    assert all(b["max_batch"] > 0 for b in result["cache_budget"])
    assert (converted_dir / "batched.png").stat().st_size > 1000


@pytest.mark.parametrize("flags, message", [
    (("--batch", "0"), "--batch: expected positive integers, got '0' (see --help)"),
    (("--batch", "4,x"), "--batch: expected comma-separated integers, got '4,x' (see --help)"),
    (("--dtype", "float8"), "--dtype: expected one of float32, bfloat16, float16, got 'float8' (see --help)"),
])
def test_bad_bench_values_are_one_line_errors(converted_dir, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", str(converted_dir / "conv"), *flags, "--out", str(converted_dir / "never.json")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert err.rstrip("\n").split("\n")[-1] == f"recurformer bench: error: {message}"
    assert not (converted_dir / "never.json").exists()


def test_prefill_once_decodes_every_round_from_a_copy_of_one_prefilled_cache(monkeypatch):
    from recurformer import bench

    model = tiny_model("llama")
    converted = convert(model, spec_for(model, 0.5), MixerConfig(kind="window+mamba2", window=8, sinks=1, ssd_chunk=8),
                        init="random")
    prefills, starts = [], []
    for net in (model, converted):
        forward = net.forward

        def counting(*args, _forward=forward, **kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is not None and ids.shape[1] > 1:
                prefills.append(ids.shape)
            return _forward(*args, **kwargs)

        monkeypatch.setattr(net, "forward", counting)
    decode = bench.timed_decode

    def recording(model, step_call, cache, *args):
        starts.append(int(cache.get_seq_length()))
        return decode(model, step_call, cache, *args)

    monkeypatch.setattr(bench, "timed_decode", recording)
    result = compare({"original": (model, "dynamic"), "half": (converted, "hybrid")}, ["original"], [24], decode_steps=3,
                     rounds=3, batches=[2], prefill_once=True)
    assert len(prefills) == 2 + 2  # one warm-up and one measured prefill per model
    measured = starts[2:]  # after the two warm-ups
    assert measured == [24] * 6  # every round of both models starts from the prefilled cache, not after a decode
    rows = result["measurements"]
    assert sorted((r["model"], r["round"]) for r in rows) == sorted((m, i) for m in ("original", "half") for i in range(3))
    for name in ("original", "half"):
        mine = [r for r in rows if r["model"] == name]
        assert len({r["prefill_s"] for r in mine}) == 1 and all(r["peak_memory_bytes"] is None for r in mine)
    (ratio,) = result["ratios"]
    assert "peak_memory_ratio" not in ratio and ratio["decode_speedup_min"] <= ratio["decode_speedup"] <= ratio["decode_speedup_max"]
    assert result["prefill_once"] is True
    assert all("peak_memory_bytes" not in row for row in median_measurements(result))


def test_llama_cpp_rows_pair_each_context_with_its_prefill():
    """benchmarks/speed/llama_cpp.py: llama-bench's JSON records (the fields it writes) become
    one row per context, decode at that depth beside the prefill of that many tokens."""
    from benchmarks.speed.llama_cpp import CONVERSION, markdown, rows_of

    def record(n_prompt, n_gen, n_depth, ts):
        return {"n_prompt": n_prompt, "n_gen": n_gen, "n_depth": n_depth, "n_threads": 2, "avg_ts": ts, "stddev_ts": 0.5}

    prefill = [record(512, 0, 0, 1024.0), record(2048, 0, 0, 512.0)]
    decode = [record(0, 32, 512, 80.0), record(0, 32, 2048, 60.0)]
    rows = rows_of("Q8_0", prefill, decode)
    assert [(r["context"], r["decode_tokens_per_s"], r["prefill_s"]) for r in rows] == [(512, 80.0, 0.5), (2048, 60.0, 4.0)]
    assert "| original, llama.cpp Q8_0 | 2,048 | 60.0 (sd 0.5) |  | 4.00 |" in markdown(rows)
    ours = [{"model": CONVERSION, "context": 2048, "decode_tokens_per_s": 30.0, "prefill_s": 3.0}]
    assert "| original, llama.cpp Q8_0 | 2,048 | 60.0 (sd 0.5) | 2.00 | 4.00 |" in markdown(rows, ours)
