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
               (window+* mixers: the tail recipe, only the tail, on the KL alone; docs/run.md)
7. `evaluate`  every evaluation task that `run` uses (see `evaluate`), original vs converted
8. `bench`     cache bytes, prefill time and decode speed against the original
9. `report`    report.md, metrics.json and plots

The stages share one `Run`: its configuration, the paths of its directory (`RunLayout`),
and the models and data it has loaded, so that a stage reuses what an earlier one holds.

[ours] The time budget (`budget_minutes`) is the training time. The `plan` stage times one
optimizer step of each training stage on a copy of the model and fixes the step counts
(35% of the budget for `transfer`, 65% for `lm`), so a re-run trains exactly the same
steps whatever the machine's load is then; `steps` fixes them instead (to compare runs at
equal tokens). `run.json` records the configuration; a directory made by another
configuration is refused before any work starts.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from torch import Tensor
from tqdm.auto import tqdm
from transformers import AutoConfig

from .ablation import AblationConfig
from .attention import check_window_fits
from .bench import BenchConfig, against_original
from .checks import check_model_folder, read_json_object, require_finite
from .config import ConfigError, MixerConfig, check_replaces_some, option, parse_ssd_state, require
from .data import (
    DATA_ENV,
    EVAL_CORPORA,
    OUT_OF_DOMAIN_CORPORA,
    TRAIN_CORPORA,
    Corpus,
    DataError,
    count_tokens,
    load_documents,
    shared_corpora,
    token_sequences,
)
from .equal_cache import equal_cache_window, window_baseline
from .errors import RecurformerError
from .evaluate import TASKS, RunSettings, Task
from .files import write_json_atomic, write_text_atomic
from .hub import locate, model_path, resolve_model
from .loading import load_converted, load_model, model_bytes, portable_name, reusing_original, save_model
from .memory import PeakMemory, release_freed_memory
from .metrics import BASELINE, MODELS, RUN_METRICS, RUN_ROWS, Metric, Row, RunResults, by_key, collect, mib
from .mixers import MIXERS
from .modeling import check_architecture
from .outputs import Claim, check_output, claim_folder, size_of
from .report import plot_bench, plot_head_heatmap, plot_loss_curves, render_run_report
from .scoring import SCORERS, AnalysisConfig, HeadScores, SelectionConfig, ablation_measurement, analyze_text
from .surgery import convert, parameter_report
from .train import CHECKPOINT, TrainConfig, objective_for, seconds_per_step, train_stage

RUN_SCHEMA = "recurformer-run/2"
TRANSFER_SHARE = 0.35
MICRO_BATCH_TOKENS = 1024
MAX_BUDGET_MINUTES = 525_600  # a year: a larger budget is a typo (and inf would overflow the step counts)
# [ours] room for a run, in copies of the original model's weights: converted/, transfer/, final/
# (~1.1x each), a training checkpoint and the one being written
RUN_MODEL_COPIES = 6
def _pair(convert: Callable[[str], Any], what: str, example: str) -> Callable[[str], tuple]:
    """A parser for `TRANSFER,LM`: two values read by `convert`."""

    def parse(text: str) -> tuple:
        try:
            transfer, lm = (convert(part) for part in text.split(","))
        except ValueError:
            raise ConfigError(f"expected TRANSFER,LM {what} such as {example}, got {text!r}") from None
        return transfer, lm

    return parse


# [ours] run's shape of a kind, where it differs from the library's defaults (MixerConfig):
# the default window+mamba2 spends its state bytes on a longer window and a small tail (16
# state values per head instead of 64); at the bytes of a 169-token window it beats that
# window, which the window of 64 with the full tail did not (docs/mixers.md, "Window or state").
RUN_SHAPES: dict[str, dict[str, Any]] = {"window+mamba2": {"window": 141, "ssd_state": 16}}


