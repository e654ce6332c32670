"""Mixers compared at equal training: `recurformer run` directories that differ only in
`--mixer` (or `--lr`), collected into docs/results/mixers.json and docs/results/mixers.md.

    recurformer run --mixer mamba2 --steps 40,16 --out runs/mixers/mamba2
    recurformer run --mixer window --steps 40,16 --out runs/mixers/window
    python -m benchmarks.quality.mixers runs/demo runs/mixers/mamba2 runs/mixers/window

Runs are grouped into one table per beta and evaluation (runs of an older version scored
perplexity on other windows and have no out-of-domain or long-range numbers: they form
their own table). Refuses runs that are unfinished or not comparable within a group
(another model, scorer, seed, step counts or training tokens), and two runs of the same
mixer and learning rates in a group. The columns are metrics of the run's metric table
(`recurformer.run.metric_table`): their labels and formats come from there, and the
best value of each column with a direction is in bold. Every run's last column pair is its
own rival: the training-free `window` on the same groups at the same cache bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from recurformer.files import write_json_atomic, write_text_atomic
from recurformer.metrics import by_key
from recurformer.recipe import recipe_for
from recurformer.run import metric_table

from benchmarks.common import RESULTS

SHARED = ("model", "scorer", "seed", "quick", "transfer_steps", "transfer_tokens", "lm_steps", "lm_tokens",
          "ppl_tokens", "ppl_original", "bench_context")
GROUP = ("beta", "ppl_context")  # one table per value; ppl_context is None in runs of an older version
COLUMNS = ("params_ratio", "ppl_converted", "ppl_transfer", "ppl_final", "ppl_ratio", "ppl_ood_ratio",
           "ppl_far_final_ratio", "ruler_final", "agreement_top1_final", "hashhop_final",
           "mqar_final", "cache_ratio", "transfer_s_per_step", "lm_s_per_step", "baseline_window", "ppl_baseline_ratio",
           "ppl_ood_baseline_ratio", "ppl_far_baseline_ratio", "ruler_baseline")
# metrics.json written before the rates were recorded: every mixer trained at these
LEGACY_LR = (5e-3, 1e-3)


def load(directory: str) -> dict:
    path = Path(directory) / "metrics.json"
    if not path.is_file():
        raise SystemExit(f"error: {directory} has no metrics.json (an unfinished run?)")
    return {"run": directory, **json.loads(path.read_text())}


def learning_rates(run: dict) -> tuple[float, float]:
    return run.get("transfer_lr", LEGACY_LR[0]), run.get("lm_lr", LEGACY_LR[1])


def label(run: dict) -> str:
    """The mixer, and the learning rates when they are not its recipe's."""
    lrs = learning_rates(run)
    return run["mixer"] + ("" if lrs == recipe_for(run["mixer"]).learning_rates else f" (lr {lrs[0]:g}, {lrs[1]:g})")


def groups(runs: list[dict]) -> dict[tuple, list[dict]]:
    """The runs by beta and evaluation, each group checked to be comparable."""
    grouped: dict[tuple, list[dict]] = {}
    for run in runs:
        grouped.setdefault(tuple(run.get(k) for k in GROUP), []).append(run)
    for members in grouped.values():
        check_comparable(members)
    return grouped


