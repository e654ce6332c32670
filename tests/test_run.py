"""`recurformer run`: checks before any work, run directories, stage skipping and resuming,
the step-time probe, the report, and `recurformer generate`."""

import json
import re
import shutil
import string
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from tiny_models import save_tiny_model, save_tiny_run_model, spec_for, tiny_model

from recurformer import recipe as recipe_module
from recurformer import retrieval_probe
from recurformer.cli import main
from recurformer.config import ConfigError
from recurformer.data import DataError, load_documents, token_sequences
from recurformer.evaluate import Task
from recurformer.hub import ModelResolutionError
from recurformer.metrics import by_key
from recurformer.mixers import MIXERS, MixerConfig, resolve_for_model
from recurformer.recipe import RECIPES, recipe_for
from recurformer.retrieval_mix import mix_retrieval
from recurformer.report import render_run_report
from recurformer.run import RUN_SCHEMA, STAGES, Run, RunConfig, metric_table, run_pipeline, run_tasks
from recurformer.run.stages import budget_steps, plan_line
from recurformer.surgery import convert
from recurformer.train import LMObjective, TrainConfig, TransferObjective, seconds_per_step


@pytest.fixture
def texts(tmp_path):
    train, held_out = tmp_path / "train.txt", tmp_path / "test.txt"
    train.write_text("the quick brown fox jumps over the lazy dog . " * 50)
    held_out.write_text("a recurrent state has a fixed size . " * 50)
    return [str(train)], [str(held_out)]


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(model="no-such-model"), ModelResolutionError, "unknown model 'no-such-model'"),
        (dict(model="./missing/dir"), ModelResolutionError, "no such model directory"),
        (dict(beta=1.5), ConfigError, "beta"),
        (dict(mixer="lstm"), ConfigError, "mixer kind: unknown 'lstm'"),
        (dict(scorer="loudest"), ConfigError, "loudest"),
        (dict(budget_minutes=0), ConfigError, "--budget-minutes must be > 0"),
        (dict(budget_minutes=30, steps=(5, 5)), ConfigError, "--steps and --budget-minutes both fix the training steps"),
        (dict(steps=(0, 5)), ConfigError, "--steps must be two positive integers"),
        (dict(lr=(5e-3, 0.0)), ConfigError, "--lr must be two learning rates"),
        (dict(data=["nowhere.txt"]), DataError, "data file not found: nowhere.txt"),
        (dict(data=[]), ConfigError, "no training data"),
        (dict(ood_data=[]), ConfigError, "no out-of-domain evaluation data: pass --ood-data"),
        (dict(ood_data=["gone.txt"]), DataError, "data file not found: gone.txt"),
        (dict(window=0), ConfigError, "window must be 'auto' or a positive integer, got 0"),
        (dict(sinks=-1), ConfigError, "sinks must be a non-negative integer, got -1"),
        (dict(mixer="mamba", window=128), ConfigError, "--window applies to --mixer window"),
        (dict(mixer="window", ssd_state=16), ConfigError, "--ssd-state applies to --mixer mamba2"),
        (dict(ssd_state=0), ConfigError, "ssd_state must be 'auto', 'head_dim' or a positive integer, got 0"),
        (dict(retrieval_share=1.5), ConfigError, r"--retrieval-share must be in \[0, 1\], got 1.5"),
        (dict(retrieval_share=-0.1), ConfigError, r"--retrieval-share must be in \[0, 1\], got -0.1"),
        (dict(retrieval_share=float("nan")), ConfigError, r"--retrieval-share must be in \[0, 1\], got nan"),
        (dict(device="tpu"), ConfigError, "--device: unknown 'tpu'"),
        (dict(retrieval_share=0.25, answer_weight=0.5), ConfigError, r"--answer-weight must be in \[1, 1000\], got 0.5"),
        (dict(retrieval_share=0.25, answer_weight=float("inf")), ConfigError, r"--answer-weight must be in \[1, 1000\], got inf"),
        (dict(answer_weight=8, retrieval_share=0), ConfigError, "--answer-weight weighs the answers of retrieval sequences: it needs --retrieval-share > 0"),
        (dict(answer_weight=8, mixer="window+mamba"), ConfigError, "--answer-weight weighs the answers of retrieval sequences: it needs --retrieval-share > 0"),
    ],
)
def test_bad_configuration_is_refused_up_front(texts, change, error, message):
    train, held_out = texts
    with pytest.raises(error, match=message):
        RunConfig(**{"data": train, "eval_data": held_out, **change})


def test_the_device_is_not_part_of_a_runs_identity(texts):
    """A run started on one device continues on another: run.json does not record it."""
    train, held_out = texts
    here = RunConfig(data=train, eval_data=held_out, device="cpu")
    assert "device" not in here.to_dict() and here.to_dict() == RunConfig(data=train, eval_data=held_out).to_dict()


def test_a_missing_shared_corpus_is_named_not_skipped(tmp_path, monkeypatch):
    from recurformer.data import DATA_ENV, EVAL_CORPORA, TRAIN_CORPORA
    for name in TRAIN_CORPORA:  # the training corpora are there, the held-out one is not
        (tmp_path / name).write_text("Some text of a corpus.\n")
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    missing = tmp_path / EVAL_CORPORA[0]
    with pytest.raises(DataError, match=f"data file not found: {missing} .*RECURFORMER_DATA"):
        RunConfig()


def test_evaluation_text_must_be_held_out(texts):
    train, held_out = texts
    with pytest.raises(ConfigError, match="--eval-data must be held out"):
        RunConfig(data=train, eval_data=train)
    with pytest.raises(ConfigError, match="--ood-data must be held out"):
        RunConfig(data=train, eval_data=held_out, ood_data=train)


def test_too_short_evaluation_text_stops_the_run_before_any_work(texts, tmp_path):
    train, held_out = texts
    short = tmp_path / "short.txt"
    short.write_text("too short to hide a key in . " * 3)
    config = RunConfig(model=str(save_tiny_model(tmp_path / "tiny")), data=train, eval_data=held_out,
                       ood_data=[str(short)], quick=True)
    with pytest.raises(DataError, match=r"--ood-data has \d+ tokens; the evaluation needs at least 384"):
        run_pipeline(config, tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "stages").exists() and not (tmp_path / "run" / "scores.json").exists()