@dataclass
class RunConfig:
    """Everything that determines a run's results; `run.json` stores it.

    `quick` replaces every size by a tiny one (a smoke test: its numbers mean nothing).
    """

    model: str = option("smollm2-135m", "a local Hugging Face model directory or a known name")
    data: list[str] = option(help=f"training and head-scoring text (the shared corpora, in ${DATA_ENV} or "
                             "../shared/data)", metavar="FILE", factory=lambda: shared_corpora(TRAIN_CORPORA))
    eval_data: list[str] = option(help="held-out text for perplexity and the long-range tasks", metavar="FILE",
                                  factory=lambda: shared_corpora(EVAL_CORPORA))
    ood_data: list[str] = option(help="out-of-domain text for perplexity and agreement (another domain than "
                                 "--data, evaluation only)", metavar="FILE",
                                 factory=lambda: shared_corpora(OUT_OF_DOMAIN_CORPORA))
    beta: float = option(SelectionConfig.beta, "fraction of KV groups to replace")
    # [ours] not the paper's `mamba`: at equal training a window with a recurrent tail, trained
    # by the tail recipe, ends closest to the original (docs/results/mixers.md, README)
    mixer: str = option("window+mamba2", "mixer kind (docs/mixers.md)")
    window: int | None = option(None, "window mixers: tokens each query attends back (default: "
                                f"{RUN_SHAPES['window+mamba2']['window']} for window+mamba2, else {MixerConfig.window})")
    sinks: int | None = option(None, f"window mixers: first tokens every query also attends (default "
                               f"{MixerConfig.sinks})")
    ssd_state: int | str | None = option(None, "mamba2 kinds: state size per head (default: "
                                         f"{RUN_SHAPES['window+mamba2']['ssd_state']} for window+mamba2, "
                                         f"{MixerConfig.ssd_state} for mamba2)", parse=parse_ssd_state, metavar="N")
    scorer: str = option(SelectionConfig.scorer, "which groups go first: " + " | ".join(SCORERS))
    budget_minutes: float = option(25.0, "training time of both stages together")
    steps: tuple[int, int] | None = option(None, "train exactly these optimizer steps instead of the budget "
                                           "(equal-token comparisons)", metavar="TRANSFER,LM",
                                           parse=_pair(int, "step counts", "40,16"))
    lr: tuple[float, float] | None = option(None, "learning rates of the two stages (default: the mixer's, "
                                            "docs/run.md)", metavar="TRANSFER,LM",
                                            parse=_pair(float, "learning rates", "5e-3,1e-3"))
    quick: bool = option(False, "tiny sizes everywhere: a smoke test, numbers not meaningful")
    seed: int = option(SelectionConfig.seed, "data order, random scorer, task problems")

    def __post_init__(self) -> None:
        locate(self.model)
        require(bool(self.data), "no training data: pass --data FILE...")
        require(bool(self.eval_data), "no evaluation data: pass --eval-data FILE...")
        require(bool(self.ood_data), "no out-of-domain evaluation data: pass --ood-data FILE...")
        training = {str(Path(p).resolve()) for p in self.data}
        for flag, paths in (("--eval-data", self.eval_data), ("--ood-data", self.ood_data)):
            overlap = training & {str(Path(p).resolve()) for p in paths}
            if overlap:
                raise ConfigError(f"{flag} must be held out, but {min(overlap)} is also in --data")
        SelectionConfig(self.beta, self.scorer, self.seed)
        require(self.beta > 0, "--beta 0 replaces no KV group: run needs a beta in (0, 1]")
        for name, value in RUN_SHAPES.get(self.mixer, {}).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        self.mixer_config()
        require(self.budget_minutes > 0, f"--budget-minutes must be > 0, got {self.budget_minutes}")
        require(self.budget_minutes <= MAX_BUDGET_MINUTES,
                f"--budget-minutes must be at most {MAX_BUDGET_MINUTES:,} (a year), got {self.budget_minutes}")
        if self.steps is not None:
            require(len(self.steps) == 2 and all(isinstance(n, int) and n >= 1 for n in self.steps),
                    f"--steps must be two positive integers TRANSFER,LM, got {self.steps}")
            self.steps = tuple(self.steps)
        if self.lr is not None:
            require(len(self.lr) == 2 and all(0 < x < 1 for x in self.lr),
                    f"--lr must be two learning rates in (0, 1) TRANSFER,LM, got {self.lr}")
            self.lr = tuple(self.lr)
        for path in [*self.data, *self.eval_data, *self.ood_data]:
            if not Path(path).is_file():
                raise DataError(f"data file not found: {path}")

    def mixer_config(self) -> MixerConfig:
        """The mixer of the conversion: `mixer` with `window`, `sinks` and `ssd_state` where
        given or in `RUN_SHAPES` (an error for a kind that does not read them)."""
        return MixerConfig.from_flags(self.mixer, window=self.window, sinks=self.sinks, ssd_state=self.ssd_state)

    @property
    def learning_rates(self) -> tuple[float, float]:
        """(transfer, lm): the given ones, else the mixer kind's (`Mixer.learning_rates`; the
        recipe of docs/results/recovery.md: the layer-local transfer stage takes a 5x higher
        rate than the end-to-end lm stage)."""
        return self.lr or MIXERS[self.mixer].learning_rates

    @property
    def selection(self) -> SelectionConfig:
        return SelectionConfig(self.beta, self.scorer, self.seed)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["data"] = [str(Path(p).resolve()) for p in self.data]
        data["eval_data"] = [str(Path(p).resolve()) for p in self.eval_data]
        data["ood_data"] = [str(Path(p).resolve()) for p in self.ood_data]
        data["steps"] = None if self.steps is None else list(self.steps)
        data["lr"] = None if self.lr is None else list(self.lr)
        return data


