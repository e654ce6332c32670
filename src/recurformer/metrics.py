"""The numbers of a run, declared once.

A `Metric` names a key of `metrics.json`, says what it is, how a value is shown and which
way is better, and how to read it from a finished run (`RunResults`). A `Row` is a line of
the report's summary table (original | converted | converted / original), naming metric
keys. `metrics.json`, the report and the comparison benchmarks (benchmarks/mixers.py) all
read these declarations; an evaluation task declares its own (see `evaluate`).

To add a number to every run's `metrics.json` and report: one `Metric` (and a `Row` if it
belongs in the summary) here, one line in docs/run.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .mixers import kinds_reading
from .recipe import recipe_for

MIB = 2**20


@dataclass(frozen=True)
class RunResults:
    """What a finished run wrote, as its metrics read it.

    `config`: the run's configuration (run.json); `records`: each stage's marker record;
    `evaluation`: eval.json (`{task: {model: result}}`); `bench`: bench.json; `final`: the
    name the final model has in bench.json.
    """

    config: dict
    records: dict[str, dict]
    evaluation: dict
    bench: dict
    final: str

    @property
    def bench_context(self) -> int:
        """The context of the headline bench numbers: the largest measured."""
        return max(self.bench["contexts"])

    @property
    def bench_batch(self) -> int:
        """The batch of the headline bench numbers: the smallest measured (a run measures batch 1)."""
        return min(self.bench.get("batches", [1]))

    def _headline(self, row: dict) -> bool:
        return row["context"] == self.bench_context and row.get("batch", 1) == self.bench_batch

    def measurement(self, model: str, field: str) -> Any:
        """`field` of `model`'s first-round measurement at `bench_context` and `bench_batch`."""
        return next(r[field] for r in self.bench["measurements"]
                    if r["model"] == model and self._headline(r) and r.get("round", 0) == 0)

    def ratio(self, baseline: str, field: str) -> float:
        """The final model's `field` ratio against `baseline` at `bench_context` and
        `bench_batch` (median over rounds)."""
        return next(r[field] for r in self.bench["ratios"]
                    if r["baseline"] == baseline and r["model"] == self.final and self._headline(r))

    def max_context(self, model: str) -> int:
        return next(b["max_context"] for b in self.bench["cache_budget"] if b["model"] == model)

    def result(self, task: str, model: str) -> dict:
        """The evaluation result of `task` on `model` (original, converted, transfer, final)."""
        return self.evaluation[task][model]


@dataclass(frozen=True)
class Metric:
    """One number (or string) of a run."""

    key: str  # the metrics.json key
    label: str  # what it is, in the report and docs/run.md
    value: Callable[[RunResults], Any]
    fmt: str | Callable[[Any], str] = "{}"  # how a value is shown: a str.format pattern or a function
    better: str | None = None  # "lower" or "higher" is better; None: not a quality measure
    unit: str = ""  # of the value in metrics.json: "", "bytes", "tokens/s", "s", "x" (a ratio), ...

    def show(self, value: Any) -> str:
        if value is None:
            return ""
        return self.fmt(value) if callable(self.fmt) else self.fmt.format(value)


@dataclass(frozen=True)
class Row:
    """A line of the report's summary table. `label` is a str.format pattern whose fields
    are metric keys, filled with their shown values; the other fields name metric keys
    (None: an empty cell); `note`, if given, is shown in parentheses after the ratio;
    `baseline` and `baseline_ratio` fill the column of the window at equal cache bytes."""

    label: str
    original: str | None
    converted: str | None
    ratio: str | None
    note: str | None = None
    baseline: str | None = None
    baseline_ratio: str | None = None


MODELS = ("original", "converted", "transfer", "final")  # the models a run makes, in stage order
BASELINE = "baseline"  # the training-free `window` at the final model's cache bytes (equal_cache.py)


def per_model(task: str, field: str, label: str, models: Iterable[str], key: str | None = None,
              **shown) -> tuple[Metric, ...]:
    """`<key>_<model>` for each model (`key`: the task's name unless given): `field` of the
    task's result on that model."""
    return tuple(Metric(f"{key or task}_{m}", f"{label}: {m}", (lambda r, m=m: r.result(task, m)[field]), **shown)
                 for m in models)


def mib(value: float) -> str:
    """Bytes shown as MiB."""
    return f"{value / MIB:,.1f} MiB"


def millions(value: float) -> str:
    return f"{value / 1e6:.1f}M"


