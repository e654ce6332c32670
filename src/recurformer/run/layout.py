"""The run folder: where each stage's outputs and marker live, and which configuration owns it.

    run.json              the configuration (`RunConfig`) and the schema it was made with
    scores.json           head scores (analyze); ablation-partial.json while they are measured
    heads.png             the scores as a heatmap, the replaced groups marked
    converted/ transfer/ final/    the converted model after each stage (with training logs)
    eval.json             every evaluation's results; eval-partial.json while they are measured
    bench.json  bench.png  loss.png
    metrics.json  report.md
    stages/<stage>.json   each finished stage's record; a re-run skips a stage that has one
"""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from pathlib import Path

from ..checks import read_json_object
from ..config import ConfigError, require
from ..errors import RecurformerError
from ..files import write_json_atomic
from ..metrics import MODELS
from ..outputs import Claim, check_claim, check_output, claim_folder, size_of
from .config import RunConfig

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
        self.evaluation_checkpoint = self.root / "eval-partial.json"  # removed once eval.json is written
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

    def check_out(self, config: dict, force: bool, inputs: list[str | Path], need_bytes: int) -> None:
        """Refuse, without writing anything, what `claim` would refuse: an `--out` that is one
        of the `inputs` or inside one, cannot be written or has no room for `need_bytes` more
        (`outputs.check_output`), a folder that is not a run's (`outputs.check_claim`), or,
        without `force`, a run of another configuration."""
        check_output(self.root, inputs, need_bytes - (0 if force else size_of(self.root)), replaced=force)
        check_claim(self.root, "run", keep=True, replace=force, ours=_run_settings(self.settings) is not None)
        if not force and self.settings.is_file():
            self._check_settings(config)

    def claim(self, config: dict, force: bool, inputs: list[str | Path], need_bytes: int) -> Claim:
        """Check `--out` before any work (not one of the `inputs` nor inside one, writable,
        room for `need_bytes` more), then hold the folder (`outputs.claim_folder`: locked while
        this process writes it, stale staging swept, `--force` empties only a run folder) and
        make it this configuration's (`config`: `RunConfig.to_dict()`), or check that it is.
        Use as `with layout.claim(...):`; the lock goes when the block ends."""
        check_output(self.root, inputs, need_bytes - (0 if force else size_of(self.root)), replaced=force)
        claim = claim_folder(self.root, "run", keep=True, replace=force, ours=_run_settings(self.settings) is not None)
        claim.written.add(self.settings.name)
        try:
            self._check_or_write_settings(config)
        except BaseException:
            claim.release(failed=True)
            raise
        return claim

    def _check_or_write_settings(self, config: dict) -> None:
        """Write run.json, or check that the one there is of this schema and configuration; a
        field it lacks (added to `RunConfig` since it was written) counts as its default."""
        if not self.settings.is_file():
            write_json_atomic(self.settings, {"schema": RUN_SCHEMA, "config": config})
            return
        self._check_settings(config)

    def _check_settings(self, config: dict) -> None:
        """Refuse run.json of another schema or configuration than `config`."""
        out = self.root
        saved = read_json_object(self.settings, "run settings")
        if saved.get("schema") != RUN_SCHEMA:
            raise ConfigError(f"run directory {out} was made by an older recurformer ({saved.get('schema')}); "
                              "start it over with --force, or use another --out")
        if not isinstance(saved.get("config"), dict):
            raise ConfigError(f"run settings {self.settings}: has no config; start the run over with --force")
        there = {**_defaults(), **saved["config"]}
        changed = [k for k in config if there.get(k) != config[k]]
        if changed:
            key = changed[0]
            raise ConfigError(
                f"output directory {out} belongs to a different configuration "
                f"({key}: {there.get(key)!r} there, {config[key]!r} here); use another --out or --force"
            )


# What a run did before `RunConfig` had the field, where that is not the field's default now.
_BEFORE_THE_FIELD = {"retrieval_share": 0.0}  # no retrieval sequences


def _defaults() -> dict:
    """What a run.json without a field meant. [ours] A field added to `RunConfig` takes as its
    default what runs did before it, so a run.json without it stays valid for that run
    (`retrieval_share`, whose default is now the recipe's: 0.0, no retrieval sequences)."""
    plain = {f.name: f.default for f in fields(RunConfig) if f.default is not MISSING}
    return {**plain, **_BEFORE_THE_FIELD}


def _run_settings(path: Path) -> dict | None:
    """run.json of a run folder made before output folders carried a marker, or None."""
    try:
        saved = read_json_object(path) if path.is_file() else None
    except RecurformerError:
        return None
    return saved if saved and str(saved.get("schema", "")).startswith("recurformer-run/") else None