def same(a, b) -> bool:
    """Equal, floats to 1e-6 relative (the original's perplexity moves in the 8th digit when the
    order of a sum changes)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)
    return a == b


def check_comparable(runs: list[dict]) -> None:
    first = runs[0]
    for run in runs[1:]:
        for key in SHARED:
            if not same(run.get(key), first.get(key)):
                raise SystemExit(f"error: {run['run']} is not comparable with {first['run']}: "
                                 f"{key} is {run.get(key)!r} there and {first.get(key)!r} here")
    variants = [label(r) for r in runs]
    if len(set(variants)) != len(variants):
        raise SystemExit(f"error: each run must differ in mixer or learning rates, got {variants}")


def row(run: dict) -> dict:
    lrs = dict(zip(("transfer_lr", "lm_lr"), learning_rates(run)))
    return {"mixer": run["mixer"], "variant": label(run), "run": run["run"], **lrs, **{k: run.get(k) for k in COLUMNS}}


def best(rows: list[dict], key: str, better: str | None) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    if better is None or len(values) < 2:
        return None
    return min(values) if better == "lower" else max(values)


def render_group(runs: list[dict], rows: list[dict]) -> list[str]:
    table = by_key(metric_table()[0])
    first = runs[0]
    columns = [k for k in COLUMNS if any(r[k] is not None for r in rows)]
    windows = f"windows of {first['ppl_context']:,}" if first.get("ppl_context") else "windows of 1,024 (an older version)"
    lines = [
        f"## beta {first['beta']}, perplexity in {windows}",
        "",
        f"Model `{first['model']}`, scorer `{first['scorer']}`, seed {first['seed']}; the same replaced groups "
        f"({first['replaced_groups']}), {first['transfer_steps']} transfer steps ({first['transfer_tokens']:,} tokens) "
        f"and {first['lm_steps']} lm steps ({first['lm_tokens']:,} tokens). Perplexity on {first['ppl_tokens']:,} "
        f"held-out tokens of wikitext-2-raw-test; the original scores {first['ppl_original']:.2f}"
        + (f" (out-of-domain: {first['ppl_ood_original']:.2f})" if first.get("ppl_ood_original") else "") + ".",
        "",
        "| mixer | " + " | ".join(table[k].label for k in columns) + " |",
        "|" + "---|" * (len(columns) + 1),
    ]
    tops = {k: best(rows, k, table[k].better) for k in columns}
    for r in rows:
        cells = []
        for key in columns:
            text = "-" if r[key] is None else table[key].show(r[key])
            cells.append(f"**{text}**" if r[key] is not None and r[key] == tops[key] else text)
        lines.append(f"| `{r['variant']}` | " + " | ".join(cells) + " |")
    winner = min(rows, key=lambda r: r["ppl_final"])
    lines += ["", f"Lowest final held-out perplexity: `{winner['variant']}` ({winner['ppl_final']:.2f}).", "",
              "Runs: " + ", ".join(f"`{r['run']}` ({r['variant']})" for r in rows) + ".", ""]
    return lines


def render(grouped: dict[tuple, list[dict]], rows: dict[str, dict]) -> str:
    lines = [
        "# Mixers at equal training (SmolLM2-135M)",
        "",
        "Generated by `benchmarks/mixers.py` from `recurformer run` directories that differ only in `--mixer` (and, "
        "where a label says so, the learning rates), one table per beta. Speeds and cache ratios are measured inside "
        "each run against the original (the runs shared the machine, so compare speeds with docs/results/bench.md, "
        "measured in one quiet process). The `window at equal cache` columns are each run's own rival: the "
        "training-free `window` mixer on the same groups whose ring buffer holds the final model's state bytes "
        "(`recurformer.equal_cache`). Bold: the best value of a column.",
        "",
    ]
    for key in sorted(grouped, key=lambda k: (k[0], k[1] is None)):
        members = grouped[key]
        lines += render_group(members, [rows[m["run"]] for m in members])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="finished run directories, one per mixer (or learning rates)")
    parser.add_argument("--out", default=str(RESULTS / "mixers"), help="writes <out>.json and <out>.md")
    args = parser.parse_args(argv)
    runs = [load(d) for d in args.runs]
    grouped = groups(runs)
    rows = {r["run"]: {**row(r), "beta": r["beta"], "ppl_context": r.get("ppl_context")} for r in runs}
    write_json_atomic(Path(args.out + ".json"), {"runs": list(rows.values())})
    text = render(grouped, rows)
    write_text_atomic(Path(args.out + ".md"), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
