"""Run EleutherAI lm-evaluation-harness tasks on any model this package loads.

The model goes through lm-eval's own `HFLM` wrapper (a RecurFormer model is a regular
transformers causal LM), so scores are comparable with published lm-eval numbers. Tasks
come from lm-eval's registry (HellaSwag, ARC, PIQA, LAMBADA, ... where the Hugging Face
hub is reachable to fetch their datasets) or from YAML files in `include_path` (local
tasks, as our tests use). Needs the optional `lm-eval` package: `pip install recurformer[eval]`.
"""

from __future__ import annotations

from .config import ConfigError


def run_lm_eval(
    model, tokenizer, tasks: str, limit: int | None = None, batch_size: int = 4,
    num_fewshot: int | None = None, include_path: str | None = None,
) -> dict:
    """Evaluate on comma-separated lm-eval `tasks`; returns flat `{"<task>/<metric>": value}`."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ConfigError("lm-eval tasks need the 'lm-eval' package: pip install 'recurformer[eval]'") from None
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
