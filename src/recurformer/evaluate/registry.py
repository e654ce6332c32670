"""The registry of evaluation tasks.

A `Task` bundles what `recurformer eval --task NAME` and the `evaluate` stage of
`recurformer run` need to know about one evaluation: its options (a dataclass whose fields
are the command's flags, with their defaults, checks and help), the function that
evaluates a model, and, if `run` uses it, the options it runs with and the metrics and
summary rows it adds to the run's report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from ..config import ConfigError
from ..metrics import Metric, Row


@dataclass(frozen=True)
class RunSettings:
    """What a task's options in `recurformer run` may depend on."""

    quick: bool  # tiny sizes: a smoke test
    eval_data: list[str]  # held-out text files
    seed: int
    ood_data: tuple[str, ...] = ()  # out-of-domain text files (evaluation only)


@dataclass(frozen=True)
class Task:
    """One evaluation. `evaluate(model, tokenizer, options)` returns a flat dict of results
    (`evaluate(model, tokenizer, options, original)` for a task that compares a converted
    model with its original, `needs_original`; call it through `measure`).

    `argument` names an options field that may be given after a colon in the task name
    (`lm-eval:hellaswag` sets `tasks`). `run_options(settings)` gives the evaluations `run`
    makes with the task, as `{key: options}` (the key names the result in eval.json, e.g.
    `ppl` on held-out and `ppl-ood` on out-of-domain text; None: `run` does not use the
    task), each on every model of `run_models` (or, if it is a mapping, on the models it
    gives for that key); `metrics` and `rows` are what the task adds to the run's metrics
    and summary table, where tasks come in `report_order`; `report_section(metrics,
    evaluation)`, if given, returns the title and Markdown lines of the task's own section
    of the run's report (`metrics`: metrics.json's values; `evaluation`: eval.json).

    `check(options, config, tokenizer)` refuses, before any model is loaded or any input
    built, what the options cannot do on a model whose text config is `config` (positions
    beyond the model's, problems that cannot fit the context) and, when `tokenizer` is given
    (a function returning the model's tokenizer, called only by a check that needs it), text
    too short for the options, counting no more tokens than they need; `evaluate` makes the
    same checks (without `tokenizer`: the text is checked as it is read). `check_model(options,
    config)` refuses a model the task cannot evaluate at all (`config`: the model's own, e.g.
    one that is not converted); `recurformer eval` makes both checks, `run` (whose models are
    its own) the first.
    """

    name: str
    summary: str
    options: type
    evaluate: Callable[[Any, Any, Any], dict]
    argument: str | None = None
    run_options: Callable[[RunSettings], dict[str, Any]] | None = None
    run_models: tuple[str, ...] | dict[str, tuple[str, ...]] = ("original", "final")
    metrics: tuple[Metric, ...] = ()
    rows: tuple[Row, ...] = ()
    report_order: int = 100
    needs_original: bool = False
    report_section: Callable[[dict, dict], tuple[str, list[str]]] | None = None
    check: Callable[[Any, Any, Callable[[], Any] | None], None] | None = None
    check_model: Callable[[Any, Any], None] | None = None

    def measure(self, model, tokenizer, options, original=None) -> dict:
        """The task's results on `model`; `original`: the model it was converted from, for
        the tasks that need it (when None, such a task loads it by the name `model` records)."""
        if self.needs_original:
            return self.evaluate(model, tokenizer, options, original)
        return self.evaluate(model, tokenizer, options)

    def preflight(self, options, config, tokenizer: Callable[[], Any] | None = None, model: bool = True) -> None:
        """The task's checks before any work (`check`, and with `model`, `check_model`) for
        a model of `config` (its whole config: a converted model's `RecurFormerConfig`)."""
        if model and self.check_model is not None:
            self.check_model(options, config)
        if self.check is not None:
            self.check(options, config.get_text_config(), tokenizer)

    def option_names(self) -> list[str]:
        return [f.name for f in fields(self.options)]

    def models_for(self, key: str) -> tuple[str, ...]:
        """The models `run` evaluates with the task's evaluation `key`."""
        return self.run_models[key] if isinstance(self.run_models, dict) else self.run_models


TASKS: dict[str, Task] = {}


def register(task: Task) -> Task:
    if task.name in TASKS:
        raise ValueError(f"evaluation task {task.name!r} is registered twice")
    TASKS[task.name] = task
    return task


def lookup_task(spec: str) -> tuple[Task, dict[str, str]]:
    """The task named by `spec` (`name` or `name:argument`) and the option the argument sets."""
    name, _, argument = spec.partition(":")
    task = TASKS.get(name)
    if task is None or bool(argument) != (task.argument is not None):
        known = ", ".join(t.name + (":<" + t.argument + ">" if t.argument else "") for t in TASKS.values())
        raise ConfigError(f"--task: unknown {spec!r}; choose one of {known}")
    return task, ({task.argument: argument} if argument else {})


def make_options(task: Task, given: dict[str, Any]):
    """The task's options from the values `given` (None: not given, the default applies);
    a value for an option the task does not have is an error naming both."""
    given = {k: v for k, v in given.items() if v is not None}
    foreign = sorted(set(given) - set(task.option_names()))
    if foreign:
        raise ConfigError(f"--{foreign[0].replace('_', '-')} does not apply to --task {task.name}")
    return task.options(**given)