@dataclass(frozen=True)
class Sizes:
    """The sizes of the stages' work (the full run, or the tiny `quick` one); the
    evaluation tasks size themselves (`Task.run_options`)."""

    analysis: AnalysisConfig = AnalysisConfig(sequences=16, seq_len=1024)
    ablation: AblationConfig = AblationConfig()  # read only with --scorer ablation or ablation-greedy
    train_seq_len: int = 512
    train_batch: int = 8
    # window+* kinds (the tail recipe): sequences several times the window, as many tokens per step
    tail_seq_len: int = 1024
    tail_batch: int = 4
    bench: BenchConfig = BenchConfig(contexts=(512, 2048, 4096), decode_steps=32)
    fixed_steps: int | None = None  # quick: skip the timing and train this many steps

    @classmethod
    def quick(cls) -> "Sizes":
        return cls(analysis=AnalysisConfig(sequences=2, seq_len=128),
                   ablation=AblationConfig(ablation_sequences=1, ablation_seq_len=128, ablation_from=64),
                   train_seq_len=64, train_batch=2, tail_seq_len=96, tail_batch=2,
                   bench=BenchConfig(contexts=(64, 128), decode_steps=4), fixed_steps=2)


@dataclass(frozen=True)
class RunLayout:
    """The paths inside a run directory."""

    root: Path

    @property
    def settings(self) -> Path:
        return self.root / "run.json"

    @property
    def scores(self) -> Path:
        return self.root / "scores.json"

    @property
    def ablation_checkpoint(self) -> Path:
        """The ablation costs of the layers scored so far (removed once scores.json is written)."""
        return self.root / "ablation-partial.json"

    @property
    def heads_plot(self) -> Path:
        return self.root / "heads.png"

    @property
    def evaluation(self) -> Path:
        return self.root / "eval.json"

    @property
    def bench(self) -> Path:
        return self.root / "bench.json"

    @property
    def bench_plot(self) -> Path:
        return self.root / "bench.png"

    @property
    def loss_plot(self) -> Path:
        return self.root / "loss.png"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.json"

    @property
    def report(self) -> Path:
        return self.root / "report.md"

    def model(self, name: str) -> Path:
        """The directory of the converted model after a stage: converted, transfer or final."""
        require(name in MODELS[1:], f"no model directory called {name!r}")
        return self.root / name

    def marker(self, stage: str) -> Path:
        return self.root / "stages" / f"{stage}.json"


