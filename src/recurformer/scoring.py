"""Head statistics on real text, and the choice of which KV groups to replace.

**[paper]** A head is recency aware when its attention mass sits on the last few tokens:

    RR_h(w) = mean over queries i of  sum_{j : i-w < j <= i} A_h[i, j]

**[ours]** Besides RR at the chosen window `w` (default 16) we report w = 4 and 64, the
sink mass (attention on the first token, mean over queries) and the sink-excluded
recency ratio (the same sum without token 0, renormalized by the mass off the sink `1 - A[i, 0]`, over queries
i >= 1): a head that parks its mass on the first token is not local, and a high sink mass
would otherwise hide that. All queries count, including the first `w` (for which the
window covers the whole prefix), exactly as in the formula above.

Statistics are accumulated while the model runs, one layer's attention at a time: an
attention function (`attention_hook`) computes the softmax probabilities of the layer, adds
their band sums to running totals, and returns the same output eager attention would.
KV-group scores are the mean over the group's query heads.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers.models.llama.modeling_llama import repeat_kv

from .ablation import Ablation, AblationConfig, calibration_sequences, measure_ablation
from .attention_hook import attention_hook
from .checks import DamagedFileError, read_json
from .config import ConfigError, ReplacementSpec, groups_to_replace, option, require
from .data import check_length, token_sequences
from .files import write_json_atomic
from .retrieval_probe import probe_sequences
from .surgery import model_fingerprint

DEFAULT_WINDOWS = (4, 16, 64)


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

    def check_model(self, model, name: str = "this model") -> None:
        """Refuse to apply these scores to a model of another shape or with other weights."""
        config = model.config
        shape = (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads)
        if shape != (self.num_layers, self.num_heads, self.num_kv_heads):
            raise ConfigError(
                f"scores are for a model with layers x heads x kv_heads = {self.num_layers} x {self.num_heads} x "
                f"{self.num_kv_heads}, {name} has {shape[0]} x {shape[1]} x {shape[2]}"
            )
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


def uniform_recency_ratio(length: int, window: int) -> float:
    """RR(w) of a head attending uniformly to its causal prefix over `length` tokens: the
    floor a recency-aware head must beat (query i puts min(i, w) / i of its mass in the window)."""
    return statistics.fmean(min(i, window) / i for i in range(1, length + 1))


class RecencyStatistics:
    """Running sums of the statistics, per layer and query head.

    `add(layer, probs)` takes one layer's attention probabilities `[B, H, T, T]` (causal,
    rows summing to 1) and adds each sequence's per-head means.
    """

    def __init__(self, num_layers: int, num_heads: int, windows: tuple[int, ...]):
        self.windows = tuple(sorted(set(windows)))
        self.sums = {name: torch.zeros(num_layers, num_heads, dtype=torch.float64) for name in self.names()}
        self.sequences = [0] * num_layers

    def names(self) -> list[str]:
        return ["sink"] + [f"rr_{w}" for w in self.windows] + [f"rr_{w}_no_sink" for w in self.windows]

    @torch.no_grad()
    def add(self, layer: int, probs: Tensor) -> None:
        batch, _, length, _ = probs.shape
        probs = probs.float()
        sink = probs[..., :, 0]  # [B, H, T]
        # The mass off the sink, summed directly: 1 - A[i, 0] cancels badly when A[i, 0] ~ 1.
        rest = probs[..., 1:, 1:].sum(-1).clamp_min(torch.finfo(probs.dtype).tiny)  # [B, H, T-1]
        first = torch.arange(length, device=probs.device)
        # band[..., i] = sum over 0 < j <= i, j > i - d of A[i, j], grown one diagonal at a time.
        # The sink (column 0) is kept out and added back where the window covers it: summing
        # it in and subtracting it later would cancel catastrophically when A[i, 0] ~ 1.
        band = torch.zeros_like(sink)
        for d in range(max(self.windows)):
            if d + 1 < length:
                band[..., d + 1:] += torch.diagonal(probs, offset=-d, dim1=-2, dim2=-1)[..., 1:]
            if d + 1 in self.windows:
                w = d + 1
                with_sink = band + sink * (first < w)
                self.sums[f"rr_{w}"][layer] += with_sink.mean(-1).sum(0).double()
                if length > 1:
                    self.sums[f"rr_{w}_no_sink"][layer] += (band[..., 1:] / rest).mean(-1).sum(0).double()
        self.sums["sink"][layer] += sink.mean(-1).sum(0).double()
        self.sequences[layer] += batch

    def means(self) -> dict[str, list[list[float]]]:
        counts = torch.tensor(self.sequences, dtype=torch.float64).clamp_min(1)[:, None]
        return {name: (total / counts).tolist() for name, total in self.sums.items()}


def stats_attention(stats: RecencyStatistics, module, query, key, value, attention_mask, scaling, dropout=0.0,
                    **kwargs):
    """Eager causal attention that also feeds `stats` (bound with `functools.partial`).

    query `[B, H, T, D]`, key/value `[B, Hkv, T, D]` -> output `[B, T, H, D]`, None.
    Sequences are packed text without padding, so the mask is plain causal.
    """
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)).float() * scaling
    length = scores.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=scores.device).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    stats.add(module.layer_idx, probs)
    output = torch.matmul(probs.to(value.dtype), value)
    return output.transpose(1, 2).contiguous(), None



@torch.no_grad()
def analyze(
    model,
    sequences: Tensor,
    window: int = 16,
    windows: tuple[int, ...] = DEFAULT_WINDOWS,
    batch_size: int = 1,
    model_name: str = "",
    data: list[str] | None = None,
    progress: bool = True,
) -> HeadScores:
    """Run `model` over `sequences` `[N, T]` and return its per-head statistics."""
    if window < 1:
        raise ConfigError(f"window must be >= 1, got {window}")
    config = model.config
    stats = RecencyStatistics(config.num_hidden_layers, config.num_attention_heads, tuple(windows) + (window,))
    model.eval()
    with attention_hook(model, partial(stats_attention, stats)):
        for start in tqdm(range(0, len(sequences), batch_size), desc="analyze", unit="batch", disable=not progress):
            model(sequences[start:start + batch_size], use_cache=False)
    return HeadScores(
        model=model_name, num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, window=window, windows=sorted(set(windows) | {window}),
        sequences=len(sequences), seq_len=sequences.shape[1], heads=stats.means(), data=list(data or []),
    )


@dataclass(frozen=True)
class AnalysisConfig:
    """How much text `analyze` reads, and the window of the recency ratio that ranks groups."""

    window: int = option(16, "recency window w (tokens) of the ratio that ranks the groups")
    sequences: int = option(32, "number of sequences to score")
    seq_len: int = option(1024, "tokens per sequence")
    batch_size: int = option(1, "sequences per forward pass")

    def __post_init__(self) -> None:
        for name in ("window", "sequences", "seq_len", "batch_size"):
            value = getattr(self, name)
            require(value >= 1, f"--{name.replace('_', '-')} must be >= 1, got {value}")


def analyze_text(model, tokenizer, documents: list[str], config: AnalysisConfig, seed: int = 0, model_name: str = "",
                 data: list[str] | None = None, ablation: AblationConfig | None = None,
                 checkpoint: str | Path | None = None, retrieval: bool = False) -> HeadScores:
    """Score every head of `model` on `config.sequences` x `config.seq_len` tokens of
    `documents`, drawn with `seed`; the scores record the model's fingerprint. With
    `ablation`, also each group's `ablation` cost (resumable through `checkpoint`), or with
    `retrieval` its `ablation_retrieval` cost: the same windowing measured on the answers of
    the retrieval probe built in the calibration text (`retrieval_probe.py`)."""
    check_length(config.seq_len, model.config)
    tokens = token_sequences(tokenizer, documents, config.seq_len, config.sequences, seed)
    calibration = None if ablation is None else calibration_sequences(tokenizer, documents, ablation, model.config, seed)
    scores = analyze(model, tokens, window=config.window, windows=DEFAULT_WINDOWS, batch_size=config.batch_size,
                     model_name=model_name, data=data)
    scores.fingerprint = model_fingerprint(model)
    if ablation is not None:
        counted = None
        if retrieval:
            vocabulary = " ".join(tokenizer.batch_decode(calibration))
            calibration, counted = probe_sequences(tokenizer, calibration, vocabulary, seed)
        result = measure_ablation(model, calibration, ablation, checkpoint=checkpoint, counted=counted)
        record_ablation(scores, result, ablation, "retrieval" if retrieval else "text")
    return scores


def record_ablation(scores: HeadScores, result: Ablation, config: AblationConfig, probe: str = "text") -> None:
    """Put `result` into `scores`: the group statistics `ablation` (round 0's single costs;
    `ablation_retrieval` when measured on the retrieval `probe`) and, after more than one
    round, `ablation_order` and `ablation_marginal`; the settings, the probe, the base NLL of
    each round and the seconds under `scores.ablation`."""
    scores.groups["ablation" if probe == "text" else "ablation_retrieval"] = result.costs
    if config.ablation_rounds > 1:
        scores.groups["ablation_order"] = [[float(o) for o in row] for row in result.order]
        scores.groups["ablation_marginal"] = result.marginal
    scores.ablation = {**asdict(config), "probe": probe, "base_nll": result.base[0], "seconds": sum(result.seconds),
                       **({"round_base_nll": result.base, "round_seconds": result.seconds}
                          if config.ablation_rounds > 1 else {})}


class Scorer:
    """Ranks KV groups: the higher a group's score, the earlier it is replaced."""

    name = ""

    def score(self, scores: HeadScores) -> dict[tuple[int, int], float]:
        raise NotImplementedError


