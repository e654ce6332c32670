"""The run folder: where each stage's outputs and marker live, and which configuration owns it.

    run.json              the configuration (`RunConfig`) and the schema it was made with
    scores.json           head scores (analyze); ablation-partial.json while they are measured
    heads.png             the scores as a heatmap, the replaced groups marked
    converted/ transfer/ final/    the converted model after each stage (with training logs)
    eval.json  bench.json  bench.png  loss.png
    metrics.json  report.md
    stages/<stage>.json   each finished stage's record; a re-run skips a stage that has one
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..config import ConfigError, require
from ..files import write_json_atomic
from ..metrics import MODELS

RUN_SCHEMA = "recurformer-run/2"


class RunLayout:
    """The paths inside the run folder `root`."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.settings = self.root / "run.json"
        self.scores = self.root / "scores.json"
        self.ablation_checkpoint = self.root / "ablation-partial.json"  # removed once scores.json is written
        self.heads_plot = self.root / "heads.png"
        self.evaluation = self.root / "eval.json"
        self.bench = self.root / "bench.json"
        self.bench_plot = self.root / "bench.png"
        self.loss_plot = self.root / "loss.png"
        self.metrics = self.root / "metrics.json"
        self.report = self.root / "report.md"

    def model(self, name: str) -> Path:
        """The folder of the converted model after a stage: converted, transfer or final."""
        require(name in MODELS[1:], f"no model directory called {name!r}")
        return self.root / name

    def marker(self, stage: str) -> Path:
        return self.root / "stages" / f"{stage}.json"

    def record(self, stage: str) -> dict | None:
        """The record of `stage` if it finished, else None."""
        marker = self.marker(stage)
        return json.loads(marker.read_text()) if marker.is_file() else None

    def finish(self, stage: str, record: dict) -> None:
        write_json_atomic(self.marker(stage), record)

    def claim(self, config: dict, force: bool) -> None:
        """Make the folder this configuration's (`config`: `RunConfig.to_dict()`), or check that
        it already is; `force` starts over in a folder of another configuration."""
        out = self.root
        if out.exists() and any(out.iterdir()):
            if force:
                shutil.rmtree(out)
            elif not self.settings.is_file():
                raise ConfigError(f"output directory {out} exists and is not a run directory (use --force to replace it)")
            else:
                saved = json.loads(self.settings.read_text())
                if saved.get("schema") != RUN_SCHEMA:
                    raise ConfigError(f"run directory {out} was made by an older recurformer ({saved.get('schema')}); "
                                      "start it over with --force, or use another --out")
                changed = [k for k in config if saved["config"].get(k) != config[k]]
                if changed:
                    key = changed[0]
                    raise ConfigError(
                        f"output directory {out} belongs to a different configuration "
                        f"({key}: {saved['config'].get(key)!r} there, {config[key]!r} here); use another --out or --force"
                    )
                return
        write_json_atomic(self.settings, {"schema": RUN_SCHEMA, "config": config})
