"""Streams at a fixed memory budget (docs/results/streaming.md): the conversion against decoding-time
eviction, every row holding the same bytes at every point of the stream.

Every row reads the same streams (`recurformer eval --task stream`: held-out text with a machine
log, fed `--chunk` tokens at a time) and holds at most `budget` x the original's cache at the
stream's end at any point (kept KV, window, sinks and states all counted; the evaluator checks
its peak):

- `original`: the full cache (the ceiling, at 1.0);
- `<press>@<budget>`: the original with a decoding-time press on every head (`recurformer.eviction`:
  `streaming` is StreamingLLM, then knorm, keydiff, tova, snapkv, expected-attention);
- `window+<press>@<budget>`: the training-free `window` on the conversion's groups at the
  conversion's bytes (`recurformer.equal_cache`; the groups are the ones the ablation scorer
  replaces, so this is DuoAttention-style: retrieval heads keep their cache, the others a
  window with sinks), its kept heads capped by the best press on the original at that budget;
- `conversion+<press>@<budget>`: the trained conversion, its kept heads capped the same way;
- `conversion`: the trained conversion uncapped, at its own bytes.

The rule of issue 63: a log event kind counts only where the original with its full cache
answers at least 60% of it; the script stops, naming the kinds to keep, where one does not.
Intervals (90%) resample streams, paired between rows (`recurformer.evaluate.bootstrap`).
Rows are kept in `runs/streaming-rows/` (one JSON each): a rerun measures only what is missing.

    python -m benchmarks.long_context.streaming --converted runs/demo/final --streams 40
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from recurformer.config import parse_choices
from recurformer.equal_cache import window_baseline
from recurformer.errors import RecurformerError
from recurformer.evaluate.bootstrap import paired_interval
from recurformer.evaluate.stream import StreamOptions, evaluate, parse_kinds, per_stream
from recurformer.eviction import PRESSES
from recurformer.files import atomic_file, write_json_atomic, write_text_atomic
from recurformer.loading import load_converted, load_teacher
from recurformer.tasks.stream import bin_names

from benchmarks.common import HELD_OUT, RESULTS, ROOT

SCHEMA = "recurformer-streaming/1"
ROWS = ROOT / "runs" / "streaming-rows"
KEEP_KIND = 60.0  # the original's full-cache accuracy a kind needs to count (issue 63)


def measure(name: str, model, tokenizer, options: StreamOptions, rows: Path, converted: str) -> dict:
    """Row `name` (from `rows/<name>.json` if it was measured with the same options, beside the
    same conversion `converted`)."""
    path = rows / f"{name}.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved["options"] == asdict(options) and saved["converted"] == converted:
            return saved
    result = evaluate(model, tokenizer, options)
    row = {"options": asdict(options), "converted": converted, "per_stream": per_stream(result["records"]),
           **{k: v for k, v in result.items() if k != "records"},
           "free": [r["free"] for r in result["records"]]}
    write_json_atomic(path, row)
    return row


def portable(row: dict) -> dict:
    """A row as the results show it: its texts named by file name, not where they lay here."""
    options = {**row["options"], "data": [Path(p).name for p in row["options"]["data"]]}
    return {**{k: v for k, v in row.items() if k not in ("per_stream", "converted")}, "options": options}


def check_kinds(original: dict, kinds: tuple[str, ...]) -> None:
    weak = {k: v["accuracy"] for k, v in original["summary"]["by_kind"].items() if v["accuracy"] < KEEP_KIND}
    if weak:
        keep = [k for k in kinds if k not in weak]
        shown = ", ".join(f"{k} {v:.0f}%" for k, v in weak.items())
        raise SystemExit(f"streaming: the original with its full cache answers {shown}, below {KEEP_KIND:.0f}%: "
                         f"keep --kinds {','.join(keep) or '(none)'}")


def comparisons(rows: dict, budgets: list[float]) -> list[dict]:
    """The paired differences the doc states: at each budget, the conversion against the best
    press, the window and the full original."""
    out = []
    for budget in budgets:
        presses = [f"{p}@{budget}" for p in PRESSES if f"{p}@{budget}" in rows]
        best = max(presses, key=lambda name: rows[name]["headline"])
        conversion = next(name for name in rows if name.startswith("conversion+") and name.endswith(f"@{budget}"))
        window = next(name for name in rows if name.startswith("window+") and name.endswith(f"@{budget}"))
        for other in (best, window, "original"):
            difference, low, high = paired_interval([rows[conversion]["per_stream"]], [rows[other]["per_stream"]])
            out.append({"budget": budget, "row": conversion, "against": other, "difference": difference,
                        "low": low, "high": high})
    return out


def _cell(summary: dict, *path: str) -> str:
    value = summary
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return "" if value is None else f"{value:.1f}"


def markdown(data: dict) -> str:
    rows, setup = data["rows"], data["setup"]
    lines = ["# Streams at a fixed memory budget", "",
             "Written by `benchmarks/long_context/streaming.py` (what it compares and how: its docstring; the task: "
             "`docs/tasks.md`, `stream`; what it means: `docs/where-it-wins.md`). Rows: `original` (full cache), "
             "`<press>@<budget>` (the original with that press on every head), `window+<press>@<budget>` (the "
             f"training-free window of {setup['window']} + sinks on the conversion's groups, DuoAttention-style, its "
             "kept heads capped by the best press), `conversion+<press>@<budget>` (the trained conversion "
             f"`{setup['converted']}`, its kept heads capped the same way) and `conversion` (uncapped, at its own "
             "bytes).", "",
             f"Streams of {setup['tokens']:,} tokens (held-out text, {setup['streams']} streams, seed "
             f"{setup['seed']}, log events {setup['kinds']}), fed {setup['chunk']} tokens at a time; every capped row "
             "holds at most its budget at every point. Accuracy: teacher-forced answers right (0-100), 90% interval "
             "over streams. Free: the last check completed greedily, exact match.", "",
             "| row | peak bytes / original's | accuracy | " + " | ".join(setup["kinds"].split(",")) +
             " | changed: latest | stale | free | mean log-prob |",
             "|---|---|---|" + "---|" * len(setup["kinds"].split(",")) + "---|---|---|---|"]
    for name, row in rows.items():
        s = row["summary"]
        lines.append(f"| {name} | {row['peak_bytes'] / row['original_bytes']:.3f} | {s['accuracy']['mean']:.1f} "
                     f"[{s['accuracy']['low']:.1f}, {s['accuracy']['high']:.1f}] | "
                     + " | ".join(_cell(s, "by_kind", k, "accuracy") for k in setup["kinds"].split(","))
                     + f" | {_cell(s, 'overwritten', 'accuracy')} | {_cell(s, 'overwritten', 'stale')} | "
                     f"{s['free']['exact']:.1f} | {s['logprob']:.3f} |")
    lines += ["", "Accuracy by distance (tokens since the value last appeared in the stream; answers in each bin):", "",
              "| row | " + " | ".join(bin_names()) + " |", "|---|" + "---|" * len(bin_names())]
    for name, row in rows.items():
        cells = [row["summary"]["by_distance"][b] for b in bin_names()]
        lines.append(f"| {name} | " + " | ".join(f"{c['accuracy']:.1f} (n={c['n']})" if c["n"] else "" for c in cells)
                     + " |")
    lines += ["", "Paired differences (the conversion capped by the best press, minus the other row; 90% interval "
              "over streams):", "", "| budget | conversion | against | difference | interval |", "|---|---|---|---|---|"]
    for c in data["comparisons"]:
        lines.append(f"| {c['budget']:g} | {c['row']} | {c['against']} | {c['difference']:+.1f} | "
                     f"[{c['low']:+.1f}, {c['high']:+.1f}] |")
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = data["setup"]["budgets"]
    figure, axes = plt.subplots(1, len(budgets), figsize=(6 * len(budgets), 4), sharey=True, squeeze=False)
    bins = bin_names()
    for axis, budget in zip(axes[0], budgets):
        for name, row in data["rows"].items():
            if name == "original" or name.endswith(f"@{budget}"):
                cells = [row["summary"]["by_distance"][b] for b in bins]
                axis.plot(bins, [c.get("accuracy") for c in cells], marker="o", label=name,
                          linewidth=2.5 if name.startswith("conversion") else 1.2)
        axis.set_title(f"budget {budget:g} of the original's cache at the end")
        axis.set_xlabel("tokens since the value last appeared")
    axes[0][0].set_ylabel("answers right (%)")
    axes[0][-1].legend(fontsize=7)
    figure.tight_layout()
    with atomic_file(path) as temporary:
        figure.savefig(temporary, format="png", dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--converted", required=True, help="the trained conversion (a run's final/)")
    parser.add_argument("--streams", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--kinds", default="set,count,append")
    parser.add_argument("--budgets", default="0.5,0.25")
    parser.add_argument("--presses", default=",".join(p for p in PRESSES if p != "knorm"),
                        help="the presses on the original (knorm, the weakest at prefill, is left out by default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", default=str(ROWS), help="where each row's JSON is kept")
    parser.add_argument("--out", default=str(RESULTS / "streaming"), help="writes OUT.json, OUT.md and OUT.png")
    args = parser.parse_args(argv)
    try:
        kinds = parse_kinds(args.kinds)
        budgets = [float(b) for b in args.budgets.split(",")]
        presses = list(parse_choices(args.presses, "--presses", PRESSES))
        converted, tokenizer = load_converted(args.converted)
        original = load_teacher(converted)
        rows_dir, identity = Path(args.rows), str(Path(args.converted).resolve())

        def options(press: str = "none", budget: float | None = None) -> StreamOptions:
            return StreamOptions(data=[str(HELD_OUT)], tokens=args.tokens, streams=args.streams, chunk=args.chunk,
                                 kinds=",".join(kinds), press=press, budget=budget, seed=args.seed)

        rows = {"original": measure("original", original, tokenizer, options(), rows_dir, identity)}
        check_kinds(rows["original"], kinds)
        rows["conversion"] = measure("conversion", converted, tokenizer, options(), rows_dir, identity)
        window, size = window_baseline(original, converted)
        for budget in budgets:
            for press in presses:
                rows[f"{press}@{budget}"] = measure(f"{press}@{budget}", original, tokenizer, options(press, budget),
                                                    rows_dir, identity)
            best = max(presses, key=lambda p: rows[f"{p}@{budget}"]["headline"])
            for prefix, model in (("conversion", converted), ("window", window)):
                name = f"{prefix}+{best}@{budget}"
                rows[name] = measure(name, model, tokenizer, options(best, budget), rows_dir, identity)
    except RecurformerError as error:
        print(f"streaming: {error}", file=sys.stderr)
        return 2
    data = {"schema": SCHEMA, "setup": {"converted": Path(args.converted).name, "streams": args.streams,
                                        "tokens": args.tokens, "chunk": args.chunk, "kinds": ",".join(kinds),
                                        "budgets": budgets, "presses": presses, "seed": args.seed, "window": size},
            "rows": {name: portable(row) for name, row in rows.items()},
            "comparisons": comparisons(rows, budgets)}
    out = Path(args.out)
    write_json_atomic(out.with_suffix(".json"), data)
    write_text_atomic(out.with_suffix(".md"), markdown(data))
    plot(data, out.with_suffix(".png"))
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
