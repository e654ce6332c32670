"""The stages of `recurformer run`, in order, and the `Run` they share.

1. `resolve`   the model (fetched once into the local cache if it is a known name), and the
               retrieval mix (made here). Before it, before the run folder is claimed,
               `check_stages` checks what every stage still to run would refuse (the
               architecture, the window, each stage's lengths against the model's
               positions, the texts' lengths) from the model's config and its tokenizer
2. `analyze`   head statistics and scores on the training text -> scores.json, heads.png
3. `convert`   replace the top-beta KV groups -> converted/
4. `plan`      fix the step counts: `steps` as given, else the recipe's measured steps or
               what a time budget buys (one step of each training stage timed)
5. `transfer`  train the mixers to reproduce the replaced heads -> transfer/
6. `lm`        end-to-end training towards the original -> final/
7. `evaluate`  every evaluation task `run` uses, on the original, the converted models and
               the training-free window at equal cache bytes -> eval.json
8. `bench`     cache bytes, prefill time and decode speed against the original
9. `report`    metrics.json, report.md and the loss plot

How the stages train is the mixer kind's recipe (`recipe.py`). [ours] A run trains the
recipe's measured steps (`Recipe.measured_steps`: those its documented numbers were
measured with), so it makes the documented model on any machine; `steps` fixes others (to
compare runs at equal tokens). A time budget (`budget_minutes`, and for a recipe without
measured steps the default one) bounds the training time instead: `plan` times one
optimizer step of each stage on a copy of the model and fixes the step counts (the
recipe's `transfer_share` of the budget for `transfer`, the rest for `lm`), so a re-run
trains exactly the same steps whatever the machine's load is then.

`analyze_heads` and `convert_heads` are also the `analyze` and `convert` commands.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import AutoConfig

from ..ablation import AblationConfig, check_ablation, check_calibration_text
from ..attention import check_window_fits
from ..bench import against_original, check_contexts
from ..checks import read_json_object, require_finite
from ..config import ConfigError, check_replaces_some
from ..device import resolve_device
from ..data import Corpus, DataError, check_length, check_sequences, count_tokens, load_documents, token_sequences
from ..equal_cache import equal_cache_window, window_baseline
from ..evaluate import TASKS, RunSettings, Task
from ..files import write_json_atomic, write_text_atomic
from ..hub import model_path, resolve_model
from ..loading import load_converted, load_model, load_tokenizer, model_bytes, portable_name, save_model
from ..memory import release_freed_memory
from ..metrics import BASELINE, MODELS, Metric, Row, RunResults, by_key, collect, run_metric_table
from ..mixers import MixerConfig
from ..model_card import write_model_card
from ..modeling import check_architecture
from ..outputs import Claim
from ..report import plot_bench, plot_head_heatmap, plot_loss_curves, render_run_report
from ..retrieval_mix import mix_retrieval
from ..scoring import AnalysisConfig, HeadScores, SelectionConfig, analyze_text
from ..scoring.head_statistics import ablation_checkpoints
from ..surgery import convert, parameter_report
from ..train import CHECKPOINT, TrainConfig, has_checkpoint, objective_for, seconds_per_step, train_stage
from .config import RunConfig, Sizes
from .layout import RUN_SCHEMA, RunLayout

# [ours] room for a run, in copies of the original model's weights: converted/, transfer/, final/
# (~1.1x each), a training checkpoint and the one being written
RUN_MODEL_COPIES = 6


def analyze_heads(model, tokenizer, documents: list[str], analysis: AnalysisConfig, selection: SelectionConfig,
                  ablation: AblationConfig, model_name: str, data: list[str], out: str | Path,
                  checkpoint: str | Path, plot: str | Path | None = None) -> HeadScores:
    """Score every head of `model` on `documents` and write the scores to `out` (and the
    heatmap to `plot`, the groups `selection` would replace marked), with what the scorer
    needs (`selection.needs`): for an ablation scorer, each group's ablation cost, measured
    layer by layer into `checkpoint`, from which an interrupted analysis resumes, and which
    is removed once the scores are written."""
    scores = analyze_text(model, tokenizer, documents, analysis, seed=selection.seed, model_name=model_name,
                          data=data, ablation=selection.needs.measurement(ablation), checkpoint=checkpoint,
                          probes=selection.needs.probes)
    scores.save(out)
    for partial in ablation_checkpoints(checkpoint, selection.needs.probes):
        partial.unlink(missing_ok=True)
    if plot:
        plot_head_heatmap(scores, plot, selection.select(scores))
    return scores


def convert_heads(model, tokenizer, scores: HeadScores, selection: SelectionConfig, mixer: MixerConfig, init: str,
                  model_name: str, out: str | Path, command: str | None = None):
    """Replace the groups `selection` picks from `scores` by `mixer`s and save the converted
    model and `tokenizer` into `out` (marked as `command`'s output, if given). Returns (the
    converted model, a record: the groups replaced, their fraction and the parameter counts)."""
    scores.check_model(model, model_name)
    spec = selection.select(scores)
    converted = convert(model, spec, mixer, init=init, seed=selection.seed, source_model=portable_name(model_name))
    save_model(converted, tokenizer, out, command=command)
    return converted, {"groups": len(spec.groups), "fraction": spec.fraction, **parameter_report(model, converted)}


class Run:
    """One run in this process: its configuration and folder, the original model and its
    tokenizer (loaded once), the training text, and the converted model the last stage
    handed on (the next stage takes it from there instead of loading it again)."""

    def __init__(self, config: RunConfig, out: str | Path):
        self.config, self.layout = config, RunLayout(out)
        self.sizes, self.recipe = Sizes.of(config), config.recipe
        self._held: tuple[str, Any] | None = None

    @property
    def out(self) -> Path:
        return self.layout.root

    def _inputs(self) -> tuple[list[str | Path], int]:
        """What the run reads (which `--out` must not be) and the bytes it writes."""
        config = self.config
        return ([model_path(config.model), *config.data, *config.eval_data, *config.ood_data],
                RUN_MODEL_COPIES * model_bytes(config.model))

    def check_out(self, force: bool) -> None:
        """Refuse, before any work, a run folder `claim` would refuse (`RunLayout.check_out`)."""
        self.layout.check_out(self.config.to_dict(), force, *self._inputs())

    def claim(self, force: bool) -> Claim:
        """Hold the run folder for this configuration (`RunLayout.claim`): `with run.claim(force):`."""
        return self.layout.claim(self.config.to_dict(), force, *self._inputs())

    @cached_property
    def directory(self) -> Path:
        """The original model's folder (fetched once if it is a known name)."""
        return resolve_model(self.config.model)

    @cached_property
    def model_config(self):
        """The original model's config, read without its weights."""
        return AutoConfig.from_pretrained(self.directory)

    @property
    def device(self):
        """Where the stages run (`--device`)."""
        return resolve_device(self.config.device)

    @cached_property
    def original(self):
        """The original model, loaded once."""
        return load_model(self.config.model, device=self.device)[0]

    @cached_property
    def tokenizer(self):
        """The original model's tokenizer, loaded without the model."""
        return load_tokenizer(self.directory, self.model_config)

    @cached_property
    def train_documents(self) -> Corpus:
        return load_documents(self.config.data)

    @cached_property
    def _training_mix(self) -> tuple[Tensor, Tensor]:
        sequences = token_sequences(self.tokenizer, self.train_documents, self.recipe.sequence_length,
                                    seed=self.config.seed)
        return mix_retrieval(self.tokenizer, sequences, self.config.retrieval_share, self.config.seed)

    @property
    def train_sequences(self) -> Tensor:
        """`[N, seq_len]` training sequences of the recipe's length, shuffled with the run's seed;
        `retrieval_share` of them, chosen with the seed, carry facts and questions (`retrieval_mix`)."""
        return self._training_mix[0]

    @property
    def lm_weights(self) -> Tensor | None:
        """`[N, seq_len]` each position's weight in the `lm` stage's loss: `answer_weight` where
        the position predicts a value token of an answer (the next token is one), else 1; None
        at the default weight of 1 (the plain mean)."""
        if self.config.answer_weight == 1:
            return None
        answers = self._training_mix[1]
        weights = torch.ones(answers.shape)
        weights[:, :-1][answers[:, 1:]] = float(self.config.answer_weight)
        return weights

    def stage_data(self, stage: str) -> tuple[Tensor, Tensor | None]:
        """What training stage `stage` reads: the training sequences `[M, seq_len]` cut to its
        length (`Recipe.stage_rows`), and the `lm` stage's loss weights cut alike (None for the
        transfer stage and at the default weight)."""
        weights = self.lm_weights if stage == "lm" else None
        sequences = self.recipe.stage_rows(stage, self.train_sequences)
        return sequences, None if weights is None else self.recipe.stage_rows(stage, weights)

    def model(self, name: str):
        """The converted model `name` (converted, transfer or final): the one the last stage
        handed on if it is that one, else loaded from its folder (and held instead)."""
        if self._held is None or self._held[0] != name:
            self.let_go()
            self._held = (name, load_converted(self.layout.model(name), device=self.device)[0])
        return self._held[1]

    def hand_on(self, name: str, model) -> None:
        """Hold `model` as the converted model `name` for the next stage."""
        self._held = (name, model)

    def let_go(self) -> None:
        """Let go of the held model and return its memory to the OS."""
        self._held = None
        release_freed_memory()

    def train_config(self, stage: str, steps: int) -> TrainConfig:
        """The recipe's `stage` for `steps` optimizer steps, at the run's learning rate."""
        lr = dict(zip(("transfer", "lm"), self.config.learning_rates))[stage]
        return replace(self.recipe.stage(stage).train_config(stage, steps, self.config.seed, lr=lr),
                       device=self.config.device)

    def task_settings(self) -> RunSettings:
        return RunSettings(quick=self.config.quick, eval_data=list(self.config.eval_data), seed=self.config.seed,
                           ood_data=tuple(self.config.ood_data))


