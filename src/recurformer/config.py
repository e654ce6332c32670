"""Configuration helpers and the replacement spec, validated up front.

Errors name the field and the bad value, so that a CLI can print them as one line. The
mixer's own configuration, `MixerConfig`, sits with the mixer kinds that define which of
its fields each kind reads (`mixers/config.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import RecurformerError

# The base models' `model_type`s RecurFormer converts: exactly Llama's attention (docs/method.md;
# adding one: docs/architecture.md, "Recipes"). Llama carries one `attention_bias` flag for
# q/k/v/o; Qwen2 has biases on q/k/v only; Mistral has none. Here, at the bottom layer, so
# that the hub's messages name them too.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


class ConfigError(RecurformerError, ValueError):
    """A configuration value is out of range or of the wrong kind."""


def require(ok: bool, message: str) -> None:
    """Raise `ConfigError(message)` unless `ok`: the one-line check every config uses."""
    if not ok:
        raise ConfigError(message)


def parse_choices(text: str, flag: str, choices) -> tuple[str, ...]:
    """'a,b' -> ('a', 'b') for `flag`, each one of `choices`; a one-line error naming the
    first unknown one (or the empty list)."""
    chosen = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [c for c in chosen if c not in choices]
    if unknown or not chosen:
        raise ConfigError(f"{flag}: unknown {unknown[0] if unknown else text!r}; choose from {', '.join(choices)}")
    return chosen


def option(default: Any = None, help: str = "", factory: Callable[[], Any] | None = None, **extra: Any) -> Any:
    """A dataclass field that is also a command-line flag: its default (or a `factory` that
    makes it), its `--help` text, and optional argparse details (`flag`, `metavar`, `parse`).
    The command line is generated from these fields, so each default is defined here once."""
    metadata = {"help": help, **extra}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def groups_to_replace(num_groups: int, beta: float) -> int:
    """[ours] Rounding: `floor(beta * N + 1/2)`, the nearest integer with halves up."""
    if not isinstance(beta, (int, float)) or math.isnan(beta) or not 0.0 <= beta <= 1.0:
        raise ConfigError(f"beta must be in [0, 1], got {beta!r}")
    return math.floor(beta * num_groups + 0.5)


def check_replaces_some(beta: float, num_groups: int) -> None:
    """Refuse a `beta` that replaces none of a model's `num_groups` KV groups."""
    require(groups_to_replace(num_groups, beta) >= 1,
            f"--beta {beta} replaces none of the model's {num_groups} KV groups (the smallest that replaces one "
            f"is {0.5 / num_groups:.4g})")


@dataclass
class ReplacementSpec:
    """Which KV groups of which layers are replaced by a mixer ([ours]: the unit is a KV group,
    one KV head and all query heads that read it, because only whole groups free cache).

    `groups` lists `(layer, kv_head)` pairs. `num_layers` and `num_kv_heads` record the shape
    of the model the spec was made for, so a spec cannot silently be applied to another one.
    `source` is free-form provenance (scorer, beta, model name) kept in the JSON.
    """

    num_layers: int
    num_kv_heads: int
    groups: list[tuple[int, int]]
    source: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        require(isinstance(self.num_layers, int) and self.num_layers >= 1, f"replacement spec: num_layers must be a positive integer, got {self.num_layers!r}")
        require(isinstance(self.num_kv_heads, int) and self.num_kv_heads >= 1, f"replacement spec: num_kv_heads must be a positive integer, got {self.num_kv_heads!r}")
        groups = []
        for item in self.groups:
            require(
                isinstance(item, (list, tuple)) and len(item) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in item),
                f"replacement spec: each group must be a [layer, kv_head] pair of integers, got {item!r}",
            )
            layer, head = item
            require(0 <= layer < self.num_layers, f"replacement spec: layer {layer} out of range [0, {self.num_layers})")
            require(0 <= head < self.num_kv_heads, f"replacement spec: kv_head {head} of layer {layer} out of range [0, {self.num_kv_heads})")
            groups.append((layer, head))
        duplicates = sorted({g for g in groups if groups.count(g) > 1})
        require(not duplicates, f"replacement spec: duplicate group(s) {duplicates}")
        self.groups = sorted(groups)

    @property
    def fraction(self) -> float:
        """Replaced groups over all groups."""
        return len(self.groups) / (self.num_layers * self.num_kv_heads)

    def replaced_heads(self, layer: int) -> list[int]:
        """KV heads of `layer` that are replaced, ascending."""
        return [h for l, h in self.groups if l == layer]

    def kept_heads(self, layer: int) -> list[int]:
        """KV heads of `layer` that stay softmax attention, ascending."""
        replaced = set(self.replaced_heads(layer))
        return [h for h in range(self.num_kv_heads) if h not in replaced]

    def to_dict(self) -> dict[str, Any]:
        data = {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "groups": [list(g) for g in self.groups]}
        if self.source is not None:
            data["source"] = self.source
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ReplacementSpec":
        require(isinstance(data, dict), f"replacement spec: expected a JSON object, got {type(data).__name__}")
        missing = [k for k in ("num_layers", "num_kv_heads", "groups") if k not in data]
        require(not missing, f"replacement spec: missing field(s) {', '.join(missing)}")
        unknown = sorted(set(data) - {"num_layers", "num_kv_heads", "groups", "source"})
        require(not unknown, f"replacement spec: unknown field(s) {', '.join(unknown)}")
        require(isinstance(data["groups"], list), f"replacement spec: groups must be a list, got {type(data['groups']).__name__}")
        return cls(data["num_layers"], data["num_kv_heads"], [tuple(g) if isinstance(g, list) else g for g in data["groups"]], data.get("source"))

    @classmethod
    def empty(cls, num_layers: int, num_kv_heads: int) -> "ReplacementSpec":
        return cls(num_layers, num_kv_heads, [])
