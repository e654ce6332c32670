"""Passkey accuracy as a heatmap, context length x depth, one panel per model.

Reads the JSON files of `recurformer eval MODEL --task passkey --out FILE.json` (one per model
and context) and draws, for each model (the files' `model`, or `--name NAME=FILE`), the
accuracy of every (context, depth) cell, annotated with correct / problems:

    python -m benchmarks.long_context.passkey_heatmap docs/results/long-context/passkey-*.json \\
        --out docs/results/long-context/passkey-heatmap.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib.pyplot as plt

from recurformer.report import save_figure  # headless matplotlib

Cell = tuple[int, int]  # (correct, problems)


def read_result(path: Path) -> dict:
    """A passkey result file, checked: one line naming the file and the problem if not."""
    try:
        result = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"error: {path}: no such file") from None
    except json.JSONDecodeError as err:
        raise SystemExit(f"error: {path}: not JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(result, dict) or result.get("task") != "passkey" or not isinstance(result.get("cells"), list):
        raise SystemExit(f"error: {path}: not the output of `recurformer eval --task passkey` (no passkey cells)")
    return result


def grids(results: dict[str, list[dict]]) -> dict[str, dict[tuple[int, float], Cell]]:
    """`{model: {(context, depth): (correct, problems)}}` from each model's results; cells of
    the same context and depth in two files add up."""
    out: dict[str, dict[tuple[int, float], Cell]] = {}
    for model, files in results.items():
        grid = out.setdefault(model, {})
        for result in files:
            for cell in result["cells"]:
                key = (int(cell["context"]), float(cell["depth"]))
                correct, problems = grid.get(key, (0, 0))
                grid[key] = (correct + round(cell["accuracy"] * cell["n"]), problems + int(cell["n"]))
    return out


def plot(grid_by_model: dict[str, dict[tuple[int, float], Cell]], path: Path) -> None:
    """One panel per model: rows are contexts, columns depths, colour the exact-match rate."""
    contexts = sorted({c for grid in grid_by_model.values() for c, _ in grid})
    depths = sorted({d for grid in grid_by_model.values() for _, d in grid})
    size = (1.2 + 1.1 * len(depths) * len(grid_by_model), 0.8 + 0.6 * len(contexts))
    fig, axes = plt.subplots(1, len(grid_by_model), figsize=size, squeeze=False)
    for ax, (model, grid) in zip(axes[0], grid_by_model.items()):
        values = [[(grid[c, d][0] / grid[c, d][1]) if (c, d) in grid else float("nan") for d in depths] for c in contexts]
        image = ax.imshow(values, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i, c in enumerate(contexts):
            for j, d in enumerate(depths):
                if (c, d) in grid:
                    ax.text(j, i, "{}/{}".format(*grid[c, d]), ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_yticks(range(len(contexts)), [f"{c:,}" for c in contexts])
        ax.set_xlabel("depth of the key")
        ax.set_title(model, fontsize=9)
    axes[0][0].set_ylabel("context (tokens)")
    fig.colorbar(image, ax=axes[0].tolist(), label="exact match")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="passkey result files (their `model` names the panel)")
    parser.add_argument("--name", action="append", default=[], metavar="NAME=FILE",
                        help="a result file whose panel is NAME instead of its model")
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    results: dict[str, list[dict]] = {}
    for item in args.name:
        if "=" not in item:
            raise SystemExit(f"error: --name takes NAME=FILE, got {item!r}")
        name, file = item.split("=", 1)
        results.setdefault(name, []).append(read_result(Path(file)))
    for file in args.files:
        result = read_result(Path(file))
        results.setdefault(str(result.get("model")), []).append(result)
    if not results:
        raise SystemExit("error: no passkey result files given")
    grid_by_model = grids(results)
    plot(grid_by_model, Path(args.out))
    for model, grid in grid_by_model.items():
        correct, problems = (sum(v[i] for v in grid.values()) for i in (0, 1))
        print(f"{model}: {correct}/{problems}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