def test_cli_bad_input_is_one_line_and_writes_nothing(texts, tmp_path, capsys):
    train, held_out = texts
    out = tmp_path / "run"
    code = main(["run", "--model", "nope", "--data", *train, "--eval-data", *held_out, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "unknown model 'nope'" in err
    assert not out.exists()


def test_a_directory_of_another_configuration_is_refused(texts, tmp_path):
    train, held_out = texts
    Run(RunConfig(data=train, eval_data=held_out, beta=0.5), tmp_path / "run").claim(force=False)
    Run(RunConfig(data=train, eval_data=held_out, beta=0.5), tmp_path / "run").claim(force=False)  # same: fine
    with pytest.raises(ConfigError, match=r"belongs to a different configuration \(beta: 0.5 there, 0.75 here\)"):
        Run(RunConfig(data=train, eval_data=held_out, beta=0.75), tmp_path / "run").claim(force=False)
    (tmp_path / "run" / "stages").mkdir()
    Run(RunConfig(data=train, eval_data=held_out, beta=0.75), tmp_path / "run").claim(force=True)
    saved = json.loads((tmp_path / "run" / "run.json").read_text())
    assert saved["config"]["beta"] == 0.75 and not (tmp_path / "run" / "stages").exists()


def test_fixed_steps_replace_the_time_budget(texts, tmp_path):
    train, held_out = texts
    run = Run(RunConfig(data=train, eval_data=held_out, steps=(3, 7)), tmp_path / "run")
    run.claim(force=False)
    plan = dict((name, stage) for name, stage, _ in STAGES)["plan"]
    record = plan(run)  # no timing probe, no model loaded
    assert (record["transfer_steps"], record["lm_steps"]) == (3, 7) and "expected_minutes" not in record
    assert plan_line(record) == "training 3 + 7 steps (--steps)"
    with pytest.raises(ConfigError, match=r"\(steps: \[3, 7\] there, \[3, 8\] here\)"):
        Run(RunConfig(data=train, eval_data=held_out, steps=(3, 8)), tmp_path / "run").claim(force=False)


def test_a_run_trains_the_recipes_measured_steps_unless_told_otherwise(texts):
    """The default recipe's documented 55 + 32 steps by default; `--steps` fixes others; a
    budget, given or (for a recipe without measured steps) the default 25 minutes, leaves
    them to `plan`."""
    train, held_out = texts
    default = RunConfig(data=train, eval_data=held_out)
    assert (default.training_steps, default.training_budget) == ((55, 32), None)
    assert RunConfig(data=train, eval_data=held_out, steps=(3, 7)).training_steps == (3, 7)
    budget = RunConfig(data=train, eval_data=held_out, budget_minutes=40)
    assert (budget.training_steps, budget.training_budget) == (None, 40)
    plain = RunConfig(data=train, eval_data=held_out, mixer="mamba2")
    assert recipe_for("mamba2").measured_steps is None
    assert (plain.training_steps, plain.training_budget) == (None, 25.0)


def test_a_budget_buys_steps_at_the_timed_step_seconds_and_says_when_they_fall_short():
    """25 minutes at 24 s a step, 35% to transfer: 21 + 40 steps. Below the recipe's measured
    55 + 32 steps the plan's line says so and how to train them; at or above them it does not.
    The recipe's own steps are said to be those, with the time they should take."""
    steps = budget_steps(25, 0.35, {"transfer": 24.0, "lm": 24.0})
    assert steps == {"transfer_steps": 21, "lm_steps": 40}
    record = {**steps, "transfer_step_s": 24.0, "lm_step_s": 24.0, "expected_minutes": 24.4, "measured_steps": [55, 32],
              "budget_minutes": 25}
    line = plan_line(record)
    assert line.startswith("training 21 + 40 steps, what the 25-minute budget buys here (24.0 s and 24.0 s a step): "
                           "about 24 minutes; fewer than the 55 + 32") and "--steps 55,32 (the default)" in line
    enough = {**record, **budget_steps(60, 0.35, {"transfer": 10.0, "lm": 10.0}), "budget_minutes": 60}
    assert "fewer" not in plan_line(enough)
    measured = {"transfer_steps": 55, "lm_steps": 32, "transfer_step_s": 12.9, "lm_step_s": 42.9,
                "expected_minutes": 34.7, "measured_steps": [55, 32]}
    assert plan_line(measured) == ("training 55 + 32 steps, the recipe's measured steps, here (12.9 s and 42.9 s a "
                                   "step): about 35 minutes; --budget-minutes bounds the time instead")


def test_a_budget_below_one_step_of_a_stage_is_one_line():
    with pytest.raises(ConfigError, match=r"^--budget-minutes 0.1 buys no whole step of the transfer stage on this "
                                          r"machine \(one takes 24.0 s\): give at least 1.14, or --steps$"):
        budget_steps(0.1, 0.35, {"transfer": 24.0, "lm": 24.0})


def test_the_report_says_when_a_budget_bought_fewer_than_the_measured_steps():
    metrics, rows = metric_table()
    bench = {"measurements": []}
    short = _metrics(False) | {"mixer": "window+mamba2", "recipe": "tail-mamba2", "transfer_steps": 17, "lm_steps": 10}
    report = render_run_report(short, by_key(metrics), rows, {"beta": 0.5, "budget_minutes": 25, "steps": None}, bench, [])
    assert ("**The 25-minute budget bought 17 + 10 steps on this machine, fewer than the 55 + 32 the recipe's "
            "documented numbers were measured with.**") in report and "Without `--budget-minutes` a run trains those." in report
    given = render_run_report(short, by_key(metrics), rows, {"beta": 0.5, "budget_minutes": None, "steps": [17, 10]},
                              bench, [])
    enough = short | {"transfer_steps": 55, "lm_steps": 32}
    bought = render_run_report(enough, by_key(metrics), rows, {"beta": 0.5, "budget_minutes": 40, "steps": None}, bench, [])
    assert "fewer than the" not in given and "fewer than the" not in bought


def test_learning_rates_reach_the_training_stages(texts, tmp_path):
    train, held_out = texts
    mamba = Run(RunConfig(data=train, eval_data=held_out, mixer="mamba"), tmp_path / "a")
    chosen = Run(RunConfig(data=train, eval_data=held_out, mixer="mamba", lr=(2e-3, 2e-4)), tmp_path / "b")
    assert [mamba.train_config(stage, 1).lr for stage in ("transfer", "lm")] == [5e-3, 1e-3]
    mamba2 = Run(RunConfig(data=train, eval_data=held_out, mixer="mamba2"), tmp_path / "c")
    assert mamba2.train_config("lm", 1).lr == 2e-4
    assert [chosen.train_config(stage, 1).lr for stage in ("transfer", "lm")] == [2e-3, 2e-4]
    assert chosen.train_config("lm", 1).trainable == "mixers+lora"
    lm = mamba.train_config("lm", 1)  # 8 x 512 tokens per step, in micro-batches of 1,024 tokens
    assert (lm.batch_size, lm.seq_len, lm.grad_accum) == (8, 512, 4)


def test_the_default_run_trains_a_window_with_a_recurrent_tail_by_the_tail_recipe(texts, tmp_path):
    train, held_out = texts
    run = Run(RunConfig(data=train, eval_data=held_out), tmp_path / "a")
    assert run.config.mixer == "window+mamba2" and run.recipe.name == "tail-mamba2"
    assert run.config.mixer_config() == MixerConfig()  # the library's default, its shape decided per model
    smollm2 = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    mixer = run.config.for_model(smollm2).mixer_config()  # a longer window and a small tail state
    assert (mixer.kind, mixer.window, mixer.sinks, mixer.ssd_state) == ("window+mamba2", 141, 4, 16)
    recorded = run.config.for_model(smollm2).to_dict()  # what run.json stores
    assert (recorded["window"], recorded["ssd_state"]) == (141, 16)
    given = RunConfig(data=train, eval_data=held_out, window=64, ssd_state="head_dim").for_model(smollm2)
    assert (given.window, given.ssd_state) == (64, "head_dim")  # flags win over the default shape
    assert RunConfig(data=train, eval_data=held_out, mixer="mamba2").for_model(smollm2).ssd_state == 64
    lm = run.train_config("lm", 1)  # 4 x 1,024 tokens, KL to the original alone, one sequence per micro-batch
    assert (lm.trainable, lm.ce_weight, lm.lr, lm.batch_size, lm.seq_len, lm.grad_accum) == ("tail", 0.0, 2e-4, 4, 1024, 4)


def test_cli_steps_must_be_a_pair(texts, tmp_path, capsys):
    train, held_out = texts
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--steps", "40", "--data", *train, "--eval-data", *held_out, "--out", str(tmp_path / "r")])
    assert exit_info.value.code == 2 and "expected TRANSFER,LM step counts" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_foreign_non_empty_directory_is_refused(texts, tmp_path):
    train, held_out = texts
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a run directory"):
        Run(RunConfig(data=train, eval_data=held_out), tmp_path / "taken").claim(force=False)


def test_an_interrupted_run_continues_where_it_stopped(texts, tmp_path):
    train, held_out = texts
    calls = {"first": 0, "second": 0, "last": 0}
    interrupt = {"armed": True}

    def first(run):
        calls["first"] += 1
        return {"value": 1}

    def second(run):
        calls["second"] += 1
        if interrupt["armed"]:
            interrupt["armed"] = False
            raise KeyboardInterrupt
        return {"value": 2}

    def last(run):
        calls["last"] += 1
        (run.out / "metrics.json").write_text(json.dumps({"done": run.layout.record("second")["value"]}))
        return {}

    stages = [("first", first, 1.0), ("second", second, 1.0), ("last", last, 1.0)]
    config = RunConfig(data=train, eval_data=held_out)
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(config, tmp_path / "run", progress=False, stages=stages)
    assert calls == {"first": 1, "second": 1, "last": 0}
    assert not (tmp_path / "run" / "stages" / "second.json").exists()
    assert run_pipeline(config, tmp_path / "run", progress=False, stages=stages) == {"done": 2}
    assert calls == {"first": 1, "second": 2, "last": 1}
    run_pipeline(config, tmp_path / "run", progress=False, stages=stages)  # everything done: nothing runs again
    assert calls == {"first": 1, "second": 2, "last": 1}
    assert json.loads((tmp_path / "run" / "stages" / "first.json").read_text())["value"] == 1


@pytest.mark.parametrize("stage", ["transfer", "lm"])
def test_step_time_probe_leaves_the_model_untouched(stage):
    teacher = tiny_model("llama")
    student = convert(teacher, spec_for(teacher, 0.5), MixerConfig(), init="reuse")
    before = {name: (p.detach().clone(), p.requires_grad) for name, p in student.named_parameters()}
    config = TrainConfig(stage=stage, steps=1, seq_len=16, batch_size=2, precision="no",
                         **(dict(trainable="mixers+lora", distill_weight=1.0) if stage == "lm" else {}))
    if stage == "lm":
        make = lambda copy: LMObjective(config.trainable, teacher, config.distill_weight)  # noqa: E731
    else:
        make = lambda copy: TransferObjective(teacher, copy)  # noqa: E731
    seconds = seconds_per_step(student, make, torch.randint(0, 97, (4, 16)), config)
    assert 0 < seconds < 60
    after = dict(student.named_parameters())
    assert set(after) == set(before)  # no LoRA wrapping leaked into the model
    for name, (value, flag) in before.items():
        assert torch.equal(after[name], value) and after[name].requires_grad == flag and after[name].grad is None


def _metrics(quick: bool) -> dict:
    """A full run's metrics.json: every declared key (None: not given here; the stage
    timings are a separate table), these given."""
    declared = dict.fromkeys(key for key in by_key(metric_table()[0]) if not key.startswith("seconds_"))
    return declared | {
        "quick": quick, "model": "tiny", "beta": 0.5, "mixer": "mamba", "scorer": "recency", "replaced_groups": 45,
        "replaced_fraction": 0.5, "params_original": 134_515_008, "params_converted": 141_016_000, "params_ratio": 1.048,
        "analyze_tokens": 16384, "rr_median": 0.27, "transfer_steps": 40, "transfer_tokens": 163_840,
        "transfer_minutes": 8.5, "transfer_lr": 5e-3, "lm_steps": 20, "lm_tokens": 81_920, "lm_minutes": 16.0,
        "lm_lr": 1e-3, "ppl_original": 24.22,
        "ppl_converted": 5139.0, "ppl_transfer": 83.7, "ppl_final": 40.1, "ppl_tokens": 16383, "ppl_ratio": 40.1 / 24.22,
        "ppl_context": 2048, "ppl_baseline": 26.0, "ppl_baseline_ratio": 26.0 / 24.22, "ppl_ood_original": 30.0,
        "ppl_ood_final": 45.0, "ppl_ood_baseline": 31.5,
        "ppl_ood_tokens": 16383, "ppl_ood_ratio": 1.5, "ppl_ood_baseline_ratio": 1.05, "baseline_window": 169,
        "agreement_top1_final": 0.71, "agreement_top1_baseline": 0.86, "agreement_kl_final": 0.52,
        "agreement_kl_baseline": 0.061, "agreement_tokens": 8192,
        "hashhop_original": 0.25, "hashhop_final": 0.125, "hashhop_problems": 24, "hashhop_context": 256,
        "ppl_far_original": 22.0, "ppl_far_final": 33.0, "ppl_far_final_ratio": 1.5, "ppl_far_baseline": 24.2,
        "ppl_far_baseline_ratio": 1.1, "ppl_far_from": 1024, "ppl_far_sequences": 2, "ppl_far_context": 8192,
        "ruler_original": 60.0, "ruler_final": 40.0, "ruler_baseline": 45.0, "ruler_tasks": 3, "ruler_problems": 4,
        "ruler_context": 4096,
        "mqar_original": 0.12, "mqar_final": 0.03, "mqar_problems": 32, "mqar_context": 256, "mqar_kv_pairs": 16,
        "bench_context": 4096, "bench_threads": 2, "cache_bytes_original": 180 * 2**20, "cache_bytes_final": 91 * 2**20,
        "cache_ratio": 0.506, "decode_tokens_per_s_original": 10.0, "decode_tokens_per_s_final": 14.0,
        "decode_speedup": 1.4, "decode_speedup_vs_static_cache": 1.1, "prefill_time_ratio": 0.9,
        "max_context_in_budget_original": 23_301, "max_context_in_budget_final": 46_573, "cache_budget_bytes": 2**30,
        "seconds_resolve": 0.1, "seconds_lm": 960.0, "total_minutes": 38.2, "peak_rss_lm": 3 * 2**30,
    }


def test_the_report_fixture_fills_every_summary_row():
    """Every key a summary row shows (a cell, or a field of its label) has a value in `_metrics`:
    a run task added without its results here would leave its row blank, untested."""
    _, rows = metric_table()
    given = {key for key, value in _metrics(False).items() if value is not None}
    shown = {key for row in rows for key in (row.original, row.converted, row.ratio, row.note, row.baseline,
                                             row.baseline_ratio) if key}
    shown |= {field for row in rows for _, field, _, _ in string.Formatter().parse(row.label) if field}
    assert not shown - given, f"give these keys values in tests/test_run.py's _metrics: {sorted(shown - given)}"


def test_report_states_the_numbers_and_flags_quick_runs():
    metrics, rows = metric_table()
    bench = {"measurements": [{"model": "original", "context": 4096, "prefill_s": 9.5, "decode_tokens_per_s": 10.0,
                               "kv_bytes": 180 * 2**20, "state_bytes": 0}]}
    buckets = [{"bucket": "0-64", "tokens": 126, "ppl": 100.0}, {"bucket": "1K-2K", "tokens": 2048, "ppl": 20.0}]
    evaluation = {"ppl-by-distance": {"original": {"buckets": buckets},
                                      "final": {"buckets": [{**b, "ppl": 1.5 * b["ppl"]} for b in buckets]},
                                      "baseline": {"buckets": [{**b, "ppl": 1.1 * b["ppl"]} for b in buckets]}}}
    sections = lambda m: [t.report_section(m, evaluation) for t in run_tasks() if t.report_section]  # noqa: E731
    full = render_run_report(_metrics(False), by_key(metrics), rows, {"beta": 0.5}, bench, sections(_metrics(False)))
    assert ("| perplexity, held-out text (16,383 tokens, windows of 2,048) | 24.22 | 40.10 | 1.656x | 26.00 (1.073x) |"
            in full)
    assert ("| perplexity, out-of-domain text (16,383 tokens, never trained on) | 30.00 | 45.00 | 1.500x | "
            "31.50 (1.050x) |") in full
    assert "| top-1 agreement with the original (8,192 tokens, held-out + out-of-domain) | | 71.0% | | 86.0% |" in full
    assert "| HashHop, 1 hop, exact match (24 problems, ~256 tokens) | 25% | 12% | | |" in full
    assert ("| perplexity at positions >= 1,024 of 2 held-out sequences of 8,192 tokens | 22.00 | 33.00 | 1.500x | "
            "24.20 (1.100x) |") in full
    assert "| RULER mix in held-out text, string match 0-100 (3 needle tasks x 4 problems, 4,096 tokens) | 60.0 | 40.0 | | 45.0 |" in full
    assert "| MQAR, token accuracy (32 sequences of 256 tokens, 16 pairs) | 12% | 3% | | |" in full
    assert "| cache at 4,096 tokens | 180.0 MiB | 91.0 MiB | 0.506x | |" in full
    assert "1.40x (1.10x vs a static cache)" in full
    assert "| prefill time at 4,096 tokens | | | 0.90x | |" in full
    assert "| longest context whose cache fits 1,024.0 MiB | 23,301 | 46,573 | | |" in full
    assert "| parameters | 134.5M | 141.0M | 1.048x | |" in full
    assert "| after transfer (40 steps, 163,840 tokens, 8.5 min) | 83.70 | 3.456 | | |" in full
    assert "| after lm (20 steps, 81,920 tokens, 16.0 min) | 40.10 | 1.656 | 45.00 | 1.500 |" in full
    assert "the last 169 tokens" in full
    assert "| 1K-2K | 2,048 | 20.00 | 30.00 | 1.500x | 22.00 | 1.100x |" in full
    assert "| lm | 960.0 | 3,072.0 MiB |" in full
    assert "| resolve | 0.1 |  |" in full  # no memory recorded: blank
    assert "2 torch thread(s)" in full
    assert "| original | 4,096 | 9.50 | 10.0 | 180.0 MiB | 0.0 MiB |" in full
    assert "Quick run" not in full
    assert "mixer `mamba`\n" in full  # a kind without a window names none
    windowed = _metrics(False) | {"mixer": "window+mamba", "window": 140, "sinks": 4}
    assert "mixer `window+mamba` (window 140 + 4 sinks)" in render_run_report(
        windowed, by_key(metrics), rows, {"beta": 0.5}, bench, sections(windowed))
    assert "Quick run" in render_run_report(_metrics(True), by_key(metrics), rows, {"beta": 0.5}, bench,
                                            sections(_metrics(True)))
    # The configuration names the corpora by file name, not by where they were on the machine.
    placed = {"beta": 0.5, "data": ["/srv/corpora/train.txt"], "eval_data": ["/srv/corpora/test.txt"], "ood_data": []}
    report = render_run_report(_metrics(False), by_key(metrics), rows, placed, bench, sections(_metrics(False)))
    assert '"train.txt"' in report and '"test.txt"' in report and "/srv" not in report


@pytest.mark.parametrize("config, window, sinks", [
    ({"mixer": "mamba", "window": None, "sinks": None}, None, None),
    ({"mixer": "window+mamba2", "window": 141, "sinks": None}, 141, MixerConfig.sinks),
    ({"mixer": "window+mamba", "window": 140, "sinks": 2}, 140, 2),
    ({"mixer": "window"}, 64, 4),  # run.json of a run made before --window: the defaults of that time
])
def test_metrics_record_the_window_the_mixer_was_converted_with(config, window, sinks):
    table = by_key(metric_table()[0])
    results = SimpleNamespace(config=config)
    assert (table["window"].value(results), table["sinks"].value(results)) == (window, sinks)


def test_metrics_record_the_ssd_state_of_the_mamba2_kinds():
    table = by_key(metric_table()[0])
    value = lambda **config: table["ssd_state"].value(SimpleNamespace(config=config))  # noqa: E731
    assert value(mixer="window+mamba2", ssd_state=16) == 16
    assert value(mixer="mamba2") == "head_dim"  # a run made before --ssd-state
    assert value(mixer="window+mamba", ssd_state=None) is None


def test_every_metric_key_is_declared_once_and_documented():
    metrics, rows = metric_table()
    table = by_key(metrics)  # raises on a key declared twice
    shown = {key for row in rows for key in (row.original, row.converted, row.ratio, row.note, row.baseline,
                                             row.baseline_ratio) if key}
    assert shown <= set(table)
    documented = (Path(__file__).parent.parent / "docs" / "run.md").read_text()
    per_stage = ("seconds_", "peak_rss_")  # documented as `seconds_<stage>`, `peak_rss_<stage>`
    missing = [key for key in table if f"`{key}`" not in documented and not key.startswith(per_stage)]
    assert not missing, f"metrics.json keys not documented in docs/run.md: {missing}"


def test_a_run_directory_of_an_older_schema_is_refused_with_what_to_do(texts, tmp_path):
    train, held_out = texts
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text(json.dumps({"schema": "recurformer-run/1", "config": {}}))
    with pytest.raises(ConfigError, match=r"made by an older recurformer \(recurformer-run/1\); start it over with --force"):
        Run(RunConfig(data=train, eval_data=held_out), tmp_path / "run").claim(force=False)
    Run(RunConfig(data=train, eval_data=held_out), tmp_path / "run").claim(force=True)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["schema"] == RUN_SCHEMA


def test_generate_command_continues_a_prompt_greedily(tmp_path, capsys):
    from transformers import AutoTokenizer

    directory = save_tiny_model(tmp_path / "model")
    assert main(["generate", str(directory), "--prompt", "The quick brown", "--max-new-tokens", "5"]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    model, tokenizer = tiny_model("llama"), AutoTokenizer.from_pretrained(directory)
    ids = tokenizer("The quick brown", return_tensors="pt")
    expected = model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert printed == tokenizer.decode(expected[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert main(["generate", str(directory), "--prompt", "x", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be >= 1" in capsys.readouterr().err


def test_a_window_with_a_tail_trains_only_its_tail_on_longer_sequences(texts, tmp_path):
    """The tail recipe: window+* mixers train their recurrent branch and gate only (the
    window keeps the heads' projections), on tail_seq_len sequences, the lm stage on the KL."""
    train, held_out = texts
    model_dir = save_tiny_model(tmp_path / "tiny")
    config = RunConfig(model=str(model_dir), data=train, eval_data=held_out, mixer="window+mamba2", quick=True)
    run = Run(config, tmp_path / "run")
    lm = run.train_config("lm", 1)
    assert (lm.trainable, lm.ce_weight, lm.distill_weight, lm.seq_len) == ("tail", 0.0, 1.0, run.recipe.quick_seq_len)
    assert run.train_config("transfer", 1).trainable == "tail"
    assert run.train_sequences.shape[1] == run.recipe.quick_seq_len

    until_lm = [stage for stage in STAGES if stage[0] in ("resolve", "analyze", "convert", "plan", "transfer", "lm")]
    with pytest.raises(FileNotFoundError, match="metrics.json"):  # no report stage: no metrics
        run_pipeline(config, tmp_path / "run", progress=False, stages=until_lm)
    before = dict(run.model("converted").named_parameters())
    after = dict(Run(config, tmp_path / "run").model("final").named_parameters())
    changed = {name for name, p in after.items() if not torch.equal(p, before[name])}
    assert changed and all(".mixer.recurrent." in name or name.endswith(".mixer.gate") for name in changed)
    assert any(name.endswith(".mixer.gate") for name in changed)  # the gate opened


def test_a_window_beyond_the_models_positions_stops_the_run_before_any_work(texts, tmp_path):
    train, held_out = texts
    config = RunConfig(model=str(save_tiny_model(tmp_path / "tiny")), data=train, eval_data=held_out, quick=True,
                       window=513)  # the tiny models hold 512 positions
    with pytest.raises(ConfigError, match=r"window 513 is larger than the model's position limit \(512 positions\)"):
        run_pipeline(config, tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "scores.json").exists() and not (tmp_path / "run" / "stages").exists()


def test_the_window_and_sinks_reach_the_converted_mixer(texts, tmp_path):
    """`run --window W --sinks S` converts with that window; without them, the mixer's defaults."""
    train, held_out = texts
    model_dir = str(save_tiny_model(tmp_path / "tiny"))
    stages = [stage for stage in STAGES if stage[0] in ("resolve", "analyze", "convert")]
    default = resolve_for_model(MixerConfig(kind="window+mamba"), tiny_model("llama").config)
    for name, given, expected in (("wide", dict(window=24, sinks=2), (24, 2)),
                                  ("default", {}, (default.window, MixerConfig.sinks))):
        config = RunConfig(model=model_dir, data=train, eval_data=held_out, mixer="window+mamba", quick=True, **given)
        with pytest.raises(FileNotFoundError, match="metrics.json"):  # stops after convert: no report
            run_pipeline(config, tmp_path / name, progress=False, stages=stages)
        mixer = MixerConfig.from_dict(Run(config, tmp_path / name).model("converted").config.mixer)
        assert (mixer.kind, mixer.window, mixer.sinks) == ("window+mamba", *expected)


@pytest.mark.parametrize("scorer, statistic", [("ablation", "ablation"), ("ablation-greedy", "ablation_order"),
                                               ("ablation-retrieval", "ablation_retrieval")])
def test_run_with_an_ablation_scorer_converts_the_cheapest_groups(texts, tmp_path, scorer, statistic, monkeypatch):
    train, held_out = texts
    monkeypatch.setattr(retrieval_probe, "NEEDLES", 1)  # the tiny tokenizer spends ~150 tokens on one
    model = save_tiny_model(tmp_path / "model", "llama")
    config = RunConfig(model=str(model), data=train, eval_data=held_out, quick=True, scorer=scorer, beta=0.5)
    run = Run(config, tmp_path / "run")
    run.claim(force=False)
    for name, stage, _ in STAGES:
        if name in ("resolve", "analyze", "convert"):
            stage(run)
    scores = json.loads((tmp_path / "run" / "scores.json").read_text())
    costs = {(g["layer"], g["kv_head"]): g[statistic] for g in scores["groups"]}
    assert scores["ablation"]["ablation_seq_len"] == 256 and not (tmp_path / "run" / "ablation-partial.json").exists()
    converted = json.loads((tmp_path / "run" / "converted" / "config.json").read_text())
    assert {tuple(g) for g in converted["replacement"]["groups"]} == set(sorted(costs, key=lambda g: (costs[g], g))[:2])


def test_a_new_process_takes_a_stage_model_from_its_directory(texts, tmp_path):
    """A re-run after a crash holds no model in memory: the next training stage loads it."""
    train, held_out = texts
    config = RunConfig(model=str(save_tiny_model(tmp_path / "tiny")), data=train, eval_data=held_out, quick=True)
    first = Run(config, tmp_path / "run")
    first.claim(force=False)
    for name, stage, _ in STAGES[:3]:  # resolve, analyze, convert
        stage(first)
    saved = dict(first.model("converted").named_parameters())
    taken = Run(config, tmp_path / "run").model("converted")
    assert taken is not first.model("converted")  # loaded again, from the folder
    assert all(torch.equal(p, saved[name]) for name, p in taken.named_parameters())


def test_every_kind_names_a_recipe_and_every_recipe_is_in_both_tables():
    """A kind's `recipe` is a key of `RECIPES` (else `run` fails with a bare KeyError), and
    each recipe has its row in `recipe.py`'s docstring and in docs/training.md."""
    unknown = {kind: cls.recipe for kind, cls in MIXERS.items() if cls.recipe is not None and cls.recipe not in RECIPES}
    assert not unknown, f"mixer kinds naming no recipe of recipe.RECIPES: {unknown}"
    training = (Path(__file__).parent.parent / "docs" / "training.md").read_text()
    for name in RECIPES:
        assert f"| `{name}` |" in recipe_module.__doc__ and f"| `{name}` |" in training, name


def test_run_takes_another_recipe_by_name():
    assert recipe_for("window+mamba2", "tail-mamba2-q").lm.trainable == "tail+q"
    long = recipe_for("window+mamba2", "tail-mamba2-long")
    assert long.sequence_length == 4096 and long.lm.seq_len == 4096
    both = recipe_for("window+mamba2", "tail-mamba2-long-q")
    assert both.transfer == long.transfer and both.lm.seq_len == 4096 and both.lm.trainable == "tail+q"
    assert "query projections train too" in recipe_for("window+mamba2", "tail-mamba2-q").summary
    with pytest.raises(ConfigError, match="--recipe: unknown 'fast'; choose one of mixers, mamba2, tail"):
        recipe_for("window+mamba2", "fast")
    with pytest.raises(ConfigError, match="--recipe tail-mamba2-q trains the tails of window\\+ kinds, and --mixer mamba has none"):
        recipe_for("mamba", "tail-mamba2-q")


def test_the_long_lm_recipe_trains_the_lm_stage_on_4k_tokens_and_cuts_them_in_four_for_transfer():
    recipe = recipe_for("window+mamba2", "tail-mamba2-long-lm")
    assert recipe.sequence_length == 4096 and (recipe.lm.seq_len, recipe.lm.batch_size) == (4096, 1)
    assert recipe.transfer == RECIPES["tail-mamba2"].transfer and recipe.lm.lr == 2e-4
    rows = torch.arange(2 * 4096).reshape(2, 4096)
    pieces = recipe.stage_rows("transfer", rows)
    assert pieces.shape == (8, 1024) and torch.equal(pieces[5], rows[1, 1024:2048])  # consecutive pieces, in order
    assert torch.equal(recipe.stage_rows("lm", rows), rows)
    assert recipe.quick().sequence_length == recipe.quick_seq_len  # --quick: both stages equally tiny
    with pytest.raises(ValueError, match="sequence lengths 1000 and 4096 must divide"):
        replace(recipe, transfer=replace(recipe.transfer, seq_len=1000))


def test_each_training_stage_reads_the_sequences_and_weights_cut_to_its_own_length(texts, tmp_path, monkeypatch):
    """A recipe whose stages differ in length: the transfer stage gets the run's sequences in
    pieces of its length, the lm stage whole, and the lm weights are cut like the sequences."""
    train, held_out = texts
    hybrid = replace(RECIPES["tail-mamba2-long-lm"], transfer=replace(RECIPES["tail"].transfer, seq_len=64),
                     lm=replace(RECIPES["tail-mamba2-long-lm"].lm, seq_len=256))
    monkeypatch.setattr(RunConfig, "recipe", property(lambda self: hybrid))
    run = Run(RunConfig(model=str(save_tiny_model(tmp_path / "tiny")), data=train, eval_data=held_out,
                        steps=(1, 1), retrieval_share=0.5, answer_weight=4), tmp_path / "run")
    run.claim(force=False)
    run.layout.finish("plan", {"transfer_steps": 1, "lm_steps": 1})
    seen = {}

    def fake_train_stage(student, tokenizer, original, sequences, config, out, resume, weights):
        seen[config.stage] = (tuple(sequences.shape), None if weights is None else tuple(weights.shape), config.seq_len)
        return {"config": config}

    monkeypatch.setattr("recurformer.run.stages.train_stage", fake_train_stage)
    monkeypatch.setattr(Run, "model", lambda self, name: f"model {name}")
    monkeypatch.setattr(Run, "original", "the original")
    stages = dict((name, stage) for name, stage, _ in STAGES)
    stages["transfer"](run)
    stages["lm"](run)
    n = len(run.train_sequences)
    assert run.train_sequences.shape[1] == 256 and run.lm_weights.shape == (n, 256)
    assert seen == {"transfer": ((4 * n, 64), None, 64), "lm": ((n, 256), (n, 256), 256)}


def test_the_report_names_the_recipe_the_mixer_was_trained_by():
    assert "LoRA adapters" in recipe_for("mamba").summary and "tail recipe" not in recipe_for("window").summary
    assert "KL divergence to the original model's predictions alone" in recipe_for("window+mamba2").summary


def test_the_bench_names_the_final_model_by_its_role_not_its_path(texts, tmp_path, monkeypatch):
    """A run folder that is moved must still find its measurements (bench.json is read by name)."""
    train, held_out = texts
    config = RunConfig(model=str(save_tiny_model(tmp_path / "tiny")), data=train, eval_data=held_out, quick=True)
    run = Run(config, tmp_path / "run")
    seen = {}
    monkeypatch.setattr("recurformer.run.stages.against_original",
                        lambda converted, *args, **kwargs: seen.update(converted) or {"contexts": [64]})
    monkeypatch.setattr("recurformer.run.stages.plot_bench", lambda *args: None)
    monkeypatch.setattr(Run, "model", lambda self, name: f"model {name}")
    monkeypatch.setattr(Run, "original", "the original")
    dict((name, stage) for name, stage, _ in STAGES)["bench"](run)
    assert seen == {"final": "model final"}


def test_a_retrieval_share_replaces_that_share_of_the_training_sequences_by_default_the_recipes(tmp_path):
    """window+mamba2's recipe mixes a quarter of retrieval sequences in; `--retrieval-share 0`
    trains on the plain text, and so do kinds whose recipe has no share and `--quick` runs."""
    train, held_out = tmp_path / "train.txt", tmp_path / "test.txt"
    train.write_text("the quick brown fox jumps over the lazy dog . " * 400)
    held_out.write_text("a recurrent state has a fixed size . " * 50)
    model = str(save_tiny_model(tmp_path / "tiny"))
    paths = dict(model=model, data=[str(train)], eval_data=[str(held_out)])
    plain = Run(RunConfig(**paths, retrieval_share=0), tmp_path / "a")
    expected = token_sequences(plain.tokenizer, load_documents([str(train)]), plain.recipe.sequence_length, seed=0)
    assert torch.equal(plain.train_sequences, expected)
    for config, share in ((RunConfig(**paths), 0.25), (RunConfig(**paths, retrieval_share=0.5), 0.5)):
        mixed = Run(config, tmp_path / str(share)).train_sequences
        replaced = [i for i in range(len(expected)) if not torch.equal(mixed[i], expected[i])]
        assert config.retrieval_share == share and mixed.shape == expected.shape
        assert len(replaced) == round(share * len(expected))
    assert RunConfig(**paths, mixer="window+mamba").retrieval_share == 0.0  # the `tail` recipe: unmeasured with it
    assert RunConfig(**paths, quick=True).retrieval_share == 0.0  # no room for a fact in a tiny sequence


def test_the_answer_weight_weighs_the_positions_that_predict_an_answers_value(tmp_path):
    """`lm_weights`: None at the default weight; else `answer_weight` exactly where the next
    token is a value token of an answer (`mix_retrieval`'s mask, shifted by one), 1 elsewhere."""
    train, held_out = tmp_path / "train.txt", tmp_path / "test.txt"
    train.write_text("the quick brown fox jumps over the lazy dog . " * 400)
    held_out.write_text("a recurrent state has a fixed size . " * 50)
    model = str(save_tiny_model(tmp_path / "tiny"))
    config = dict(model=model, data=[str(train)], eval_data=[str(held_out)], retrieval_share=0.5)
    assert Run(RunConfig(**config), tmp_path / "a").lm_weights is None
    run = Run(RunConfig(**config, answer_weight=8), tmp_path / "b")
    sequences = token_sequences(run.tokenizer, load_documents([str(train)]), run.recipe.sequence_length, seed=0)
    _, answers = mix_retrieval(run.tokenizer, sequences, 0.5, 0)
    weights = run.lm_weights
    assert weights.shape == sequences.shape and answers.any()
    assert torch.equal(weights[:, :-1] == 8, answers[:, 1:]) and bool((weights[:, -1] == 1).all())
    assert set(weights.unique().tolist()) == {1.0, 8.0}


def test_a_run_json_without_the_retrieval_share_is_a_run_without_retrieval_sequences(texts, tmp_path):
    """run.json written before --retrieval-share existed: a run at share 0 (what runs did then),
    not at today's default of the recipe's quarter."""
    train, held_out = texts
    Run(RunConfig(data=train, eval_data=held_out, retrieval_share=0), tmp_path / "run").claim(force=False)
    saved = json.loads((tmp_path / "run" / "run.json").read_text())
    del saved["config"]["retrieval_share"]
    (tmp_path / "run" / "run.json").write_text(json.dumps(saved))
    Run(RunConfig(data=train, eval_data=held_out, retrieval_share=0), tmp_path / "run").claim(force=False)
    with pytest.raises(ConfigError, match=r"different configuration \(retrieval_share: 0.0 there, 0.25 here\)"):
        Run(RunConfig(data=train, eval_data=held_out), tmp_path / "run").claim(force=False)


@pytest.mark.parametrize("flags, message", [
    (["--quick", "--retrieval-share", "1.5"], r"--retrieval-share must be in \[0, 1\], got 1.5"),
    (["--quick", "--answer-weight", "4"], r"--answer-weight weighs the answers of retrieval sequences"),
    (["--quick", "--retrieval-share", "0.5"], r"a 96-token training sequence has no room for a fact and its question"),
    (["--retrieval-share", "0.5"], r"seq_len 1024 is longer than the model allows \(512 positions\)"),
])
def test_bad_retrieval_input_is_one_line_and_leaves_nothing(texts, tmp_path, capsys, flags, message):
    """A share outside [0, 1]; training sequences (run --quick's 96 tokens, of a tokenizer of
    about a token a character) too short for a fact and its question; training sequences (the
    full recipe's 1,024 tokens) longer than the tiny model's positions."""
    train, held_out = texts
    out, ood = tmp_path / "run", tmp_path / "ood.txt"
    ood.write_text("another domain , other words . " * 60)
    model = str(save_tiny_model(tmp_path / "tiny"))
    capsys.readouterr()
    code = main(["run", model, "--data", *train, "--eval-data", *held_out, "--ood-data", str(ood), "--out", str(out),
                 *flags])
    err = capsys.readouterr().err
    last = err.rstrip("\n").split("\n")[-1]  # after the progress bar, if the run began
    assert code == 2 and "Traceback" not in err and last.startswith("recurformer: error: ") and re.search(message, last)
    assert not out.exists()


def test_an_interrupted_evaluation_measures_only_the_rest_and_gives_the_same_results(texts, tmp_path, monkeypatch):
    """The evaluate stage keeps each result as it comes (eval-partial.json): stopped in the
    middle and run again, it measures only what it had not, and writes the eval.json of a run
    that was not stopped; results made with other models (a stage's record changed) are not reused."""
    train, held_out = texts
    config = RunConfig(model=str(save_tiny_run_model(tmp_path / "tiny")), data=train, eval_data=held_out,
                       ood_data=held_out, quick=True)
    until_lm = [stage for stage in STAGES if stage[0] in ("resolve", "analyze", "convert", "plan", "transfer", "lm")]
    with pytest.raises(FileNotFoundError, match="metrics.json"):  # no report stage: no metrics
        run_pipeline(config, tmp_path / "run", progress=False, stages=until_lm)
    for name in ("straight", "stale"):
        shutil.copytree(tmp_path / "run", tmp_path / name)
    evaluate_stage = [stage for stage in STAGES if stage[0] == "evaluate"]
    measured, stop_at = [], {"call": 4}
    measure = Task.measure

    def counted(self, *args, **kwargs):
        measured.append(self.name)
        if len(measured) == stop_at["call"]:
            raise KeyboardInterrupt
        return measure(self, *args, **kwargs)

    monkeypatch.setattr(Task, "measure", counted)
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(config, tmp_path / "run", progress=False, stages=evaluate_stage)
    partial = json.loads((tmp_path / "run" / "eval-partial.json").read_text())["results"]
    assert sum(len(models) for models in partial.values()) == 3 and not (tmp_path / "run" / "eval.json").exists()
    with pytest.raises(FileNotFoundError, match="metrics.json"):
        run_pipeline(config, tmp_path / "run", progress=False, stages=evaluate_stage)
    resumed = len(measured) - 4  # the interrupted evaluation again, and those after it
    assert not (tmp_path / "run" / "eval-partial.json").exists()

    with pytest.raises(FileNotFoundError, match="metrics.json"):
        run_pipeline(config, tmp_path / "straight", progress=False, stages=evaluate_stage)
    everything = len(measured) - 4 - resumed
    assert resumed == everything - 3
    assert (json.loads((tmp_path / "run" / "eval.json").read_text())
            == json.loads((tmp_path / "straight" / "eval.json").read_text()))

    (tmp_path / "stale" / "eval-partial.json").write_text(json.dumps(
        {"made_by": {"convert": None, "transfer": None, "lm": None}, "results": partial}))
    with pytest.raises(FileNotFoundError, match="metrics.json"):
        run_pipeline(config, tmp_path / "stale", progress=False, stages=evaluate_stage)
    assert len(measured) - 4 - resumed - everything == everything  # made with other models: measured again