class RecencyScorer(Scorer):
    """[paper] The most recency-aware groups first (mean RR of the group's query heads)."""

    name = "recency"

    def score(self, scores: HeadScores) -> dict[tuple[int, int], float]:
        return scores.group_values()


class InverseScorer(Scorer):
    """Control: the least recency-aware groups first."""

    name = "inverse"

    def score(self, scores: HeadScores) -> dict[tuple[int, int], float]:
        return {g: -v for g, v in scores.group_values().items()}


class RandomScorer(Scorer):
    """Control: a seeded random order."""

    name = "random"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def score(self, scores: HeadScores) -> dict[tuple[int, int], float]:
        rng = random.Random(self.seed)
        return {g: rng.random() for g in scores.group_values()}


class MeasuredScorer(Scorer):
    """Ranks by a group statistic that `analyze` measured (`statistic`), the lowest first;
    scores without it are refused with `missing`."""

    statistic = ""
    missing = ""

    def score(self, scores: HeadScores) -> dict[tuple[int, int], float]:
        if self.statistic not in scores.groups:
            raise ConfigError(self.missing)
        return {g: -v for g, v in scores.group_values(self.statistic).items()}


class AblationScorer(MeasuredScorer):
    """[ours] The groups whose windowing alone costs the least NLL first (`ablation.py`)."""

    name, statistic = "ablation", "ablation"
    missing = ("these scores have no ablation costs; make them with "
               "`recurformer analyze ... --scorer ablation`, or choose --scorer recency")


