"""Plots (matplotlib, headless) for analysis and run reports. Files are written atomically."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .config import ReplacementSpec  # noqa: E402
from .files import temporary_sibling  # noqa: E402
from .scoring import HeadScores  # noqa: E402


def save_figure(figure, path: str | Path) -> None:
    """Save a figure through a temporary file, so no half-written image is left behind."""
    path = Path(path)
    tmp = temporary_sibling(path)
    try:
        figure.savefig(tmp, dpi=120, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        plt.close(figure)
        tmp.unlink(missing_ok=True)


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
    """Two panels: cache bytes against context (log-log), decode tokens/s per context."""
    rows = result["measurements"]
    names = list(dict.fromkeys(r["model"] for r in rows))
    contexts = result["contexts"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in names:
        mine = [r for r in rows if r["model"] == name]
        left.plot([r["context"] for r in mine], [r["cache_bytes"] / 2**20 for r in mine], marker="o", label=name)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("context (tokens)")
    left.set_ylabel("cache (MiB)")
    left.set_title("cache size", fontsize=10)
    left.legend(fontsize=7)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        speeds = [next(r["decode_tokens_per_s"] for r in rows if r["model"] == name and r["context"] == c) for c in contexts]
        right.bar([j + i * width for j in range(len(contexts))], speeds, width, label=name)
    right.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(contexts))], [str(c) for c in contexts])
    right.set_xlabel("context (tokens)")
    right.set_ylabel("decode tokens/s (median)")
    right.set_title("decode speed, batch 1", fontsize=10)
    right.legend(fontsize=7)
    save_figure(figure, path)
