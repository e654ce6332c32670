"""The retrieval study's results: flat rows from the finished units (`results.json`), the
README with its tables, plots and conclusions computed from the numbers."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import matplotlib.pyplot as plt  # noqa: E402  (after recurformer.report, which selects the headless backend)
import matplotlib.ticker  # noqa: E402

from recurformer.files import write_json_atomic, write_text_atomic
from recurformer.report import plot_head_heatmap, save_figure
from recurformer.scoring import HeadScores, make_scorer, select_heads, uniform_recency_ratio

from benchmarks.retrieval.design import EVAL_SEED, Study, Unit


def collect(study: Study, units: list[Unit]) -> dict:
    """Flat rows from finished units (documented in the README); unfinished ones are left out."""
    rows, bases = [], []
    for unit in units:
        if unit.kind == "base" and unit.path.exists():
            record = json.loads((unit.path / "unit.json").read_text())
            scores = HeadScores.load(unit.path / "scores.json")
            recency = list(scores.group_values().values())
            bases.append({"task": unit.task.name, "seed": unit.seed, **record, "group_recency_min": min(recency),
                          "group_recency_max": max(recency),
                          "uniform_recency": uniform_recency_ratio(scores.seq_len, scores.window)})
        if unit.kind != "eval" or not unit.path.exists():
            continue
        result = json.loads(unit.path.read_text())
        variant = unit.variant
        row = {"task": unit.task.name, "seed": unit.seed,
               "variant": "original" if variant is None else variant.name,
               "selector": "original" if variant is None else variant.selector,
               "mixer": "-" if variant is None or variant.selector == "none" else variant.mixer,
               "beta": 0.0 if variant is None else variant.beta, "groups": 0, "fraction": 0.0, "replaced": []}
        if variant is not None:
            record = json.loads((Unit("variant", unit.task, unit.seed, variant, unit.home).path / "unit.json").read_text())
            row.update(groups=record["groups"], fraction=record["fraction"], replaced=record["spec"]["groups"],
                       replaced_recency=record["replaced_recency"],
                       accuracy_converted=record["accuracy_converted"], accuracy_transfer=record["accuracy_transfer"],
                       train_s=record["elapsed_s"])
        for scale in study.scales:
            at = result[f"x{scale}"]
            row[f"accuracy_x{scale}"] = at["accuracy"]
            row[f"example_accuracy_x{scale}"] = at["example_accuracy"]
            row[f"cache_bytes_x{scale}"] = at["cache"]["bytes"]
            row[f"tokens_x{scale}"] = at["cache"]["tokens"]
        first = result["x1"]["cache"]
        row["kv_bytes_per_token"] = first["kv_bytes"] / first["tokens"]
        row["state_bytes"] = first["state_bytes"]
        rows.append(row)
    return {"format": "recurformer-retrieval-study/1", "study": study.to_dict(), "base_models": bases, "rows": rows,
            "written": time.strftime("%Y-%m-%d %H:%M")}


def summarize(rows: list[dict], scales: tuple[int, ...]) -> list[dict]:
    """Rows grouped by (task, variant) over seeds: mean and sample std of each accuracy."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["task"], row["variant"]), []).append(row)
    out = []
    for (task, name), members in groups.items():
        first = members[0]
        entry = {k: first[k] for k in ("task", "variant", "selector", "mixer", "beta", "groups", "fraction",
                                       "kv_bytes_per_token", "state_bytes")}
        entry["seeds"] = sorted(r["seed"] for r in members)
        entry["replaced"] = [r["replaced"] for r in sorted(members, key=lambda r: r["seed"])]
        for key in ("replaced_recency", "accuracy_transfer"):
            values = [r[key] for r in members if r.get(key) is not None]
            entry[key] = statistics.fmean(values) if values else None
        for scale in scales:
            values = [r[f"accuracy_x{scale}"] for r in members]
            entry[f"mean_x{scale}"] = statistics.fmean(values)
            entry[f"std_x{scale}"] = statistics.stdev(values) if len(values) > 1 else None
            entry[f"cache_bytes_x{scale}"] = first[f"cache_bytes_x{scale}"]
        out.append(entry)
    return out


ORDER = {"original": 0, "none": 1, "recency": 2, "random": 3, "inverse": 4, "layer": 5, "all": 6}


def sort_key(entry: dict) -> tuple:
    return (entry["beta"], entry["mixer"], ORDER[entry["selector"]])


