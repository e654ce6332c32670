"""Plots (matplotlib, headless) for analysis and run reports. Files are written atomically."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from .config import ReplacementSpec  # noqa: E402
from .scoring import HeadScores  # noqa: E402


def save_figure(figure, path: str | Path) -> None:
    """Save a figure through a temporary file, so no half-written image is left behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix)
    os.close(fd)
    try:
        figure.savefig(tmp, dpi=120, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        plt.close(figure)
        Path(tmp).unlink(missing_ok=True)


def plot_head_heatmap(scores: HeadScores, path: str | Path, spec: ReplacementSpec | None = None) -> None:
    """Heatmap of RR (layers x query heads); replaced KV groups outlined in black."""
    values = scores.heads[scores.metric]
    size = scores.num_heads // scores.num_kv_heads
    figure, axis = plt.subplots(figsize=(1.2 + 0.5 * scores.num_heads, 1.0 + 0.22 * scores.num_layers))
    image = axis.imshow(values, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    figure.colorbar(image, ax=axis, label=f"recency ratio RR (w={scores.window})")
    for layer, kv_head in spec.groups if spec else []:
        axis.add_patch(Rectangle((kv_head * size - 0.5, layer - 0.5), size, 1, fill=False, edgecolor="black", linewidth=1.8))
    for g in range(1, scores.num_kv_heads):
        axis.axvline(g * size - 0.5, color="white", linewidth=0.6)
    axis.set_xlabel(f"query head ({size} per KV group, groups split by white lines)")
    axis.set_ylabel("layer")
    title = f"{scores.model or 'model'}: RR per head"
    if spec:
        title += f"; outlined: {len(spec.groups)} replaced groups ({spec.fraction:.0%})"
    axis.set_title(title, fontsize=9)
    save_figure(figure, path)
