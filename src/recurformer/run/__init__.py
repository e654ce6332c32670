"""`recurformer run`: the whole method on one model, as resumable stages, ending in a report.

`config.py` holds what decides the results (`RunConfig`, stored in run.json) and the sizes
of the stages' work, `layout.py` the run folder, `stages.py` the stages and the `Run` they
share; `run_pipeline` (here) runs the stages that have not finished yet, in order.
Each stage writes its outputs atomically and then its marker `stages/<name>.json`; a
re-run skips every stage whose marker exists, and a training stage interrupted mid-way
resumes from its last checkpoint. Before the folder is claimed, everything the stages
still to run would refuse that the configuration, the model's config and the texts' lengths
show is checked (`check_stages`), and a folder made by another configuration is refused.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm.auto import tqdm
from transformers import AutoConfig

from ..checks import check_model_folder
from ..hub import resolve_model
from ..memory import PeakMemory
from .config import RunConfig, Sizes
from .layout import RUN_SCHEMA, RunLayout
from .stages import STAGES, Run, Stage, analyze_heads, check_stages, convert_heads, metric_table, run_tasks


# seconds a training step took in the example run (docs/results/example-run): the progress
# bar's guess for fixed steps, before `plan` has timed them
STEP_SECONDS = {"transfer": 10.0, "lm": 32.0}


def stage_weights(config: RunConfig) -> dict[str, float]:
    """Expected seconds of each stage: the training stages' from the budget they share as the
    recipe says, or from their fixed steps; a quick run weighs its sizes' work instead."""
    weights = {name: seconds / (5.0 if config.quick and seconds > 15 else 1.0) for name, _, seconds in STAGES}
    share = {"transfer": config.recipe.transfer_share, "lm": 1 - config.recipe.transfer_share}
    for stage in share:
        if config.quick:
            seconds = 0.0
        elif config.training_budget is not None:
            seconds = share[stage] * config.training_budget * 60
        else:
            seconds = config.training_steps[stage == "lm"] * STEP_SECONDS[stage]
        weights[stage] = max(10.0, seconds)
    return weights


def run_pipeline(config: RunConfig, out: str | Path, force: bool = False, progress: bool = True,
                 stages: list[tuple[str, Stage, float]] | None = None) -> dict:
    """Run (or continue) every stage of `config` in `out`; returns the metrics. The model is
    resolved (fetched once if it is a known name) first: the mixer's shape depends on it. Then
    `--out` and the stages still to run (all of them with `force`) are checked (`check_stages`),
    before the folder is claimed and the first of them starts."""
    directory = resolve_model(config.model)
    check_model_folder(directory)  # damaged files: one line, before anything is written
    config = config.for_model(AutoConfig.from_pretrained(directory))
    run = Run(config, out)
    plan = stages or STAGES
    run.check_out(force)
    check_stages(run, {name for name, _, _ in plan if force or run.layout.record(name) is None})
    weights = stage_weights(config)
    total = round(sum(weights.get(name, seconds) for name, _, seconds in plan))
    # the run folder is locked until the run ends; the bar is closed before an error is shown
    with run.claim(force), tqdm(total=total, desc="run", disable=not progress,
                                bar_format="{desc} |{bar}| {percentage:3.0f}% [{elapsed}<{remaining}]") as bar:
        for number, (name, stage, seconds) in enumerate(plan, start=1):
            bar.set_description(f"run: stage {number}/{len(plan)} {name}")
            if run.layout.record(name) is None:
                started = time.monotonic()
                # settled: what earlier stages freed is not counted in this stage's peak
                with PeakMemory(settle=True) as memory:
                    record = stage(run)
                run.layout.finish(name, {**record, "seconds": round(time.monotonic() - started, 2),
                                         "peak_rss_bytes": memory.peak})
            bar.update(round(weights.get(name, seconds)))
    return json.loads(run.layout.metrics.read_text())


__all__ = ["RUN_SCHEMA", "STAGES", "Run", "RunConfig", "RunLayout", "Sizes", "Stage", "analyze_heads",
           "check_stages", "convert_heads", "metric_table", "run_pipeline", "run_tasks", "stage_weights"]