Stage = Callable[[Run], dict]


def run_tasks() -> list[Task]:
    """The evaluation tasks `run` uses, in report order."""
    return sorted((t for t in TASKS.values() if t.run_options is not None), key=lambda t: t.report_order)


def evaluation_tokens(settings: RunSettings) -> int:
    """The most tokens of one evaluation text that the run's tasks read at once (their
    longest `context`)."""
    return max(getattr(options, "context", 0) for task in run_tasks() for options in task.run_options(settings).values())


TRAINING = ("plan", "transfer", "lm")  # the stages that read the training sequences


def check_stages(run: Run, pending: set[str]) -> None:
    """Refuse what the stages in `pending` would refuse that the configuration, the model's
    config and the texts' lengths show, before the first stage starts (`run_pipeline` calls it
    before it claims the run folder): no weight is loaded and no input built, except, with a
    retrieval share and training to come, the training sequences (`Run.train_sequences`, made
    from the tokenizer alone and kept for the stages). The checks that read only configs come
    first, then those that count tokens (no more than each stage reads), each in stage order.
    The model's folder is checked before (`run_pipeline`: `checks.check_model_folder`)."""
    config, sizes, settings = run.model_config, run.sizes, run.task_settings()
    evaluations = [(task, options) for task in run_tasks() for options in task.run_options(settings).values()]
    measured = run.config.selection.needs.measurement(sizes.ablation)
    check_architecture(config)
    if pending & {"resolve", "convert"}:
        check_window_fits(config, run.config.mixer_config())
        check_replaces_some(run.config.beta, config.num_hidden_layers * config.num_key_value_heads)
    if pending & {"resolve", *TRAINING}:
        check_length(run.recipe.sequence_length, config)
    if "analyze" in pending:
        check_length(sizes.analysis.seq_len, config)
        if measured is not None:
            check_ablation(measured, config)
    if "evaluate" in pending:
        for task, options in evaluations:
            task.preflight(options, config, model=False)
    if "bench" in pending:
        check_contexts(sizes.bench, config)
    if pending & {"resolve", "evaluate"}:
        needed = evaluation_tokens(settings)
        for flag, paths in (("--eval-data", run.config.eval_data), ("--ood-data", run.config.ood_data)):
            tokens = count_tokens(run.tokenizer, load_documents(paths), limit=needed)
            if tokens < needed:
                raise DataError(f"{flag} has {tokens:,} tokens; the evaluation needs at least {needed:,}")
    if pending & {"resolve", *TRAINING}:
        if run.config.retrieval_share > 0:
            run.train_sequences  # made now: do the facts and questions fit?
        else:
            check_sequences(run.tokenizer, run.train_documents, run.recipe.sequence_length)
    if "analyze" in pending:
        check_sequences(run.tokenizer, run.train_documents, sizes.analysis.seq_len, sizes.analysis.sequences)
        if measured is not None:
            check_calibration_text(run.tokenizer, run.train_documents, measured)
    if "evaluate" in pending:
        for task, options in evaluations:
            task.preflight(options, config, lambda: run.tokenizer, model=False)