class Run:
    """One run: its configuration, its directory, its stages' records, and the models and
    data loaded so far (kept, so that a later stage reuses them)."""

    def __init__(self, config: RunConfig, out: str | Path):
        self.config, self.layout = config, RunLayout(Path(out))
        self.sizes = Sizes.quick() if config.quick else Sizes()
        self._models: dict[str, Any] = {}

    @property
    def out(self) -> Path:
        return self.layout.root

    def record(self, stage: str) -> dict | None:
        marker = self.layout.marker(stage)
        return json.loads(marker.read_text()) if marker.is_file() else None

    def finish(self, stage: str, record: dict) -> None:
        write_json_atomic(self.layout.marker(stage), record)

    def claim(self, force: bool) -> Claim:
        """Check `--out` (not an input, writable, room for the run), then hold the directory
        (`outputs.claim_folder`: locked while this process writes it, stale staging swept,
        `--force` empties only a run directory) and make it this configuration's, or check
        it is. Use as `with run.claim(force):`; the lock goes when the block ends."""
        settings, out = self.layout.settings, self.out
        need = RUN_MODEL_COPIES * model_bytes(self.config.model) - (0 if force else size_of(out))  # less what is written
        check_output(out, [model_path(self.config.model), *self.config.data, *self.config.eval_data,
                           *self.config.ood_data], need, replaced=force)
        claim = claim_folder(out, "run", keep=True, replace=force, ours=_run_settings(settings) is not None)
        claim.written.add(settings.name)
        try:
            self._check_or_write_settings()
        except BaseException:
            claim.release(failed=True)
            raise
        return claim

    def _check_or_write_settings(self) -> None:
        """Write run.json, or check that the one there is of this schema and configuration."""
        settings, out = self.layout.settings, self.out
        if not settings.is_file():
            write_json_atomic(settings, {"schema": RUN_SCHEMA, "config": self.config.to_dict()})
            return
        saved = read_json_object(settings, "run settings")
        if saved.get("schema") != RUN_SCHEMA:
            raise ConfigError(f"run directory {out} was made by an older recurformer ({saved.get('schema')}); "
                              "start it over with --force, or use another --out")
        if not isinstance(saved.get("config"), dict):
            raise ConfigError(f"run settings {settings}: has no config; start the run over with --force")
        mine = self.config.to_dict()
        changed = [k for k in mine if saved["config"].get(k) != mine[k]]
        if changed:
            key = changed[0]
            raise ConfigError(
                f"output directory {out} belongs to a different configuration "
                f"({key}: {saved['config'].get(key)!r} there, {mine[key]!r} here); use another --out or --force"
            )

    @cached_property
    def original(self):
        """(the original model, its tokenizer), loaded once."""
        model, tokenizer, _ = load_model(self.config.model)
        return model, tokenizer

    @cached_property
    def train_documents(self) -> Corpus:
        return load_documents(self.config.data)

    @property
    def tail_recipe(self) -> bool:
        """Whether the mixer is a window with a tail, trained by the tail recipe
        (docs/training.md): only the tail, on longer sequences, the lm stage on the KL alone."""
        return MIXERS[self.config.mixer].has_tail

    @cached_property
    def train_sequences(self) -> Tensor:
        """`[N, seq_len]` training sequences of the stages' length, shuffled with the run's seed."""
        length = self.sizes.tail_seq_len if self.tail_recipe else self.sizes.train_seq_len
        return token_sequences(self.original[1], self.train_documents, length, seed=self.config.seed)

    def drop_models(self) -> None:
        """Let go of the converted models held for later stages (they load again from their
        directories when needed) and return their memory to the OS."""
        self._models.clear()
        release_freed_memory()  # a model let go no longer counts in what comes after

    def keep(self, name: str, model) -> None:
        """Hold the converted model `name` (converted, transfer, final) for later stages."""
        self._models[name] = model

    def converted(self, name: str, take: bool = False):
        """The converted model `name`, held or loaded from its directory; `take` hands it
        over (a training stage changes it in place, so it is no longer `name`)."""
        model = self._models.pop(name, None) if take else self._models.get(name)
        if model is None:
            model = load_converted(self.layout.model(name))[0]
            if not take:
                self._models[name] = model
        return model

    def train_config(self, stage: str, steps: int) -> TrainConfig:
        lr = dict(zip(("transfer", "lm"), self.config.learning_rates))[stage]
        if self.tail_recipe:
            extra = dict(trainable="tail", distill_weight=1.0, ce_weight=0.0) if stage == "lm" else dict(trainable="tail")
            sizes = dict(seq_len=self.sizes.tail_seq_len, batch_size=self.sizes.tail_batch)
        else:
            extra = dict(trainable="mixers+lora", distill_weight=1.0) if stage == "lm" else {}
            sizes = dict(seq_len=self.sizes.train_seq_len, batch_size=self.sizes.train_batch)
        # the same step in micro-batches of about MICRO_BATCH_TOKENS: the activations kept for
        # the backward pass, not the step's tokens, set the peak memory (docs/training.md)
        sizes["grad_accum"] = math.gcd(sizes["batch_size"], max(1, sizes["batch_size"] * sizes["seq_len"] // MICRO_BATCH_TOKENS))
        return TrainConfig(stage=stage, steps=steps, checkpoint_every=5, seed=self.config.seed, lr=lr, **sizes, **extra)

    def task_settings(self) -> RunSettings:
        return RunSettings(quick=self.config.quick, eval_data=list(self.config.eval_data), seed=self.config.seed,
                           ood_data=tuple(self.config.ood_data))

    @cached_property
    def baseline_window(self) -> int:
        """The window of the training-free `window` rival on the final model's groups at its
        cache bytes (equal_cache.py); the final model is loaded for it and let go."""
        return equal_cache_window(self.original[0], load_converted(self.layout.model("final"))[0])


Stage = Callable[[Run], dict]


def _run_settings(path: Path) -> dict | None:
    """run.json of a run directory made before output folders carried a marker, or None."""
    try:
        saved = read_json_object(path) if path.is_file() else None
    except RecurformerError:
        return None
    return saved if saved and str(saved.get("schema", "")).startswith("recurformer-run/") else None


def run_tasks() -> list[Task]:
    """The evaluation tasks `run` uses, in report order."""
    return sorted((t for t in TASKS.values() if t.run_options is not None), key=lambda t: t.report_order)


def evaluation_tokens(settings: RunSettings) -> int:
    """The most tokens of one evaluation text that the run's tasks read at once (their
    longest `context`)."""
    return max(getattr(options, "context", 0) for task in run_tasks() for options in task.run_options(settings).values())


def _resolve(run: Run) -> dict:
    """Fetch the model, and check before any long work that it takes the mixer and that the
    evaluation texts are long enough."""
    directory = resolve_model(run.config.model)
    check_model_folder(directory)
    config = AutoConfig.from_pretrained(directory)
    check_architecture(config)
    check_window_fits(config, run.config.mixer_config())
    check_replaces_some(run.config.beta, config.num_hidden_layers * config.num_key_value_heads)
    needed = evaluation_tokens(run.task_settings())
    for flag, paths in (("--eval-data", run.config.eval_data), ("--ood-data", run.config.ood_data)):
        tokens = count_tokens(run.original[1], load_documents(paths), limit=needed)
        if tokens < needed:
            raise DataError(f"{flag} has {tokens:,} tokens; the evaluation needs at least {needed:,}")
    return {"directory": str(directory)}


def _analyze(run: Run) -> dict:
    model, tokenizer = run.original
    ablation = ablation_measurement(run.config.scorer, run.sizes.ablation)
    scores = analyze_text(model, tokenizer, run.train_documents, run.sizes.analysis, seed=run.config.seed,
                          model_name=run.config.model, data=list(run.config.data), ablation=ablation,
                          checkpoint=run.layout.ablation_checkpoint)
    scores.save(run.layout.scores)
    run.layout.ablation_checkpoint.unlink(missing_ok=True)
    plot_head_heatmap(scores, run.layout.heads_plot, run.config.selection.select(scores))
    values = sorted(v for row in scores.groups[scores.metric] for v in row)
    return {"groups": len(values), "metric": scores.metric, "min": values[0], "median": values[len(values) // 2],
            "max": values[-1], "tokens": scores.sequences * scores.seq_len}


def _convert(run: Run) -> dict:
    model, tokenizer = run.original
    scores = HeadScores.load(run.layout.scores)
    scores.check_model(model, run.config.model)
    spec = run.config.selection.select(scores)
    converted = convert(model, spec, run.config.mixer_config(), init="reuse", seed=run.config.seed,
                        source_model=portable_name(run.config.model))
    save_model(converted, tokenizer, run.layout.model("converted"))
    run.keep("converted", converted)
    return {"groups": len(spec.groups), "fraction": spec.fraction, **parameter_report(model, converted)}


def _plan(run: Run) -> dict:
    if run.config.steps is not None:
        return {"transfer_steps": run.config.steps[0], "lm_steps": run.config.steps[1]}
    if run.sizes.fixed_steps is not None:
        return {"transfer_steps": run.sizes.fixed_steps, "lm_steps": run.sizes.fixed_steps}
    student, teacher = run.converted("converted"), run.original[0]
    timed = {}
    for stage in ("transfer", "lm"):
        probe = run.train_config(stage, 1)
        timed[stage] = seconds_per_step(student, lambda copy, probe=probe: objective_for(probe, copy, teacher),
                                        run.train_sequences, probe)
    transfer_step, lm_step = timed["transfer"], timed["lm"]
    budget = run.config.budget_minutes * 60
    return {
        "transfer_step_s": round(transfer_step, 3), "lm_step_s": round(lm_step, 3),
        "transfer_steps": max(1, int(TRANSFER_SHARE * budget / transfer_step)),
        "lm_steps": max(1, int((1 - TRANSFER_SHARE) * budget / lm_step)),
    }


def _training_stage(stage: str, source: str, target: str) -> Stage:
    def train(run: Run) -> dict:
        out = run.layout.model(target)
        config = run.train_config(stage, run.record("plan")[f"{stage}_steps"])
        resume = (out / CHECKPOINT / "trainer_state.json").is_file()
        if out.exists() and not resume:
            shutil.rmtree(out)  # an earlier attempt that wrote no checkpoint
        student = run.converted(source, take=True)
        summary = train_stage(student, run.original[1], run.original[0], run.train_sequences, config, out, resume=resume)
        shutil.rmtree(out / CHECKPOINT, ignore_errors=True)
        run.keep(target, student)
        return {**{k: v for k, v in summary.items() if k != "config"}, "lr": config.lr}

    return train


def _evaluated_model(run: Run, name: str):
    """The model `name`, loaded from its directory (the baseline: built from the final model)."""
    if name == "original":
        return run.original[0]
    if name == BASELINE:
        final = load_converted(run.layout.model("final"))[0]
        return window_baseline(run.original[0], final, run.baseline_window)[0]
    return load_converted(run.layout.model(name))[0]


def _evaluate(run: Run) -> dict:
    """Every evaluation of every task `run` uses, on each of the task's models; eval.json is
    `{evaluation: {model: result}}` (an evaluation is a task with options, `Task.run_options`).
    One model at a time: each is loaded, evaluated and let go before the next (besides the
    original, which the run holds)."""
    settings, tasks = run.task_settings(), run_tasks()
    runs = {task.name: task.run_options(settings) for task in tasks}
    results: dict[str, dict[str, Any]] = {key: {} for task in tasks for key in runs[task.name]}
    run.drop_models()
    with reusing_original(portable_name(run.config.model), run.original[0]):  # agreement's reference: no second copy
        for name in (*MODELS, BASELINE):
            work = [(task, key, options) for task in tasks for key, options in runs[task.name].items()
                    if name in task.models_for(key)]
            if not work:
                continue
            model = _evaluated_model(run, name).eval()
            for task, key, options in work:
                results[key][name] = task.evaluate(model, run.original[1], options)
            del model
            release_freed_memory()
    require_finite(results, "evaluation")  # never a NaN written as a result
    write_json_atomic(run.layout.evaluation, results)
    return {"evaluations": list(results), "baseline_window": run.baseline_window}


def _bench(run: Run) -> dict:
    final = run.converted("final")
    # named "final", not by its path: a run folder that is moved still finds its measurements
    result = against_original({"final": final}, run.original[0], run.sizes.bench,
                              progress=lambda m: print(f"bench: {m}", flush=True))
    write_json_atomic(run.layout.bench, result)
    plot_bench(result, run.layout.bench_plot)
    return {"contexts": result["contexts"]}


def metric_table(tasks: list[Task] | None = None) -> tuple[list[Metric], list[Row]]:
    """Every metric of a run and the summary table's rows: the evaluation tasks' (in report
    order), then the run's own (metrics.RUN_METRICS), then each stage's wall time and peak
    resident memory."""
    tasks = run_tasks() if tasks is None else tasks
    timed = [name for name, _, _ in STAGES if name != "report"]
    seconds = [Metric(f"seconds_{name}", f"wall time of the {name} stage", (lambda r, n=name: r.records[n]["seconds"]),
                      "{:.1f}", unit="s") for name in timed]
    memory = [Metric(f"peak_rss_{name}", f"peak resident memory of the process during the {name} stage",
                     (lambda r, n=name: r.records[n].get("peak_rss_bytes")), mib, "lower", "bytes") for name in timed]
    total = Metric("total_minutes", "wall time of all stages",
                   lambda r: round(sum(r.records[n]["seconds"] for n in timed) / 60, 2), "{:.1f}", unit="min")
    peak = Metric("peak_rss", "peak resident memory of the process over all stages",
                  lambda r: max(filter(None, (r.records[n].get("peak_rss_bytes") for n in timed)), default=None), mib,
                  "lower", "bytes")
    metrics = [*RUN_METRICS, *(m for t in tasks for m in t.metrics), *seconds, *memory, total, peak]
    rows = [*(row for t in tasks for row in t.rows), *RUN_ROWS]
    return metrics, rows


def _report(run: Run) -> dict:
    metrics, rows = metric_table()
    results = RunResults(
        config={**run.config.to_dict(), "schema": RUN_SCHEMA}, records={n: run.record(n) for n, _, _ in STAGES[:-1]},
        evaluation=json.loads(run.layout.evaluation.read_text()), bench=json.loads(run.layout.bench.read_text()),
        final="final",
    )
    values = {"schema": RUN_SCHEMA, **collect(results, metrics)}
    plot_loss_curves({stage: run.layout.model(folder) / "train_log.jsonl" for stage, folder in (("transfer", "transfer"), ("lm", "final"))},
                     run.layout.loss_plot)
    write_json_atomic(run.layout.metrics, values)
    write_text_atomic(run.layout.report, render_run_report(values, by_key(metrics), rows, run.config.to_dict(), results.bench,
                                                            results.evaluation))
    return {"metrics": len(values)}


# (name, function, expected seconds of a full run); the seconds weight the progress bar
STAGES: list[tuple[str, Stage, float]] = [
    ("resolve", _resolve, 5.0),
    ("analyze", _analyze, 60.0),
    ("convert", _convert, 15.0),
    ("plan", _plan, 40.0),
    ("transfer", _training_stage("transfer", "converted", "transfer"), 0.0),
    ("lm", _training_stage("lm", "transfer", "final"), 0.0),
    ("evaluate", _evaluate, 180.0),
    ("bench", _bench, 240.0),
    ("report", _report, 5.0),
]


def stage_weights(config: RunConfig) -> dict[str, float]:
    """Expected seconds of each stage (the training stages share the budget); a quick run
    weighs its sizes' work, not the budget."""
    minutes = 0.0 if config.quick else config.budget_minutes
    weights = {name: seconds / (5.0 if config.quick and seconds > 15 else 1.0) for name, _, seconds in STAGES}
    weights["transfer"] = max(10.0, TRANSFER_SHARE * minutes * 60)
    weights["lm"] = max(10.0, (1 - TRANSFER_SHARE) * minutes * 60)
    return weights


def run_pipeline(config: RunConfig, out: str | Path, force: bool = False, progress: bool = True,
                 stages: list[tuple[str, Stage, float]] | None = None) -> dict:
    """Run (or continue) every stage of `config` in `out`; returns the metrics."""
    run = Run(config, out)
    plan = stages or STAGES
    weights = stage_weights(config)
    # the run directory is locked until the run ends; the bar is closed before an error is shown
    with run.claim(force), tqdm(total=round(sum(weights.get(name, seconds) for name, _, seconds in plan)), desc="run",
                                disable=not progress,
                                bar_format="{desc} |{bar}| {percentage:3.0f}% [{elapsed}<{remaining}]") as bar:
        for number, (name, stage, seconds) in enumerate(plan, start=1):
            bar.set_description(f"run: stage {number}/{len(plan)} {name}")
            if run.record(name) is None:
                started = time.monotonic()
                # settled: what earlier stages freed is not counted in this stage's peak
                with PeakMemory(settle=True) as memory:
                    record = stage(run)
                run.finish(name, {**record, "seconds": round(time.monotonic() - started, 2), "peak_rss_bytes": memory.peak})
            bar.update(round(weights.get(name, seconds)))
    return json.loads(run.layout.metrics.read_text())