def _stage_metrics(stage: str, what: str) -> tuple[Metric, ...]:
    def summary(r: RunResults, key: str) -> Any:
        return r.records[stage][key]

    return (
        Metric(f"{stage}_steps", f"{stage} stage: optimizer steps", lambda r: summary(r, "steps"), "{:,}"),
        Metric(f"{stage}_tokens", f"{stage} stage: training tokens", lambda r: summary(r, "tokens"), "{:,}", unit="tokens"),
        Metric(f"{stage}_lr", f"{stage} stage: peak learning rate", lambda r: summary(r, "lr"), "{:g}"),
        Metric(f"{stage}_minutes", f"{stage} stage: training minutes", lambda r: round(summary(r, "elapsed_s") / 60, 2),
               "{:.1f}", unit="min"),
        Metric(f"{stage}_final_loss", f"{stage} stage: last loss ({what})", lambda r: summary(r, "final_loss"), "{:.4f}"),
        Metric(f"{stage}_s_per_step", f"{stage} stage: seconds per step",
               lambda r: summary(r, "elapsed_s") / summary(r, "steps"), "{:.1f}", "lower", "s"),
    )


def _config(key: str, label: str) -> Metric:
    return Metric(key, label, lambda r: r.config[key])


# The shape of a run whose run.json holds none: the library's defaults when the flags did not
# exist yet (`run` now records the shape it decided for the model).
LEGACY_SHAPE = {"window": 64, "sinks": 4, "ssd_state": "head_dim"}


def _mixer_field(name: str) -> Callable[[RunResults], Any]:
    """The converted mixer's field `name` as run: the run's value (run.json), the default of
    its time where it records none, None for a kind that does not read it."""
    def value(r: RunResults) -> Any:
        if r.config["mixer"] not in kinds_reading(name):
            return None
        given = r.config.get(name)
        return LEGACY_SHAPE[name] if given is None else given

    return value


RUN_METRICS: tuple[Metric, ...] = (
    _config("quick", "quick run (tiny sizes)"),
    _config("model", "model"),
    _config("beta", "fraction of KV groups asked to be replaced"),
    _config("mixer", "mixer kind"),
    Metric("window", "window of the replaced heads (tokens, besides the sinks)", _mixer_field("window"), "{:,}",
           unit="tokens"),
    Metric("sinks", "sinks of the replaced heads' window (first tokens always attended)", _mixer_field("sinks"),
           "{:,}", unit="tokens"),
    Metric("ssd_state", "Mamba-2 state size per head", _mixer_field("ssd_state")),
    _config("scorer", "head scorer"),
    _config("budget_minutes", "training time budget (minutes; none: fixed steps)"),
    Metric("recipe", "training recipe (recipe.py)", lambda r: recipe_for(r.config["mixer"], r.config.get("recipe_name")).name),
    Metric("retrieval_share", "share of training sequences with facts and questions",
           lambda r: r.config.get("retrieval_share", 0.0), "{:.0%}"),
    Metric("answer_weight", "weight of the answers' positions in the lm stage's loss",
           lambda r: r.config.get("answer_weight", 1.0), "{:g}"),
    _config("seed", "seed"),
    Metric("replaced_groups", "KV groups replaced", lambda r: r.records["convert"]["groups"]),
    Metric("replaced_fraction", "share of KV groups replaced", lambda r: r.records["convert"]["fraction"], "{:.0%}"),
    Metric("params_original", "parameters, original", lambda r: r.records["convert"]["original_total"], millions),
    Metric("params_converted", "parameters, converted", lambda r: r.records["convert"]["converted_total"], millions),
    Metric("analyze_tokens", "tokens scored by the analysis", lambda r: r.records["analyze"]["tokens"], "{:,}"),
    Metric("rr_median", "median recency ratio over KV groups", lambda r: r.records["analyze"]["median"], "{:.3f}"),
    *_stage_metrics("transfer", "MSE to the replaced heads"),
    *_stage_metrics("lm", "cross-entropy + KL"),
    Metric("baseline_window", "window of the training-free rival at equal cache bytes (tokens, besides the sinks)",
           lambda r: r.records["evaluate"]["baseline_window"], "{:,}", unit="tokens"),
    Metric("bench_context", "context of the bench numbers (the largest measured)", lambda r: r.bench_context, "{:,}",
           unit="tokens"),
    Metric("bench_threads", "torch threads during the benchmark", lambda r: r.bench["threads"]),
    Metric("cache_bytes_original", "cache bytes, original", lambda r: r.measurement("original", "cache_bytes"), mib,
           "lower", "bytes"),
    Metric("cache_bytes_final", "cache bytes, converted", lambda r: r.measurement(r.final, "cache_bytes"), mib,
           "lower", "bytes"),
    Metric("cache_ratio", "cache bytes, converted / original", lambda r: r.ratio("original", "cache_bytes_ratio"),
           "{:.3f}x", "lower", "x"),
    Metric("decode_tokens_per_s_original", "decode speed, original (dynamic cache)",
           lambda r: r.measurement("original", "decode_tokens_per_s"), "{:.1f}", "higher", "tokens/s"),
    Metric("decode_tokens_per_s_final", "decode speed, converted",
           lambda r: r.measurement(r.final, "decode_tokens_per_s"), "{:.1f}", "higher", "tokens/s"),
    Metric("decode_speedup", "decode speed, converted / original (dynamic cache)",
           lambda r: r.ratio("original", "decode_speedup"), "{:.2f}x", "higher", "x"),
    Metric("decode_speedup_vs_static_cache", "decode speed, converted / original (static cache)",
           lambda r: r.ratio("original+static-cache", "decode_speedup"), "{:.2f}x vs a static cache", "higher", "x"),
    Metric("prefill_time_ratio", "prefill time, converted / original", lambda r: r.ratio("original", "prefill_time_ratio"),
           "{:.2f}x", "lower", "x"),
    Metric("max_context_in_budget_original", "longest context whose cache fits the budget, original",
           lambda r: r.max_context("original"), "{:,}", "higher", "tokens"),
    Metric("max_context_in_budget_final", "longest context whose cache fits the budget, converted",
           lambda r: r.max_context(r.final), "{:,}", "higher", "tokens"),
    Metric("cache_budget_bytes", "the cache budget", lambda r: next(b["budget_bytes"] for b in r.bench["cache_budget"]),
           mib, unit="bytes"),
    Metric("params_ratio", "parameters, converted / original",
           lambda r: r.records["convert"]["converted_total"] / r.records["convert"]["original_total"], "{:.3f}x", unit="x"),
)