def cell(entry: dict, scale: int) -> str:
    mean, std = entry[f"mean_x{scale}"], entry[f"std_x{scale}"]
    return f"{mean:.3f}" if std is None else f"{mean:.3f} ± {std:.3f}"


def table(entries: list[dict], scales: tuple[int, ...]) -> list[str]:
    head = ["selection", "mixer", "beta", "groups (fraction)", "RR of replaced", "1x after transfer"]
    head += [f"accuracy {s}x" for s in scales]
    head += ["KV B/token", "state B", f"cache B at {scales[-1]}x", "seeds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in sorted(entries, key=sort_key):
        lines.append("| " + " | ".join([
            e["selector"], e["mixer"], f"{e['beta']:.2f}", f"{e['groups']} ({e['fraction']:.2f})",
            "-" if e["replaced_recency"] is None else f"{e['replaced_recency']:.3f}",
            "-" if e["accuracy_transfer"] is None else f"{e['accuracy_transfer']:.3f}",
            *[cell(e, s) for s in scales], f"{e['kv_bytes_per_token']:.0f}", f"{e['state_bytes']:,}",
            f"{e[f'cache_bytes_x{scales[-1]}']:,}", ",".join(map(str, e["seeds"])),
        ]) + " |")
    return lines


def find(entries: list[dict], task: str, selector: str, mixer: str, beta: float) -> dict | None:
    return next((e for e in entries if e["task"] == task and e["selector"] == selector
                 and e["mixer"] in (mixer, "-") and e["beta"] == beta), None)


def paired(entries: list[dict], task: str, mixer: str, other: str) -> list[tuple[dict, dict]]:
    """(recency entry, `other` entry) at every partial beta where both exist."""
    betas = sorted({e["beta"] for e in entries if e["task"] == task and e["mixer"] == mixer and 0 < e["beta"] < 1})
    pairs = [(find(entries, task, "recency", mixer, b), find(entries, task, other, mixer, b)) for b in betas]
    return [(r, o) for r, o in pairs if r and o]


def tally(pairs: list[tuple[dict, dict]], scale: int, margin: float) -> str:
    """How often recency is ahead or behind by more than `margin`, level, or replaced the very
    same groups; and the mean gap over the pairs that replaced different groups."""
    same = [r["replaced"] == o["replaced"] for r, o in pairs]
    gaps = [r[f"mean_x{scale}"] - o[f"mean_x{scale}"] for (r, o), s in zip(pairs, same) if not s]
    text = (f"ahead {sum(g > margin for g in gaps)}, behind {sum(g < -margin for g in gaps)}, "
            f"level (within {margin}) {sum(abs(g) <= margin for g in gaps)}")
    if any(same):
        text += f", same groups replaced {sum(same)}"
    return text + (f" (mean gap {statistics.fmean(gaps):+.3f})" if gaps else "")


def comparison(study: Study, entries: list[dict], task: str, mixer: str, other: str) -> str | None:
    """Recency selection against `other` at each partial beta: who is ahead at 1x and at the
    longest length, whether the caches are equal, and whether the headline gap exceeds the spread."""
    top = study.scales[-1]
    pairs = paired(entries, task, mixer, other)
    if not pairs:
        return None
    detail = "; ".join(f"beta {r['beta']:.2f}: {r['mean_x1']:.3f} vs {o['mean_x1']:.3f} at 1x, "
                       f"{r[f'mean_x{top}']:.3f} vs {o[f'mean_x{top}']:.3f} at {top}x" for r, o in pairs)
    # The window mixer's state holds per-layer bookkeeping (slot positions), so spreading the
    # same groups over other layers changes its size by a few bytes: that still counts as equal.
    unequal = [f"beta {r['beta']:.2f}: {r['cache_bytes_x1']:,} vs {o['cache_bytes_x1']:,} B" for r, o in pairs
               if abs(r["cache_bytes_x1"] - o["cache_bytes_x1"]) > 0.01 * r["cache_bytes_x1"]]
    cache = "equal cache (within 1%)" if not unequal else "cache not equal (" + ", ".join(unequal) + ")"
    text = (f"over {len(pairs)} betas at {cache}, recency is at 1x {tally(pairs, 1, study.margin)}; "
            f"at {top}x {tally(pairs, top, study.margin)}. "
            f"{detail}")
    for r, o in pairs:
        if r["beta"] == study.headline_beta and r["std_x1"] is not None and o["std_x1"] is not None:
            for scale in (1, top):
                gap, spread = r[f"mean_x{scale}"] - o[f"mean_x{scale}"], r[f"std_x{scale}"] + o[f"std_x{scale}"]
                text += (f". Over {len(r['seeds'])} seeds at beta {r['beta']:.2f}, the {scale}x gap {gap:+.3f} is "
                         f"{'larger' if abs(gap) > spread else 'not larger'} than the two standard deviations summed "
                         f"({spread:.3f})")
    return text


def overall(study: Study, entries: list[dict]) -> list[str]:
    """One line per control: recency against it over every task, mixer and partial beta."""
    top, lines = study.scales[-1], []
    for other in ("random", "inverse", "layer"):
        pairs = [p for t in study.tasks for m in study.mixers for p in paired(entries, t.name, m, other)]
        if pairs:
            what = "whole layers ranked by recency" if other == "layer" else f"{other} selection"
            lines.append(f"- **Recency-selected groups vs {what}**, over {len(pairs)} (task, mixer, beta) cells: at 1x "
                         f"{tally(pairs, 1, study.margin)}; at {top}x {tally(pairs, top, study.margin)}.")
    return lines


def conclusions(study: Study, entries: list[dict]) -> list[str]:
    """Plain statements computed from the numbers: nothing here is typed in."""
    lines, top = [], study.scales[-1]
    for task in study.tasks:
        name = task.name
        reference = find(entries, name, "none", "-", 0.0)
        original = find(entries, name, "original", "-", 0.0)
        if original:
            lines.append(f"- **{name}, the original model**: {cell(original, 1)} at 1x, {cell(original, top)} at "
                         f"{top}x (its length generalization bounds every variant's).")
        if reference is None:
            continue
        for mixer in study.mixers:
            for other in ("random", "inverse", "layer"):
                text = comparison(study, entries, name, mixer, other)
                what = "whole layers ranked by recency (between-layer)" if other == "layer" else f"{other} selection"
                if text:
                    lines.append(f"- **{name}, {mixer}: recency-selected groups vs {what}**: {text}.")
            kept = sorted((e for e in entries if e["task"] == name and e["mixer"] == mixer and e["selector"] in ("recency", "all")),
                          key=sort_key)
            if kept:
                floor = reference["mean_x1"] - study.tolerance
                within = ", ".join(f"{e['beta']:.2f}" for e in kept if e["mean_x1"] >= floor)
                below = ", ".join(f"{e['beta']:.2f}" for e in kept if e["mean_x1"] < floor)
                verdict = (f"fine at beta {within or 'none of those tested'}; "
                           + (f"broken at beta {below}" if below else "broken at none of the betas tested"))
                lines.append(f"- **{name}, {mixer}: where recency selection breaks** (1x, more than {study.tolerance:.2f} "
                             f"below the beta-0 model's {reference['mean_x1']:.3f} after the same training): {verdict}.")
            full = find(entries, name, "all", mixer, 1.0)
            if full:
                lines.append(f"- **{name}, {mixer} in every group (beta 1)**: {cell(full, 1)} at 1x, {cell(full, top)} at "
                             f"{top}x, against {cell(reference, 1)} and {cell(reference, top)} for beta 0.")
    return lines


def pareto_plot(study: Study, entries: list[dict], path: Path) -> None:
    """Accuracy against cache bytes, one panel per task and length; the front is drawn."""
    scales = study.scales
    figure, axes = plt.subplots(len(study.tasks), len(scales), figsize=(4.2 * len(scales), 3.6 * len(study.tasks)),
                                squeeze=False)
    colors = {"original": "black", "none": "gray", "recency": "tab:blue", "random": "tab:orange",
              "inverse": "tab:red", "layer": "tab:green", "all": "tab:purple"}
    markers = {"-": "*", "mamba": "o", "window": "s"}
    for row, task in enumerate(study.tasks):
        mine = [e for e in entries if e["task"] == task.name]
        for col, scale in enumerate(scales):
            axis = axes[row][col]
            for e in mine:  # `layer` hollow and larger: it often replaced the same groups as `recency`
                hollow = e["selector"] == "layer"
                axis.scatter(e[f"cache_bytes_x{scale}"], e[f"mean_x{scale}"], marker=markers.get(e["mixer"], "^"),
                             s=60 if e["mixer"] == "-" or hollow else 30, alpha=0.85,
                             facecolors="none" if hollow else colors[e["selector"]], edgecolors=colors[e["selector"]])
            front, best = [], -1.0
            for e in sorted(mine, key=lambda e: (e[f"cache_bytes_x{scale}"], -e[f"mean_x{scale}"])):
                if e[f"mean_x{scale}"] > best:
                    best = e[f"mean_x{scale}"]
                    front.append((e[f"cache_bytes_x{scale}"], best))
            if front:
                axis.step(*zip(*front), where="post", color="black", linewidth=0.8, alpha=0.6)
            axis.set_xscale("log")
            axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            axis.set_ylim(-0.03, 1.03)
            axis.set_title(f"{task.name}, {scale}x training length ({task.seq_len * scale} tokens)", fontsize=9)
            axis.set_xlabel("cache bytes (KV + state), batch 1")
            axis.set_ylabel("answer accuracy")
    handles = [plt.Line2D([], [], color=c, marker="o", linestyle="", label=s, markerfacecolor="none" if s == "layer" else c)
               for s, c in colors.items()]
    handles += [plt.Line2D([], [], color="gray", marker=m, linestyle="", label=f"mixer {k}") for k, m in markers.items() if k != "-"]
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, bbox_to_anchor=(0.5, -0.02))
    figure.tight_layout(rect=(0, 0.04, 1, 1))
    save_figure(figure, path)


