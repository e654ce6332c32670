"""Plots (matplotlib, headless) for analysis and run reports, and the run's Markdown
report. Files are written atomically."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no display on our machines
import matplotlib.pyplot as plt  # noqa: E402

from .bench import median_measurements  # noqa: E402
from .config import ReplacementSpec  # noqa: E402
from .files import atomic_file  # noqa: E402
from .metrics import Metric, Row, mib, render_rows  # noqa: E402
from .recipe import recipe_for  # noqa: E402
from .scoring import HeadScores  # noqa: E402


def save_figure(figure, path: str | Path) -> None:
    """Save a figure atomically (no half-written image is ever left behind) and close it."""
    try:
        with atomic_file(path) as tmp:
            figure.savefig(tmp, dpi=120, bbox_inches="tight", format=Path(path).suffix.lstrip(".") or "png")
    finally:
        plt.close(figure)


def plot_head_heatmap(scores: HeadScores, path: str | Path, spec: ReplacementSpec | None = None) -> None:
    """Heatmap of RR (layers x query heads); replaced KV groups marked with a cross."""
    values = scores.heads[scores.metric]
    size = scores.num_heads // scores.num_kv_heads
    figure, axis = plt.subplots(figsize=(1.2 + 0.5 * scores.num_heads, 1.0 + 0.22 * scores.num_layers))
    image = axis.imshow(values, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    figure.colorbar(image, ax=axis, label=f"recency ratio RR (w={scores.window})")
    if spec and spec.groups:
        layers, kv_heads = zip(*spec.groups)
        centers = [g * size + (size - 1) / 2 for g in kv_heads]
        axis.scatter(centers, layers, marker="X", s=40, color="white", edgecolors="black", linewidths=0.8, zorder=3)
    for g in range(1, scores.num_kv_heads):
        axis.axvline(g * size - 0.5, color="white", linewidth=0.6)
    axis.set_xlabel(f"query head ({size} per KV group, groups split by white lines)")
    axis.set_ylabel("layer")
    title = f"{scores.model or 'model'}: RR per head"
    if spec:
        title += f"; X: {len(spec.groups)} replaced groups ({spec.fraction:.0%})"
    axis.set_title(title, fontsize=9)
    save_figure(figure, path)


def plot_bench(result: dict, path: str | Path) -> None:
    """Cache bytes per sequence against context (log-log) and decode tokens/s per context,
    at the smallest batch; with several batches, a third panel: the batch's total decode
    tokens/s against the batch size, at the longest context."""
    rows = median_measurements(result)
    names = list(dict.fromkeys(r["model"] for r in rows))
    contexts, batches = result["contexts"], result.get("batches", [1])
    first = min(batches)
    figure, axes = plt.subplots(1, 2 + (len(batches) > 1), figsize=(5.5 * (2 + (len(batches) > 1)), 4))
    left, right = axes[0], axes[1]
    for name in names:
        mine = [r for r in rows if r["model"] == name and r["batch"] == first]
        left.plot([r["context"] for r in mine], [r["cache_bytes"] / r["batch"] / 2**20 for r in mine], marker="o",
                  label=Path(name).name)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("context (tokens)")
    left.set_ylabel("cache per sequence (MiB)")
    left.set_title("cache size", fontsize=10)
    left.legend(fontsize=7)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        speeds = [next(r["decode_tokens_per_s"] for r in rows if r["model"] == name and r["context"] == c and r["batch"] == first)
                  for c in contexts]
        right.bar([j + i * width for j in range(len(contexts))], speeds, width, label=Path(name).name)
    right.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(contexts))], [str(c) for c in contexts])
    right.set_xlabel("context (tokens)")
    right.set_ylabel("decode tokens/s per sequence (median)" + (f", median of {result['rounds']} rounds" if result.get("rounds", 1) > 1 else ""))
    right.set_title(f"decode speed, batch {first}", fontsize=10)
    right.legend(fontsize=7, loc="lower left")
    if len(batches) > 1:
        longest = max(contexts)
        for name in names:
            mine = sorted((r for r in rows if r["model"] == name and r["context"] == longest), key=lambda r: r["batch"])
            axes[2].plot([r["batch"] for r in mine], [r["decode_total_tokens_per_s"] for r in mine], marker="o",
                         label=Path(name).name)
        axes[2].set_xscale("log", base=2)
        axes[2].set_xticks(batches, [str(b) for b in batches])
        axes[2].set_xlabel("batch (sequences decoded together)")
        axes[2].set_ylabel("decode tokens/s, whole batch (median)")
        axes[2].set_title(f"batched decode at {longest:,} tokens", fontsize=10)
        axes[2].legend(fontsize=7)
    save_figure(figure, path)


def plot_loss_curves(logs: dict[str, Path], path: str | Path) -> None:
    """Training loss per step of each stage (`stage -> train_log.jsonl`), one panel each."""
    figure, axes = plt.subplots(1, len(logs), figsize=(5.5 * len(logs), 3.6), squeeze=False)
    for axis, (stage, log) in zip(axes[0], logs.items()):
        records = [json.loads(line) for line in Path(log).read_text().splitlines() if line.strip()]
        steps = [r["step"] for r in records]
        axis.plot(steps, [r["loss"] for r in records], marker="." if len(records) < 50 else None, label="loss")
        if records and "kl" in records[0]:
            axis.plot(steps, [r["ce"] for r in records], linestyle="--", label="cross-entropy")
            axis.plot(steps, [r["kl"] for r in records], linestyle=":", label="KL to the original")
            axis.legend(fontsize=7)
        axis.set_xlabel("optimizer step")
        axis.set_ylabel("MSE to the replaced heads" if stage == "transfer" else "loss (nats)")
        axis.set_title(f"{stage} stage", fontsize=10)
    save_figure(figure, path)


def portable(config: dict) -> dict:
    """The run's configuration with its text files named by file name only: a report says
    which corpora it read, not where they were on the machine it ran on."""
    return {key: [Path(p).name for p in value] if key in ("data", "eval_data", "ood_data") and isinstance(value, list)
            else value for key, value in config.items()}


def _short_of_measured_steps(m: dict, config: dict) -> list[str]:
    """A paragraph where a time budget bought fewer steps than the recipe's documented numbers
    were measured with (`Recipe.measured_steps`), and what that affects; else nothing."""
    measured = recipe_for(m["mixer"], m.get("recipe")).measured_steps
    if m["quick"] or config.get("budget_minutes") is None or measured is None:
        return []
    if m["transfer_steps"] >= measured[0] and m["lm_steps"] >= measured[1]:
        return []
    return [f"**The {config['budget_minutes']:g}-minute budget bought {m['transfer_steps']} + {m['lm_steps']} steps on "
            f"this machine, fewer than the {measured[0]} + {measured[1]} the recipe's documented numbers were measured "
            "with.** Text quality hardly moves with these steps (37 + 21 and 55 + 32 steps are level on held-out and "
            "out-of-domain text), but the retrieval figures of the README's \"Where it wins\" need them: a "
            "run of 37 + 21 steps answered 5.3 points fewer shared-context questions than 55 + 32 "
            "(docs/where-it-wins.md). Without `--budget-minutes` a run trains those.", ""]


def render_run_report(metrics: dict, table: dict[str, Metric], rows: list[Row], config: dict, bench: dict,
                      sections: list[tuple[str, list[str]]]) -> str:
    """The Markdown report of a run: the summary table (`rows` over the `metrics` values,
    shown as `table` says), which heads were replaced, how they were trained, the evaluation
    tasks' own `sections` (title, lines), cache and speed, each stage's time and memory,
    and the configuration."""
    m = metrics
    shape = [] if m.get("window") is None else [f"window {m['window']} + {m['sinks']} sinks"]
    if m.get("ssd_state") is not None:
        shape.append(f"{m['ssd_state']} state values per head")
    window = f" ({', '.join(shape)})" if shape else ""
    lines = [f"# RecurFormer run: {m['model']}, beta {m['beta']}, mixer `{m['mixer']}`{window}", ""]
    if m["quick"]:
        lines += ["> **Quick run (`--quick`): every size is tiny. These numbers check that the pipeline works; "
                  "they say nothing about the method.**", ""]
    lines += [
        f"{m['replaced_groups']} of the model's KV groups ({m['replaced_fraction']:.0%}) were replaced by `{m['mixer']}` "
        f"mixers, chosen by the `{m['scorer']}` scorer; the converted model was trained for "
        f"{m['transfer_minutes'] + m['lm_minutes']:.1f} minutes ({m['transfer_tokens'] + m['lm_tokens']:,} tokens). "
        f"The whole run took {m['total_minutes']:.1f} minutes.",
        "",
        "## Summary",
        "",
        *render_rows(rows, m, table),
        "",
        f"The last column is the training-free rival at equal cache bytes: the same {m['replaced_groups']} KV groups "
        f"replaced by the `window` mixer, the heads' own attention over the last {m['baseline_window']} tokens and the "
        "sinks, whose ring buffer holds as many bytes as the converted model's mixer state. Training is only worth it "
        "where the converted model beats this window.",
        "",
        "## 1. Which heads were replaced",
        "",
        f"Recency ratio of every head (attention mass on the last tokens) measured on {m['analyze_tokens']:,} tokens "
        f"of the training text; median over KV groups {m['rr_median']:.3f}. Crosses mark the replaced groups.",
        "",
        "![heads](heads.png)",
        "",
        "## 2. Training",
        "",
        f"`transfer`: {m['transfer_steps']} steps, {m['transfer_tokens']:,} tokens, {m['transfer_minutes']:.1f} min at "
        f"peak learning rate {m['transfer_lr']:g}; `lm`: {m['lm_steps']} steps, {m['lm_tokens']:,} tokens, "
        f"{m['lm_minutes']:.1f} min at {m['lm_lr']:g}. " + recipe_for(m["mixer"], m.get("recipe")).summary,
        "",
        *_short_of_measured_steps(m, config),
        "![loss](loss.png)",
        "",
    ]
    number = 3
    for title, section in sections:
        lines += [f"## {number}. {title}", "", *section, ""]
        number += 1
    lines += [
        f"## {number}. Cache, speed and memory",
        "",
        "Measured in one process, the original model (with transformers' dynamic cache, and with its static "
        f"cache) alternating with the converted one, fp32, batch 1, {m['bench_threads']} torch thread(s); decode "
        "speed is the median of the timed steps.",
        "",
        "| model | context | prefill s | decode tok/s | K/V | mixer state |",
        "|---|---|---|---|---|---|",
    ]
    for r in bench["measurements"]:
        name = r["model"] if r["model"].startswith("original") else "converted"
        lines.append(f"| {name} | {r['context']:,} | {r['prefill_s']:.2f} | {r['decode_tokens_per_s']:.1f} | "
                     f"{mib(r['kv_bytes'])} | {mib(r['state_bytes'])} |")
    lines += [
        "",
        "![bench](bench.png)",
        "",
        f"## {number + 1}. Time and memory per stage",
        "",
        "| stage | seconds | peak resident memory |",
        "|---|---|---|",
        *[f"| {stage} | {value:.1f} | {table[f'peak_rss_{stage}'].show(m.get(f'peak_rss_{stage}'))} |"
          for stage, value in ((key[len("seconds_"):], value) for key, value in m.items() if key.startswith("seconds_"))],
        "",
        "## Configuration",
        "",
        "```json",
        json.dumps(portable(config), indent=1),
        "```",
        "",
        "All numbers are in `metrics.json` (see docs/run.md for each key); re-running the same command "
        "with the same `--out` skips every finished stage.",
        "",
    ]
    return "\n".join(lines)
