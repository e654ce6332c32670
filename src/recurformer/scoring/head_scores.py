"""`HeadScores`: the per-head statistics of one model, and their file (`scores.json`), read
back checked whole."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checks import DamagedFileError, read_json
from ..config import ConfigError
from ..files import write_json_atomic
from ..surgery import model_fingerprint


@dataclass
class HeadScores:
    """Per-head statistics of one model on one text sample.

    `heads[name]` and `groups[name]` are `[layers, heads]` and `[layers, kv_heads]` lists
    for `name` in `rr_<w>`, `rr_<w>_no_sink` (each window w) and `sink`. `groups` may hold
    group-only statistics too: `ablation`, the NLL cost of windowing the group alone
    (`ablation.py`), measured with the settings in `ablation`.
    """

    model: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    window: int
    windows: list[int]
    sequences: int
    seq_len: int
    heads: dict[str, list[list[float]]]
    groups: dict[str, list[list[float]]] = field(default_factory=dict)
    data: list[str] = field(default_factory=list)
    fingerprint: str = ""  # identifies the scored model's weights (surgery.model_fingerprint)
    ablation: dict[str, Any] = field(default_factory=dict)  # settings and base NLL of the `ablation` costs

    def __post_init__(self) -> None:
        size = self.num_heads // self.num_kv_heads
        for name, values in self.heads.items():
            if name not in self.groups:
                self.groups[name] = [[sum(row[g * size:(g + 1) * size]) / size for g in range(self.num_kv_heads)]
                                     for row in values]

    @property
    def metric(self) -> str:
        """The statistic that ranks groups: `rr_<window>`."""
        return f"rr_{self.window}"

    def group_values(self, name: str | None = None) -> dict[tuple[int, int], float]:
        values = self.groups[name or self.metric]
        return {(l, g): values[l][g] for l in range(self.num_layers) for g in range(self.num_kv_heads)}

    def to_json(self) -> dict[str, Any]:
        """Flat records, one per head and one per KV group (documented in docs/analysis.md)."""
        stats, group_stats = sorted(self.heads), sorted(self.groups)
        size = self.num_heads // self.num_kv_heads
        return {
            "format": "recurformer-head-scores/1",
            "model": self.model,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "window": self.window,
            "windows": self.windows,
            "sequences": self.sequences,
            "seq_len": self.seq_len,
            "data": self.data,
            "fingerprint": self.fingerprint,
            **({"ablation": self.ablation} if self.ablation else {}),
            "heads": [
                {"layer": l, "head": h, "kv_head": h // size, **{s: self.heads[s][l][h] for s in stats}}
                for l in range(self.num_layers) for h in range(self.num_heads)
            ],
            "groups": [
                {"layer": l, "kv_head": g, **{s: self.groups[s][l][g] for s in group_stats}}
                for l in range(self.num_layers) for g in range(self.num_kv_heads)
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "scores") -> "HeadScores":
        """The scores of a `to_json` record, checked whole: every head and every group of the
        model exactly once, in range, each statistic a finite number, and the statistic of
        its window present (`source` names the file in errors)."""
        if not isinstance(data, dict) or data.get("format") != "recurformer-head-scores/1":
            raise ConfigError(f"{source}: not a recurformer scores file (missing format 'recurformer-head-scores/1')")
        try:
            layers, heads, kv_heads, window = (data[k] for k in ("num_layers", "num_heads", "num_kv_heads", "window"))
            if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (layers, heads, kv_heads, window)):
                raise ValueError("num_layers, num_heads, num_kv_heads and window must be positive integers")
            if heads % kv_heads:
                raise ValueError(f"num_heads {heads} is not a multiple of num_kv_heads {kv_heads}")
            stats = [k for k in data["heads"][0] if k not in ("layer", "head", "kv_head")]
            table = _statistics(data["heads"], stats, ("layer", layers), ("head", heads))
            records = data.get("groups", [])
            only = [k for k in (records[0] if records else {}) if k not in ("layer", "kv_head") and k not in stats]
            groups = _statistics(records, only, ("layer", layers), ("kv_head", kv_heads)) if only else {}
            metric = f"rr_{window}"
            if metric not in stats:
                raise ValueError(f"its heads have no {metric}, the statistic of its window {window} (they have "
                                 f"{', '.join(stats) or 'none'})")
            return cls(
                model=data["model"], num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                window=window, windows=list(data["windows"]), sequences=data["sequences"],
                seq_len=data["seq_len"], heads=table, data=list(data.get("data", [])),
                fingerprint=data.get("fingerprint", ""), groups=groups, ablation=dict(data.get("ablation", {})),
            )
        except (KeyError, IndexError, TypeError, ValueError) as error:
            reason = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
            raise ConfigError(f"{source} is malformed ({reason})") from None

    def check_shape(self, config, name: str = "this model") -> None:
        """Refuse to apply these scores to a model of another shape (`config`: its config)."""
        shape = (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads)
        if shape != (self.num_layers, self.num_heads, self.num_kv_heads):
            raise ConfigError(
                f"scores are for a model with layers x heads x kv_heads = {self.num_layers} x {self.num_heads} x "
                f"{self.num_kv_heads}, {name} has {shape[0]} x {shape[1]} x {shape[2]}"
            )

    def check_model(self, model, name: str = "this model") -> None:
        """Refuse to apply these scores to a model of another shape or with other weights."""
        self.check_shape(model.config, name)
        fingerprint = model_fingerprint(model)
        if self.fingerprint and self.fingerprint != fingerprint:
            raise ConfigError(f"scores were computed on another model ({self.model}, fingerprint {self.fingerprint}), "
                              f"not on {name} (fingerprint {fingerprint})")

    def save(self, path: str | Path) -> None:
        write_json_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "HeadScores":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"scores file not found: {path}")
        try:
            data = read_json(path, "scores file")
        except DamagedFileError as error:
            raise ConfigError(str(error)) from None
        return cls.from_json(data, f"scores file {path}")


def _statistics(records: list[dict], names: list[str], rows: tuple[str, int], columns: tuple[str, int]
                ) -> dict[str, list[list[float]]]:
    """`{name: [rows][columns]}` from flat records keyed by the `rows` and `columns` fields
    (field, count): each cell exactly once, in range, each value a finite number."""
    (row_key, row_count), (column_key, column_count) = rows, columns
    if len(records) != row_count * column_count:
        raise ValueError(f"it has {len(records)} records of {row_key}s x {column_key}s, the model has "
                         f"{row_count} x {column_count} = {row_count * column_count}")
    table = {name: [[math.nan] * column_count for _ in range(row_count)] for name in names}
    seen = set()
    for record in records:
        row, column = record[row_key], record[column_key]
        if not (isinstance(row, int) and 0 <= row < row_count and isinstance(column, int) and 0 <= column < column_count):
            raise ValueError(f"{row_key} {row}, {column_key} {column} is out of range ({row_count} x {column_count})")
        if (row, column) in seen:
            raise ValueError(f"{row_key} {row}, {column_key} {column} appears twice")
        seen.add((row, column))
        for name in names:
            value = record[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} of {row_key} {row}, {column_key} {column} is {value!r}, not a finite number")
            table[name][row][column] = float(value)
    return table
