"""`recurformer run`: the whole method on one model, as resumable stages, ending in a report.

Stages, in order (each writes its outputs atomically and then a marker
`stages/<name>.json`; a re-run skips every stage whose marker exists, and a training stage
interrupted mid-way resumes from its last checkpoint):

1. `resolve`   the model (fetched once into the local cache if it is a known name)
2. `analyze`   recency ratio of every head on the training text -> scores.json, heads.png
3. `convert`   replace the top-beta KV groups -> converted/
4. `plan`      measure one training step of each stage and turn the time budget into steps
               (or take `steps` as given)
5. `transfer`  train the mixers to reproduce the replaced heads -> transfer/
6. `lm`        end-to-end next-token training with distillation -> final/
7. `evaluate`  perplexity on held-out text, HashHop and MQAR, original vs converted
8. `bench`     cache bytes, prefill time and decode speed against the original
9. `report`    report.md, metrics.json and plots

[ours] The time budget (`budget_minutes`) is the training time. The `plan` stage times one
optimizer step of each training stage on a copy of the model and fixes the step counts
(35% of the budget for `transfer`, 65% for `lm`), so a re-run trains exactly the same
steps whatever the machine's load is then; `steps` fixes them instead (to compare runs at
equal tokens). `run.json` records the configuration; a
directory made by another configuration is refused before any work starts.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from tqdm.auto import tqdm

from .config import ConfigError, MixerConfig, _require
from .data import DataError, load_documents
from .files import write_json_atomic, write_text_atomic

RUN_SCHEMA = "recurformer-run/1"
TRANSFER_SHARE = 0.35
# (transfer, lm) learning rates per mixer. The recipe of docs/results/recovery.md: the
# layer-local transfer stage takes a 5x higher rate than the end-to-end lm stage; mamba2's
# lm stage diverges at 1e-3 and is stable at 2e-4 (docs/mixers.md).
DEFAULT_LR = {"mamba": (5e-3, 1e-3), "mamba2": (5e-3, 2e-4), "window": (5e-3, 1e-3)}
TRAIN_CORPORA = ("wikitext-2-valid.txt", "tinyshakespeare.txt")
EVAL_CORPORA = ("wikitext-2-raw-test.txt",)


def default_corpora() -> tuple[list[str], list[str]]:
    """(training, evaluation) files found in `$RECURFORMER_DATA`, else `../shared/data`
    (the project's offline corpora, seen from the repository root)."""
    import os

    folder = Path(os.environ.get("RECURFORMER_DATA", "../shared/data"))
    found = lambda names: [str(folder / n) for n in names if (folder / n).is_file()]  # noqa: E731
    return found(TRAIN_CORPORA), found(EVAL_CORPORA)


@dataclass
class RunConfig:
    """Everything that determines a run's results; `run.json` stores it.

    `quick` replaces every size by a tiny one (a smoke test: its numbers mean nothing).
    """

    model: str = "smollm2-135m"
    data: list[str] = field(default_factory=list)
    eval_data: list[str] = field(default_factory=list)
    beta: float = 0.5
    mixer: str = "mamba"
    scorer: str = "recency"
    budget_minutes: float = 25.0
    steps: tuple[int, int] | None = None  # (transfer, lm): train exactly these, instead of the budget
    lr: tuple[float, float] | None = None  # (transfer, lm) learning rates; None: DEFAULT_LR of the mixer
    quick: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        from .hub import locate
        from .pipeline import check_beta
        from .scoring import make_scorer

        locate(self.model)
        _require(bool(self.data), "no training data: pass --data FILE...")
        _require(bool(self.eval_data), "no evaluation data: pass --eval-data FILE...")
        overlap = {str(Path(p).resolve()) for p in self.data} & {str(Path(p).resolve()) for p in self.eval_data}
        if overlap:
            raise ConfigError(f"--eval-data must be held out, but {min(overlap)} is also in --data")
        check_beta(self.beta)
        MixerConfig(kind=self.mixer)
        make_scorer(self.scorer, self.seed)
        _require(self.budget_minutes > 0, f"--budget-minutes must be > 0, got {self.budget_minutes}")
        if self.steps is not None:
            _require(len(self.steps) == 2 and all(isinstance(n, int) and n >= 1 for n in self.steps),
                     f"--steps must be two positive integers TRANSFER,LM, got {self.steps}")
            self.steps = tuple(self.steps)
        if self.lr is not None:
            _require(len(self.lr) == 2 and all(0 < x < 1 for x in self.lr),
                     f"--lr must be two learning rates in (0, 1) TRANSFER,LM, got {self.lr}")
            self.lr = tuple(self.lr)
        for path in [*self.data, *self.eval_data]:
            if not Path(path).is_file():
                raise DataError(f"data file not found: {path}")

    @property
    def learning_rates(self) -> tuple[float, float]:
        """(transfer, lm): the given ones, else the mixer's defaults."""
        return self.lr or DEFAULT_LR[self.mixer]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["data"] = [str(Path(p).resolve()) for p in self.data]
        data["eval_data"] = [str(Path(p).resolve()) for p in self.eval_data]
        data["steps"] = None if self.steps is None else list(self.steps)
        data["lr"] = None if self.lr is None else list(self.lr)
        return data


@dataclass(frozen=True)
class Sizes:
    """The sizes of every stage's work (the full run, or the tiny `quick` one)."""

    analyze_sequences: int = 16
    analyze_seq_len: int = 1024
    train_seq_len: int = 512
    train_batch: int = 8
    ppl_tokens: int = 16384
    ppl_context: int = 1024
    hashhop_problems: int = 24
    hashhop_tokens: int = 256
    mqar_examples: int = 32
    mqar_seq_len: int = 256
    mqar_pairs: int = 16
    bench_contexts: tuple[int, ...] = (512, 2048, 4096)
    bench_decode_steps: int = 32
    fixed_steps: int | None = None  # quick: skip the timing and train this many steps

    @classmethod
    def quick(cls) -> "Sizes":
        return cls(analyze_sequences=2, analyze_seq_len=128, train_seq_len=64, train_batch=2, ppl_tokens=512,
                   ppl_context=128, hashhop_problems=2, hashhop_tokens=160, mqar_examples=2, mqar_seq_len=64,
                   mqar_pairs=4, bench_contexts=(64, 128), bench_decode_steps=4, fixed_steps=2)


class Run:
    """One run directory: its configuration, its stages' records, and where files go."""

    def __init__(self, config: RunConfig, out: str | Path):
        self.config, self.out = config, Path(out)
        self.sizes = Sizes.quick() if config.quick else Sizes()

    def path(self, name: str) -> Path:
        return self.out / name

    def record(self, stage: str) -> dict | None:
        marker = self.path(f"stages/{stage}.json")
        return json.loads(marker.read_text()) if marker.is_file() else None

    def finish(self, stage: str, record: dict) -> None:
        write_json_atomic(self.path(f"stages/{stage}.json"), record)

    def claim(self, force: bool) -> None:
        """Create the directory for this configuration, or check it is this configuration's."""
        settings = self.path("run.json")
        if self.out.exists() and any(self.out.iterdir()):
            if force:
                shutil.rmtree(self.out)
            elif not settings.is_file():
                raise ConfigError(f"output directory {self.out} exists and is not a run directory (use --force to replace it)")
            else:
                saved = json.loads(settings.read_text()).get("config", {})
                mine = self.config.to_dict()
                changed = [k for k in mine if saved.get(k) != mine[k]]
                if changed:
                    key = changed[0]
                    raise ConfigError(
                        f"output directory {self.out} belongs to a different configuration "
                        f"({key}: {saved.get(key)!r} there, {mine[key]!r} here); use another --out or --force"
                    )
                return
        write_json_atomic(settings, {"schema": RUN_SCHEMA, "config": self.config.to_dict()})


Stage = Callable[[Run], dict]


def _resolve(run: Run) -> dict:
    from transformers import AutoConfig

    from .hub import resolve_model
    from .modeling import check_architecture

    directory = resolve_model(run.config.model)
    check_architecture(AutoConfig.from_pretrained(directory))
    return {"directory": str(directory)}


def _analyze(run: Run) -> dict:
    from .pipeline import analyze_command

    scores = analyze_command(
        run.config.model, run.config.data, str(run.path("scores.json")), plot=str(run.path("heads.png")),
        sequences=run.sizes.analyze_sequences, seq_len=run.sizes.analyze_seq_len, beta=run.config.beta,
        scorer=run.config.scorer, seed=run.config.seed,
    )
    values = sorted(v for row in scores.groups[scores.metric] for v in row)
    return {"groups": len(values), "metric": scores.metric, "min": values[0], "median": values[len(values) // 2],
            "max": values[-1], "tokens": scores.sequences * scores.seq_len}


def _convert(run: Run) -> dict:
    from .pipeline import convert_command

    return convert_command(run.config.model, str(run.path("scores.json")), run.config.beta, str(run.path("converted")),
                           mixer=run.config.mixer, scorer=run.config.scorer, seed=run.config.seed, force=True)


def _train_config(run: Run, stage: str, steps: int):
    from .train import TrainConfig

    lr = dict(zip(("transfer", "lm"), run.config.learning_rates))[stage]
    extra = dict(trainable="mixers+lora", distill_weight=1.0) if stage == "lm" else {}
    return TrainConfig(stage=stage, steps=steps, seq_len=run.sizes.train_seq_len, batch_size=run.sizes.train_batch,
                       checkpoint_every=5, seed=run.config.seed, lr=lr, **extra)


def _plan(run: Run) -> dict:
    if run.config.steps is not None:
        return {"transfer_steps": run.config.steps[0], "lm_steps": run.config.steps[1]}
    if run.sizes.fixed_steps is not None:
        return {"transfer_steps": run.sizes.fixed_steps, "lm_steps": run.sizes.fixed_steps}
    from .data import token_sequences
    from .pipeline import load_converted, load_teacher
    from .train import LMObjective, TransferObjective, seconds_per_step

    student, tokenizer = load_converted(str(run.path("converted")))
    teacher = load_teacher(student, None)
    sequences = token_sequences(tokenizer, load_documents(run.config.data), run.sizes.train_seq_len,
                                run.sizes.train_batch, run.config.seed)
    probe = _train_config(run, "lm", 1)
    lm_step = seconds_per_step(student, lambda copy: LMObjective(probe.trainable, teacher, probe.distill_weight),
                               sequences, probe)
    transfer_step = seconds_per_step(student, lambda copy: TransferObjective(teacher, copy), sequences,
                                     _train_config(run, "transfer", 1))
    budget = run.config.budget_minutes * 60
    return {
        "transfer_step_s": round(transfer_step, 3), "lm_step_s": round(lm_step, 3),
        "transfer_steps": max(1, int(TRANSFER_SHARE * budget / transfer_step)),
        "lm_steps": max(1, int((1 - TRANSFER_SHARE) * budget / lm_step)),
    }


def _training_stage(stage: str, source: str, target: str) -> Stage:
    def train_stage(run: Run) -> dict:
        from .pipeline import train_command
        from .train.loop import CHECKPOINT

        out = run.path(target)
        config = _train_config(run, stage, run.record("plan")[f"{stage}_steps"])
        summary = train_command(str(run.path(source)), run.config.data, str(out), config,
                                resume=(out / CHECKPOINT / "trainer_state.json").is_file(), force=True,
                                keep_checkpoint=True)
        shutil.rmtree(out / CHECKPOINT, ignore_errors=True)
        return {k: v for k, v in summary.items() if k != "config"}

    return train_stage


def _evaluate(run: Run) -> dict:
    """Perplexity of the original and of the converted model after each stage; HashHop and
    MQAR of the original and the final model."""
    import torch

    from .data import tokenize_documents
    from .evaluate import hashhop_accuracy, mqar_accuracy, perplexity
    from .pipeline import load_any

    sizes = run.sizes
    models = {"original": run.config.model, "converted": str(run.path("converted")),
              "transfer": str(run.path("transfer")), "final": str(run.path("final"))}
    results: dict[str, Any] = {}
    ids = None
    for name, source in models.items():
        net, tokenizer = load_any(source)
        net.eval()
        if ids is None:
            ids = torch.tensor(tokenize_documents(tokenizer, load_documents(run.config.eval_data)))[: sizes.ppl_tokens]
        results[f"ppl_{name}"] = perplexity(net, ids, context=sizes.ppl_context).to_dict()
        if name in ("original", "final"):
            results[f"hashhop_{name}"] = hashhop_accuracy(
                net, tokenizer, num_problems=sizes.hashhop_problems, hops=1, target_tokens=sizes.hashhop_tokens,
                seed=run.config.seed)
            results[f"mqar_{name}"] = mqar_accuracy(
                net, tokenizer, num_examples=sizes.mqar_examples, seq_len=sizes.mqar_seq_len,
                num_kv_pairs=sizes.mqar_pairs, seed=run.config.seed)
    write_json_atomic(run.path("eval.json"), results)
    return {"ppl_original": results["ppl_original"]["ppl"], "ppl_final": results["ppl_final"]["ppl"]}


def _bench(run: Run) -> dict:
    from .pipeline import bench_command

    result = bench_command([str(run.path("final"))], list(run.sizes.bench_contexts), str(run.path("bench.json")),
                           baseline=run.config.model, decode_steps=run.sizes.bench_decode_steps,
                           plot=str(run.path("bench.png")))
    return {"contexts": result["contexts"]}


def collect_metrics(run: Run) -> dict[str, Any]:
    """The run's headline numbers as one flat dict (documented in docs/run.md)."""
    config, records = run.config, {name: run.record(name) for name, _, _ in stages(run) if name != "report"}
    evaluation = json.loads(run.path("eval.json").read_text())
    bench = json.loads(run.path("bench.json").read_text())
    largest = max(bench["contexts"])
    rows = {r["model"]: r for r in bench["measurements"] if r["context"] == largest}
    final = str(run.path("final"))
    ratios = {r["baseline"]: r for r in bench["ratios"] if r["context"] == largest and r["model"] == final}
    budgets = {b["model"]: b for b in bench["cache_budget"]}
    converted = records["convert"]
    metrics: dict[str, Any] = {
        "schema": RUN_SCHEMA, "quick": config.quick, "model": config.model, "beta": config.beta,
        "mixer": config.mixer, "scorer": config.scorer, "budget_minutes": config.budget_minutes, "seed": config.seed,
        "replaced_groups": converted["groups"], "replaced_fraction": converted["fraction"],
        "params_original": converted["original_total"], "params_converted": converted["converted_total"],
        "analyze_tokens": records["analyze"]["tokens"], "rr_median": records["analyze"]["median"],
    }
    for stage, lr in zip(("transfer", "lm"), config.learning_rates):
        summary = records[stage]
        metrics.update({f"{stage}_steps": summary["steps"], f"{stage}_tokens": summary["tokens"], f"{stage}_lr": lr,
                        f"{stage}_minutes": round(summary["elapsed_s"] / 60, 2), f"{stage}_final_loss": summary["final_loss"]})
    for name in ("original", "converted", "transfer", "final"):
        metrics[f"ppl_{name}"] = evaluation[f"ppl_{name}"]["ppl"]
    metrics["ppl_tokens"] = evaluation["ppl_original"]["tokens"]
    metrics["ppl_ratio"] = metrics["ppl_final"] / metrics["ppl_original"]
    for task, key in (("hashhop", "exact_match"), ("mqar", "accuracy")):
        for name in ("original", "final"):
            metrics[f"{task}_{name}"] = evaluation[f"{task}_{name}"][key]
    metrics.update({
        "bench_context": largest, "bench_threads": bench["threads"],
        "cache_bytes_original": rows["original"]["cache_bytes"], "cache_bytes_final": rows[final]["cache_bytes"],
        "cache_ratio": ratios["original"]["cache_bytes_ratio"],
        "decode_tokens_per_s_original": rows["original"]["decode_tokens_per_s"],
        "decode_tokens_per_s_final": rows[final]["decode_tokens_per_s"],
        "decode_speedup": ratios["original"]["decode_speedup"],
        "decode_speedup_vs_static_cache": ratios["original+static-cache"]["decode_speedup"],
        "prefill_time_ratio": ratios["original"]["prefill_time_ratio"],
        "max_context_in_budget_original": budgets["original"]["max_context"],
        "max_context_in_budget_final": budgets[final]["max_context"],
        "cache_budget_bytes": budgets[final]["budget_bytes"],
    })
    metrics.update({f"seconds_{name}": record["seconds"] for name, record in records.items()})
    metrics["total_minutes"] = round(sum(record["seconds"] for record in records.values()) / 60, 2)
    return metrics


def _report(run: Run) -> dict:
    from .report import plot_loss_curves, render_run_report

    metrics = collect_metrics(run)
    plot_loss_curves({stage: run.path(f"{folder}/train_log.jsonl") for stage, folder in (("transfer", "transfer"), ("lm", "final"))},
                     run.path("loss.png"))
    write_json_atomic(run.path("metrics.json"), metrics)
    evaluation = json.loads(run.path("eval.json").read_text())
    bench = json.loads(run.path("bench.json").read_text())
    write_text_atomic(run.path("report.md"), render_run_report(metrics, run.config.to_dict(), evaluation, bench))
    return {"metrics": len(metrics)}


def stages(run: Run) -> list[tuple[str, Stage, float]]:
    """(name, function, expected seconds) of every stage; the seconds weight the progress bar."""
    minutes = 0.0 if run.config.quick else run.config.budget_minutes
    small = 5.0 if run.config.quick else 1.0
    return [
        ("resolve", _resolve, 5.0),
        ("analyze", _analyze, 60.0 / small),
        ("convert", _convert, 15.0),
        ("plan", _plan, 40.0 / small),
        ("transfer", _training_stage("transfer", "converted", "transfer"), max(10.0, TRANSFER_SHARE * minutes * 60)),
        ("lm", _training_stage("lm", "transfer", "final"), max(10.0, (1 - TRANSFER_SHARE) * minutes * 60)),
        ("evaluate", _evaluate, 180.0 / small),
        ("bench", _bench, 240.0 / small),
        ("report", _report, 5.0),
    ]


def run_pipeline(config: RunConfig, out: str | Path, force: bool = False, progress: bool = True) -> dict:
    """Run (or continue) every stage of `config` in `out`; returns the metrics."""
    run = Run(config, out)
    run.claim(force)
    plan = stages(run)
    bar = tqdm(total=round(sum(weight for _, _, weight in plan)), desc="run", disable=not progress,
               bar_format="{desc} |{bar}| {percentage:3.0f}% [{elapsed}<{remaining}]")
    for number, (name, stage, weight) in enumerate(plan, start=1):
        bar.set_description(f"run: stage {number}/{len(plan)} {name}")
        if run.record(name) is None:
            started = time.monotonic()
            record = stage(run)
            run.finish(name, {**record, "seconds": round(time.monotonic() - started, 2)})
        bar.update(round(weight))
    bar.close()
    return json.loads(run.path("metrics.json").read_text())
