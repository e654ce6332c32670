"""`--task lm-eval:<tasks>`: EleutherAI lm-evaluation-harness tasks on any model this
package loads.

The model goes through lm-eval's own `HFLM` wrapper (a RecurFormer model is a regular
transformers causal LM), so scores are comparable with published lm-eval numbers. Tasks
come from lm-eval's registry (HellaSwag, ARC, PIQA, LAMBADA, ... where the Hugging Face
hub is reachable to fetch their datasets) or from YAML files in `lm_eval_include` (local tasks, as
our tests use). Needs the optional `lm-eval` package: `pip install recurformer[eval]`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from ..config import ConfigError, option, require
from .registry import Task, register


MISSING = "lm-eval tasks need the 'lm-eval' package: pip install 'recurformer[eval]'"


def run_lm_eval(
    model, tokenizer, tasks: str, limit: int | None = None, batch_size: int = 4,
    num_fewshot: int | None = None, include_path: str | None = None,
) -> dict:
    """Evaluate on comma-separated lm-eval `tasks`; returns flat `{"<task>/<metric>": value}`."""
    try:  # optional dependency: imported only when an lm-eval task is asked for
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ConfigError(MISSING) from None
    names = [t for t in tasks.split(",") if t]
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in names if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"unknown lm-eval task(s): {', '.join(unknown)}")
    wrapped = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, backend="causal")
    results = lm_eval.simple_evaluate(
        model=wrapped, tasks=names, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
        log_samples=False, bootstrap_iters=0,
    )
    flat = {"task": f"lm-eval:{tasks}", "limit": limit}
    for task, metrics in results["results"].items():
        for metric, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                flat[f"{task}/{metric}"] = value
    return flat


@dataclass(frozen=True)
class LMEvalOptions:
    tasks: str = option("", "comma-separated lm-eval task names (given as --task lm-eval:<tasks>)")
    problems: int | None = option(None, "examples per task (lm-eval's limit); not given: all")
    fewshot: int | None = option(None, "few-shot examples; not given: each task's own")
    lm_eval_include: str | None = option(None, "directory of extra lm-eval task YAML files", metavar="DIR")
    batch_size: int = option(4, "examples per forward pass")

    def __post_init__(self) -> None:
        require(bool(self.tasks), "--task lm-eval:<tasks> needs at least one task name")
        require(self.problems is None or self.problems >= 1, f"--problems must be >= 1, got {self.problems}")


def check(options: LMEvalOptions, config, tokenizer=None) -> None:
    """Before any work: the optional package is installed (found, not imported)."""
    require(importlib.util.find_spec("lm_eval") is not None, MISSING)


def evaluate(model, tokenizer, options: LMEvalOptions) -> dict:
    return run_lm_eval(model, tokenizer, options.tasks, limit=options.problems, batch_size=options.batch_size,
                       num_fewshot=options.fewshot, include_path=options.lm_eval_include)


register(Task(name="lm-eval", summary="lm-evaluation-harness tasks (needs recurformer[eval])",
              options=LMEvalOptions, evaluate=evaluate, argument="tasks", check=check))