def resolve(run: Run) -> dict:
    """The model's folder and, with a retrieval share, the number of training sequences (made,
    with the checks of every stage, by `check_stages` before the run folder was claimed)."""
    if run.config.retrieval_share > 0:
        return {"directory": str(run.directory), "training_sequences": len(run.train_sequences)}
    return {"directory": str(run.directory)}


def analyze(run: Run) -> dict:
    layout = run.layout
    scores = analyze_heads(run.original, run.tokenizer, run.train_documents, run.sizes.analysis, run.config.selection,
                           run.sizes.ablation, run.config.model, list(run.config.data), layout.scores,
                           layout.ablation_checkpoint, plot=layout.heads_plot)
    values = sorted(v for row in scores.groups[scores.metric] for v in row)
    return {"groups": len(values), "metric": scores.metric, "min": values[0], "median": values[len(values) // 2],
            "max": values[-1], "tokens": scores.sequences * scores.seq_len}


def convert_stage(run: Run) -> dict:
    converted, record = convert_heads(run.original, run.tokenizer, HeadScores.load(run.layout.scores),
                                      run.config.selection, run.config.mixer_config(), "reuse", run.config.model,
                                      run.layout.model("converted"))
    run.hand_on("converted", converted)
    return record


def plan(run: Run) -> dict:
    """The step counts of the two training stages: `--steps` as given (nothing timed), else
    the recipe's measured steps or what a time budget buys here, from one timed step of each
    stage. Says in one line how many steps, where they come from, how long they should take
    here, and, where a budget buys fewer than the steps the recipe's documented numbers were
    measured with, that it does (`plan_line`)."""
    config = run.config
    if config.steps is not None:
        record = {"transfer_steps": config.steps[0], "lm_steps": config.steps[1]}
    elif run.sizes.fixed_steps is not None:
        return {"transfer_steps": run.sizes.fixed_steps, "lm_steps": run.sizes.fixed_steps}
    else:
        student, teacher = run.model("converted"), run.original
        timed = {}
        for stage in ("transfer", "lm"):
            probe = run.train_config(stage, 1)
            timed[stage] = seconds_per_step(student, lambda copy, probe=probe: objective_for(probe, copy, teacher),
                                            run.stage_data(stage)[0], probe)
        record = {"transfer_step_s": round(timed["transfer"], 3), "lm_step_s": round(timed["lm"], 3)}
        if config.training_budget is None:
            record.update(transfer_steps=config.training_steps[0], lm_steps=config.training_steps[1])
        else:
            record.update(budget_minutes=config.training_budget,
                          **budget_steps(config.training_budget, run.recipe.transfer_share, timed))
        record["expected_minutes"] = round(sum(record[f"{s}_steps"] * timed[s] for s in timed) / 60, 1)
    if run.recipe.measured_steps is not None:
        record["measured_steps"] = list(run.recipe.measured_steps)
    tqdm.write(f"recurformer: {plan_line(record)}", file=sys.stderr)
    return record


def budget_steps(minutes: float, transfer_share: float, step_seconds: dict[str, float]) -> dict[str, int]:
    """{stage}_steps that `minutes` of training buy (the transfer stage its share), at
    `step_seconds[stage]` each; a one-line error where a stage would get no whole step."""
    shares = {"transfer": transfer_share, "lm": 1 - transfer_share}
    steps = {stage: int(shares[stage] * minutes * 60 / step_seconds[stage]) for stage in shares}
    short = [stage for stage, n in steps.items() if n < 1]
    if short:
        need = max(step_seconds[s] / shares[s] for s in shares) / 60
        raise ConfigError(f"--budget-minutes {minutes:g} buys no whole step of the {short[0]} stage on this machine "
                          f"(one takes {step_seconds[short[0]]:.1f} s): give at least {need:.2f}, or --steps")
    return {f"{stage}_steps": n for stage, n in steps.items()}


def plan_line(record: dict) -> str:
    """`plan`'s one line: the steps, where they come from (`--steps`, the recipe's measured
    steps, or a budget: `record["budget_minutes"]`), the time they should take here, and
    whether they fall short of the recipe's measured steps."""
    steps = (record["transfer_steps"], record["lm_steps"])
    if "expected_minutes" not in record:
        return f"training {steps[0]} + {steps[1]} steps (--steps)"
    timing = (f"({record['transfer_step_s']:.1f} s and {record['lm_step_s']:.1f} s a step): about "
              f"{record['expected_minutes']:.0f} minutes")
    if "budget_minutes" not in record:
        return (f"training {steps[0]} + {steps[1]} steps, the recipe's measured steps, here {timing}; "
                "--budget-minutes bounds the time instead")
    line = f"training {steps[0]} + {steps[1]} steps, what the {record['budget_minutes']:g}-minute budget buys here {timing}"
    measured = record.get("measured_steps")
    if measured and (steps[0] < measured[0] or steps[1] < measured[1]):
        line += (f"; fewer than the {measured[0]} + {measured[1]} the documented numbers were measured with, so "
                 f"retrieval falls short of them (docs/where-it-wins.md); --steps {measured[0]},{measured[1]} "
                 "(the default) trains those")
    return line


def training_stage(stage: str, source: str, target: str) -> Stage:
    """The stage that trains the model `source` in place into `target` (resuming from the
    checkpoint an interrupted attempt left in `target`'s folder)."""

    def train(run: Run) -> dict:
        out = run.layout.model(target)
        config = run.train_config(stage, run.layout.record("plan")[f"{stage}_steps"])
        resume = has_checkpoint(out)
        if out.exists() and not resume:
            shutil.rmtree(out)  # an earlier attempt that wrote no checkpoint
        student = run.model(source)
        sequences, weights = run.stage_data(stage)
        summary = train_stage(student, run.tokenizer, run.original, sequences, config, out, resume=resume,
                              weights=weights)
        shutil.rmtree(out / CHECKPOINT, ignore_errors=True)
        run.hand_on(target, student)
        return {**{k: v for k, v in summary.items() if k != "config"}, "lr": config.lr}

    return train


MODEL_STAGES = ("convert", "transfer", "lm")  # the stages that make the models evaluate reads


def evaluations_done(run: Run, made_by: dict) -> dict[str, dict[str, Any]]:
    """The evaluations an interrupted evaluate stage finished (`{evaluation: {model: result}}`),
    if they were made with the models the stages' records `made_by` describe; else none."""
    path = run.layout.evaluation_checkpoint
    if not path.is_file():
        return {}
    saved = read_json_object(path, "partial evaluation")
    return saved.get("results", {}) if saved.get("made_by") == made_by else {}


def evaluated_model(run: Run, name: str):
    """The model `name` (one of `MODELS`, or `BASELINE`) as the evaluate stage measures it:
    the original, a converted model from its folder, or the training-free window on the final
    model's groups at its cache bytes (`equal_cache.window_baseline`)."""
    if name == "original":
        return run.original
    if name == BASELINE:
        return window_baseline(run.original, run.model("final"))[0]
    return run.model(name)


def evaluate(run: Run) -> dict:
    """Every evaluation of every task `run` uses, on each of the task's models; eval.json is
    `{evaluation: {model: result}}` (an evaluation is a task with options, `Task.run_options`).
    One converted model at a time, each loaded once: the final model is loaded last and
    held, for the window at equal cache bytes built from its groups and for `bench`. Each
    result is kept in eval-partial.json as it comes: an interrupted stage measures only the
    rest when it runs again."""
    settings, tasks = run.task_settings(), run_tasks()
    runs = {task.name: task.run_options(settings) for task in tasks}
    made_by = {stage: run.layout.record(stage) for stage in MODEL_STAGES}
    done = evaluations_done(run, made_by)
    results: dict[str, dict[str, Any]] = {key: dict(done.get(key, {})) for task in tasks for key in runs[task.name]}
    run.let_go()  # the models held since training: evaluated as saved, from their folders
    window = None
    for name in (*MODELS, BASELINE):
        work = [(task, key, options) for task in tasks for key, options in runs[task.name].items()
                if name in task.models_for(key) and name not in results[key]]
        if not work:
            continue
        model = evaluated_model(run, name)
        if name == BASELINE:
            window = MixerConfig.from_dict(model.config.mixer).window
        for task, key, options in work:
            results[key][name] = task.measure(model.eval(), run.tokenizer, options, original=run.original)
            require_finite(results[key][name], "evaluation")  # never a NaN written as a result
            write_json_atomic(run.layout.evaluation_checkpoint, {"made_by": made_by, "results": results})
        del model
        release_freed_memory()
    if window is None:  # the baseline was measured before an interruption
        window = equal_cache_window(run.original, run.model("final"))
    write_json_atomic(run.layout.evaluation, results)
    run.layout.evaluation_checkpoint.unlink(missing_ok=True)
    return {"evaluations": list(results), "baseline_window": window}


def bench(run: Run) -> dict:
    # named "final", not by its path: a run folder that is moved still finds its measurements
    result = against_original({"final": run.model("final")}, run.original, replace(run.sizes.bench, device=run.config.device),
                              progress=lambda m: print(f"bench: {m}", flush=True))
    write_json_atomic(run.layout.bench, result)
    plot_bench(result, run.layout.bench_plot)
    return {"contexts": result["contexts"]}


def report(run: Run) -> dict:
    layout = run.layout
    metrics, rows = metric_table()
    evaluation = json.loads(layout.evaluation.read_text())
    results = RunResults(config={**run.config.to_dict(), "schema": RUN_SCHEMA},
                         records={name: layout.record(name) for name, _, _ in STAGES[:-1]},
                         evaluation=evaluation, bench=json.loads(layout.bench.read_text()), final="final")
    values = {"schema": RUN_SCHEMA, **collect(results, metrics)}
    plot_loss_curves({stage: layout.model(folder) / "train_log.jsonl" for stage, folder in (("transfer", "transfer"),
                                                                                          ("lm", "final"))},
                     layout.loss_plot)
    write_json_atomic(layout.metrics, values)
    sections = [task.report_section(values, evaluation) for task in run_tasks() if task.report_section]
    write_text_atomic(layout.report, render_run_report(values, by_key(metrics), rows, run.config.to_dict(),
                                                       results.bench, sections))
    write_model_card(layout.model("final"), results=values)
    return {"metrics": len(values)}


def metric_table(tasks: list[Task] | None = None) -> tuple[list[Metric], list[Row]]:
    """Every metric of a run and the summary table's rows (`metrics.run_metric_table`): the
    evaluation tasks' (default: `run_tasks()`), the run's own, each stage's time and memory."""
    tasks = run_tasks() if tasks is None else tasks
    return run_metric_table([m for t in tasks for m in t.metrics], [row for t in tasks for row in t.rows],
                            [name for name, _, _ in STAGES if name != "report"])


# (name, function, expected seconds of a full run); the seconds weight the progress bar
STAGES: list[tuple[str, Stage, float]] = [
    ("resolve", resolve, 5.0),
    ("analyze", analyze, 60.0),
    ("convert", convert_stage, 15.0),
    ("plan", plan, 40.0),
    ("transfer", training_stage("transfer", "converted", "transfer"), 0.0),
    ("lm", training_stage("lm", "transfer", "final"), 0.0),
    ("evaluate", evaluate, 180.0),
    ("bench", bench, 240.0),
    ("report", report, 5.0),
]