class RetrievalAblationScorer(MeasuredScorer):
    """[ours] The groups whose windowing alone costs the answers of a key-value retrieval
    probe the least first (`retrieval_probe.py`; after Retrieval-Aware Distillation's ranking)."""

    name, statistic = "ablation-retrieval", "ablation_retrieval"
    missing = ("these scores have no retrieval ablation costs; make them with "
               "`recurformer analyze ... --scorer ablation-retrieval`")


class GreedyAblationScorer(MeasuredScorer):
    """[ours] The order of the greedy ablation rounds (`ablation.py`): each round's cheapest
    groups, measured with the earlier rounds' groups windowed, first."""

    name, statistic = "ablation-greedy", "ablation_order"
    missing = ("these scores have no greedy ablation order; make them with "
               "`recurformer analyze ... --scorer ablation-greedy`")


SCORERS: dict[str, type[Scorer]] = {s.name: s for s in (RecencyScorer, InverseScorer, RandomScorer, AblationScorer,
                                                         GreedyAblationScorer, RetrievalAblationScorer)}


def ablation_measurement(scorer: str, config: AblationConfig) -> AblationConfig | None:
    """What `analyze_text` must measure for `scorer`: nothing, one round (`ablation`,
    `ablation-retrieval`) or `config.ablation_rounds` rounds (`ablation-greedy`)."""
    if scorer in (AblationScorer.name, RetrievalAblationScorer.name):
        return replace(config, ablation_rounds=1)
    return config if scorer == GreedyAblationScorer.name else None