RUN_ROWS: tuple[Row, ...] = (
    Row("cache at {bench_context} tokens", "cache_bytes_original", "cache_bytes_final", "cache_ratio"),
    Row("decode tokens/s at {bench_context} tokens (batch 1)", "decode_tokens_per_s_original",
        "decode_tokens_per_s_final", "decode_speedup", note="decode_speedup_vs_static_cache"),
    Row("prefill time at {bench_context} tokens", None, None, "prefill_time_ratio"),
    Row("longest context whose cache fits {cache_budget_bytes}", "max_context_in_budget_original",
        "max_context_in_budget_final", None),
    Row("parameters", "params_original", "params_converted", "params_ratio"),
)


def run_metric_table(task_metrics: Iterable[Metric], task_rows: Iterable[Row],
                     stages: Iterable[str]) -> tuple[list[Metric], list[Row]]:
    """Every metric of a run and the summary table's rows: the evaluation tasks' (in report
    order: `task_metrics`, `task_rows`), then the run's own (`RUN_METRICS`, `RUN_ROWS`), then
    the wall time and peak resident memory of each of the timed `stages`."""
    timed = list(stages)
    seconds = [Metric(f"seconds_{name}", f"wall time of the {name} stage", (lambda r, n=name: r.records[n]["seconds"]),
                      "{:.1f}", unit="s") for name in timed]
    memory = [Metric(f"peak_rss_{name}", f"peak resident memory of the process during the {name} stage",
                     (lambda r, n=name: r.records[n].get("peak_rss_bytes")), mib, "lower", "bytes") for name in timed]
    total = Metric("total_minutes", "wall time of all stages",
                   lambda r: round(sum(r.records[n]["seconds"] for n in timed) / 60, 2), "{:.1f}", unit="min")
    peak = Metric("peak_rss", "peak resident memory of the process over all stages",
                  lambda r: max(filter(None, (r.records[n].get("peak_rss_bytes") for n in timed)), default=None), mib,
                  "lower", "bytes")
    return [*RUN_METRICS, *task_metrics, *seconds, *memory, total, peak], [*task_rows, *RUN_ROWS]


def collect(results: RunResults, metrics: Iterable[Metric]) -> dict[str, Any]:
    """`{key: value}` of every metric, in table order."""
    return {metric.key: metric.value(results) for metric in metrics}


def by_key(metrics: Iterable[Metric]) -> dict[str, Metric]:
    table = {}
    for metric in metrics:
        if metric.key in table:
            raise ValueError(f"metric {metric.key!r} is declared twice")
        table[metric.key] = metric
    return table


def render_rows(rows: Iterable[Row], values: dict[str, Any], table: dict[str, Metric]) -> list[str]:
    """The summary table's Markdown lines."""

    def cell(key: str | None) -> str:
        return "" if key is None else table[key].show(values[key])

    shown = {key: cell(key) for key in values if key in table}
    lines = ["| measure | original | converted | converted / original | window at equal cache |", "|---|---|---|---|---|"]
    for row in rows:
        ratio = cell(row.ratio) + (f" ({cell(row.note)})" if row.note else "")
        baseline = cell(row.baseline) + (f" ({cell(row.baseline_ratio)})" if row.baseline_ratio else "")
        cells = (row.label.format(**shown), cell(row.original), cell(row.converted), ratio, baseline)
        cells = [c.replace("|", "\\|") for c in cells]  # a "|" (KL(original || model)) would end the cell
        lines.append("|" + "|".join(f" {c} " if c else " " for c in cells) + "|")
    return lines