def render_readme(results: dict, study: Study, figures: list[str], complete: bool, reading: str | None = None) -> str:
    """README.md from results.json: setup, tables, plots, seeds and the computed conclusions,
    then `reading` (the hand-written interpretation kept in `reading.md` beside it) if given."""
    scales = study.scales
    entries = summarize(results["rows"], scales)
    s = results["study"]
    lines = ["# Retrieval study: which heads can go, and what is lost", "",
             f"Generated by `python -m benchmarks.retrieval.study` from `results.json` ({results['written']}). "
             + ("All planned units are finished." if complete else "**Partial: some planned units have not run yet**; "
                "run the script again to finish them."), "",
             "## Setup", "",
             f"- Base models: Llama architecture (rotary positions), {s['layers']} layers, hidden {s['hidden']}, "
             f"{s['heads']} query heads in {s['kv_heads']} KV groups per layer ({s['layers'] * s['kv_heads']} groups), "
             f"MLP {s['intermediate']}, q/k/v/o biases, trained from scratch on fresh problems, batch {s['batch_size']}, "
             f"lr {s['base_lr']} (warmup, then constant), loss on answer tokens only, until the accuracy on held-out "
             f"validation problems reaches {s['base_solved']} (checked every {s['base_check_every']} steps, at most "
             f"{s['base_max_steps']} steps)."]
    for task in study.tasks:
        start = f" Training starts from the `{task.warm_start}` model of the same seed." if task.warm_start else ""
        lines.append(f"- Task `{task.name}`: {task.describe()}. At k x the length, k x the pairs/chains/queries.{start}")
    lines += [
        f"- Heads scored with `recurformer.scoring.analyze` on {s['analyze_sequences']} task sequences, recency window "
        f"w = {s['recency_window']} tokens. Selections: `recency` (paper), `random`, `inverse` (least recent first), "
        "`layer` (whole layers, ranked by the mean recency of their groups; Jamba/Samba-style between-layer hybrid). "
        "`none` is beta 0 (no replacement), `all` is beta 1 (a fully recurrent model for mamba).",
        f"- Mixers: {', '.join(f'`{m}`' for m in study.mixers)}"
        + (f" (window mixer span {s['mixer_window']} tokens)" if "window" in study.mixers else "") + ".",
        f"- Continual training, identical for every variant: transfer stage {s['transfer_steps']} steps (lr "
        f"{s['transfer_lr']}; skipped at beta 0, nothing to transfer), then lm stage {s['lm_steps']} steps (lr "
        f"{s['lm_lr']}, all weights trainable, loss on answer tokens), batch {s['continual_batch_size']}.",
        f"- Evaluation: {s['eval_examples']} held-out problems (seed {EVAL_SEED} + scale) at {', '.join(f'{k}x' for k in scales)} "
        "the training length; accuracy over answer tokens. Cache bytes measured from the model's cache "
        "(`HybridCache.nbytes()`; a `DynamicCache` for the original) after a forward over one problem, fp32.",
        f"- Seeds: {', '.join(map(str, s['seeds']))}. The first seed runs the whole grid; the others rerun, from a new "
        f"base model, beta 0 and the headline rows ({', '.join(s['headline_selectors'])} at beta {s['headline_beta']}). "
        "Accuracy cells show the mean ± sample standard deviation over the seeds listed in the row.",
        "- Columns: `RR of replaced` is the mean recency ratio of the replaced groups (what the scorer chose); "
        "`1x after transfer` is the accuracy after the transfer stage alone (only the mixers trained, to imitate the "
        "replaced heads; the rest frozen): which heads can go without the others adapting. The accuracy columns are "
        "after the whole continual training. `KV B/token` and `state B` are measured at 1x; the last cache column "
        "is the total at the longest length.",
        "", "## Base models", "",
        "| task | seed | parameters | steps | solved | validation accuracy | test accuracy 1x | group RR min - max | minutes |",
        "|---|---|---|---|---|---|---|---|---|"]
    for b in results["base_models"]:
        lines.append(f"| {b['task']} | {b['seed']} | {b['parameters']:,} | {b['steps']} | {'yes' if b['solved'] else '**no**'} | "
                     f"{b['validation_accuracy']:.3f} | {b['accuracy_x1']:.3f} | "
                     f"{b['group_recency_min']:.3f} - {b['group_recency_max']:.3f} | {b['elapsed_s'] / 60:.1f} |")
    floors = {b["task"]: b["uniform_recency"] for b in results["base_models"]}
    if floors:
        lines += ["", "A head attending uniformly over its prefix has RR = "
                  + ", ".join(f"{v:.3f} on {k}" for k, v in floors.items())
                  + f" (w = {s['recency_window']}): groups near that value are not recency aware in the paper's sense."]
    for task in study.tasks:
        mine = [e for e in entries if e["task"] == task.name]
        if mine:
            lines += ["", f"## {task.name}", ""] + table(mine, scales)
    lines += ["", "## Accuracy against cache size", ""] + [f"![{f}]({f})" for f in figures]
    lines += ["", "## Conclusions (computed from the table)", ""] + overall(study, entries)
    lines += conclusions(study, entries) or ["- No results yet."]
    if reading:
        lines += ["", "## What it means", "", "(Hand-written from the numbers above; kept in `reading.md`.)", "",
                  reading.strip()]
    lines += ["", "## Files", "",
              "- `results.json`: `rows`, one per (task, seed, variant): `accuracy_x{k}`, `example_accuracy_x{k}`, "
              "`cache_bytes_x{k}` and `tokens_x{k}` per scale k, `kv_bytes_per_token`, `state_bytes`, `groups`, "
              "`fraction` (replaced groups / all groups; the actual fraction for `layer`), `replaced` ([layer, kv_head] "
              "pairs), `replaced_recency` (mean RR of "
              "the replaced groups), `accuracy_converted` and "
              "`accuracy_transfer` (1x, right after surgery and after the transfer stage), `train_s`; "
              "`base_models`; `study` (every setting).",
              "- `pareto.png`: accuracy against cache bytes; `heads-<task>.png`: recency ratio per head of the "
              "first seed's base model, X on the groups replaced by recency at the headline beta."]
    return "\n".join(lines) + "\n"


def write_report(study: Study, units: list[Unit], out: Path) -> dict:
    results = collect(study, units)
    write_json_atomic(out / "results.json", results)
    entries = summarize(results["rows"], study.scales)
    figures = []
    if entries:
        pareto_plot(study, entries, out / "pareto.png")
        figures.append("pareto.png")
    for task in study.tasks:
        home = next(u.home for u in units if u.task == task and u.seed == study.seeds[0])
        scores_path = home / "base" / "scores.json"
        if scores_path.exists():
            scores = HeadScores.load(scores_path)
            plot_head_heatmap(scores, out / f"heads-{task.name}.png", select_heads(scores, study.headline_beta, make_scorer("recency")))
            figures.append(f"heads-{task.name}.png")
    complete = all(u.path.exists() for u in units)
    reading = (out / "reading.md").read_text() if (out / "reading.md").is_file() else None
    write_text_atomic(out / "README.md", render_readme(results, study, figures, complete, reading))
    return results