def make_scorer(name: str, seed: int = 0) -> Scorer:
    if name not in SCORERS:
        raise ConfigError(f"scorer: unknown {name!r}; choose one of {', '.join(SCORERS)}")
    return RandomScorer(seed) if name == "random" else SCORERS[name]()


def check_beta(beta: float) -> None:
    """The one-line error for a `beta` outside [0, 1]."""
    groups_to_replace(1, beta)


@dataclass(frozen=True)
class SelectionConfig:
    """Which KV groups to replace: the top `beta` fraction under `scorer`. [ours] The default
    is `ablation`, the cheapest groups to window first: trained and training-free, it keeps
    more than `recency` at beta 0.75 and beyond 1K tokens (docs/results/analysis.md)."""

    beta: float = option(0.5, "fraction of KV groups to replace, in [0, 1]")
    scorer: str = option("ablation", "which groups go first: " + " | ".join(SCORERS))
    seed: int = option(0, "seeds the random scorer and the text sample")

    def __post_init__(self) -> None:
        check_beta(self.beta)
        make_scorer(self.scorer, self.seed)

    def select(self, scores: HeadScores) -> ReplacementSpec:
        return select_heads(scores, self.beta, make_scorer(self.scorer, self.seed))


def select_heads(scores: HeadScores, beta: float, scorer: Scorer | None = None) -> ReplacementSpec:
    """The global top-`beta` fraction of KV groups under `scorer` (default: `SelectionConfig`'s,
    `ablation`, which needs scores made with it; the paper's is `make_scorer("recency")`).

    Ties are broken by (layer, kv_head), so the choice is deterministic.
    """
    scorer = scorer or make_scorer(SelectionConfig.scorer)
    ranked = scorer.score(scores)
    count = groups_to_replace(len(ranked), beta)
    chosen = sorted(ranked, key=lambda g: (-ranked[g], g))[:count]
    return ReplacementSpec(
        scores.num_layers, scores.num_kv_heads, chosen,
        source={"model": scores.model, "scorer": scorer.name, "beta": beta, "metric": scores.metric},
    )


def select_layers(scores: HeadScores, beta: float, scorer: Scorer | None = None) -> ReplacementSpec:
    """[ours] The between-layer alternative (Jamba/Samba style): whole layers are replaced.

    Layers are ranked by the mean score of their KV groups under `scorer` (default:
    recency) and the top `floor(beta * layers + 1/2)` go, every group of each. This is
    `groups_to_replace` rounded to whole layers, so `spec.fraction` can differ from `beta`
    when `beta * groups` is not a multiple of the groups per layer; report the fraction.
    Ties are broken by layer index.
    """
    scorer = scorer or RecencyScorer()
    ranked = scorer.score(scores)
    per_layer = {l: sum(ranked[(l, g)] for g in range(scores.num_kv_heads)) / scores.num_kv_heads
                 for l in range(scores.num_layers)}
    count = groups_to_replace(scores.num_layers, beta)
    layers = sorted(per_layer, key=lambda l: (-per_layer[l], l))[:count]
    return ReplacementSpec(
        scores.num_layers, scores.num_kv_heads, [(l, g) for l in layers for g in range(scores.num_kv_heads)],
        source={"model": scores.model, "scorer": scorer.name, "beta": beta, "metric": scores.metric, "unit": "layer"},
    )
