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
Each row's streams are kept in `runs/streaming-rows/` (one JSON a row) as they are measured: a
rerun, or one with more `--streams`, measures only the streams missing.

With `--kvpress FILE` (default: `docs/results/long-context/stream-kvpress.json`, if there) the
page adds a cross-check: kvpress's own `DecodingPress` rows (`benchmarks/peers/README.md`)
against our rows of the same press on the same streams, found in `--kvpress-rows`.

    python -m benchmarks.long_context.streaming --converted runs/demo/final --streams 72
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from recurformer.checks import read_json_object
from recurformer.config import parse_choices
from recurformer.equal_cache import window_baseline
from recurformer.errors import RecurformerError
from recurformer.evaluate.bootstrap import paired_interval
from recurformer.evaluate.stream import StreamOptions, evaluate, parse_kinds, per_stream
from recurformer.eviction import PRESSES
from recurformer.files import atomic_file, write_json_atomic, write_text_atomic
from recurformer.loading import load_converted, load_teacher
from recurformer.tasks.stream import DIALS, bin_names

from benchmarks.common import HELD_OUT, RESULTS, ROOT, budget_fractions

SCHEMA = "recurformer-streaming/1"
ROWS = ROOT / "runs" / "streaming-rows"
KEEP_KIND = 60.0  # the original's full-cache accuracy a kind needs to count (issue 63)
MIN_PLOTTED = 10  # answers a distance bin needs to be drawn (the table shows every bin)


def measure(name: str, model, tokenizer, options: StreamOptions, rows: Path, converted: str) -> dict:
    """Row `name`. Each stream's record is kept in `rows/<name>.json` as it is measured, beside the
    options it was measured with (but `streams`) and the conversion `converted`: a rerun, or one
    with more streams, measures only the streams not kept (a stream depends on its index only)."""
    path, identity = rows / f"{name}.json", {"options": {**asdict(options), "streams": None}, "converted": converted}
    kept: dict[str, dict] = {}
    if path.is_file():
        saved = read_json_object(path, "row file")
        if all(saved.get(key) == value for key, value in identity.items()):
            kept = saved.get("records", {})

    def keep(index: int, record: dict) -> None:
        kept[str(index)] = record
        write_json_atomic(path, {**identity, "records": kept})

    known = {int(index): record for index, record in kept.items() if int(index) < options.streams}
    result = evaluate(model, tokenizer, options, known=known, on_record=keep)
    return {"options": asdict(options), "per_stream": per_stream(result["records"]),
            **{k: v for k, v in result.items() if k != "records"}, "free": [r["free"] for r in result["records"]]}


def portable(row: dict) -> dict:
    """A row as the results show it: its texts named by file name, not where they lay here."""
    options = {**row["options"], "data": [Path(p).name for p in row["options"]["data"]]}
    return {**{k: v for k, v in row.items() if k != "per_stream"}, "options": options}


def check_kinds(original: dict, kinds: tuple[str, ...]) -> None:
    weak = {k: v["accuracy"] for k, v in original["summary"]["by_kind"].items() if v["accuracy"] < KEEP_KIND}
    if weak:
        keep = [k for k in kinds if k not in weak]
        shown = ", ".join(f"{k} {v:.0f}%" for k, v in weak.items())
        raise SystemExit(f"streaming: the original with its full cache answers {shown}, below {KEEP_KIND:.0f}%: "
                         f"keep --kinds {','.join(keep) or '(none)'}")


def comparisons(rows: dict, budgets: list[float]) -> list[dict]:
    """The paired differences the doc states: at each budget, the conversion against every
    press (the best first), the window and the full original."""
    out = []
    for budget in budgets:
        presses = sorted((f"{p}@{budget}" for p in PRESSES if f"{p}@{budget}" in rows),
                         key=lambda name: -rows[name]["headline"])
        conversion = next(name for name in rows if name.startswith("conversion+") and name.endswith(f"@{budget}"))
        window = next(name for name in rows if name.startswith("window+") and name.endswith(f"@{budget}"))
        for other in (*presses, window, "original"):
            difference, low, high = paired_interval([rows[conversion]["per_stream"]], [rows[other]["per_stream"]])
            out.append({"budget": budget, "row": conversion, "against": other, "difference": difference,
                        "low": low, "high": high})
    return out


KVPRESS_NAMES = {"streaming-llm": "streaming"}  # kvpress's press names that are not ours


def _stream_mean(per_stream: list[list[float]]) -> float:
    """The headline's mean: each stream's accuracy, the streams weighed alike."""
    return sum(sum(s) / len(s) for s in per_stream) / len(per_stream)


STREAM_FIELDS = ("tokens", "chunk", "kinds", "dials", "gap", "free_tokens", "seed")  # what makes the streams


def stream_identity(options: dict) -> dict:
    """What decides a row's streams (but their count): the options above and the text's file names."""
    return {**{k: options[k] for k in STREAM_FIELDS}, "data": [Path(p).name for p in options["data"]]}


def row_per_stream(path: Path, streams: dict) -> list[list[float]] | None:
    """Our row's answers stream by stream from its file in a rows folder, if it was measured on the
    streams `streams` (`stream_identity`) describe; None otherwise."""
    if not path.is_file():
        return None
    saved = read_json_object(path, "row file")
    if stream_identity(saved["options"]) != streams:
        return None
    if "records" not in saved:  # written before the streams were kept one by one: the row's result
        return saved["per_stream"]
    records = saved["records"]
    return per_stream([records[str(i)] for i in range(len(records)) if str(i) in records])


def read_kvpress(path: Path) -> dict | None:
    """kvpress's `DecodingPress` rows (`benchmarks/peers/kvpress_eval.py --stream`) at `path`; None
    if there are none. Read before any row is measured: a damaged file is one line, not minutes later."""
    return read_json_object(path, "--kvpress") if path.is_file() else None


def kvpress_check(data: dict, source: str, rows: Path) -> list[dict]:
    """kvpress's own `DecodingPress` around each press (`data`, read from the file `source` by
    `read_kvpress`, on the streams of `benchmarks/peers/stream_problems.py`) against our row of the
    same press and budget in the rows folder `rows`, on the streams both read, paired by stream; a
    row without ours on the same streams left out."""
    out = []
    for name, row in data["rows"].items():
        press, budget = name.split("@")
        ours_name = f"{KVPRESS_NAMES.get(press, press)}@{float(budget)}"
        ours_per_stream = row_per_stream(rows / f"{ours_name}.json", stream_identity(data["options"]))
        streams = [row["streams"][str(i)]["units"] for i in range(len(row["streams"]))]
        if ours_per_stream is None or len(ours_per_stream) < len(streams):
            print(f"streaming: no row {ours_name} in {rows} on {source}'s streams; {name} left out", file=sys.stderr)
            continue
        theirs_per_stream = [[100.0 * u["correct"] for u in units] for units in streams if units]  # as per_stream
        ours_per_stream = ours_per_stream[:len(theirs_per_stream)]
        if [len(s) for s in theirs_per_stream] != [len(s) for s in ours_per_stream]:
            raise SystemExit(f"streaming: {source}'s {name} scored other checks than our {ours_name}")
        difference, low, high = paired_interval([theirs_per_stream], [ours_per_stream])
        out.append({"kvpress": name, "label": row["label"], "ours": ours_name, "streams": len(streams),
                    "dials": data["options"]["dials"], "kvpress_accuracy": _stream_mean(theirs_per_stream),
                    "ours_accuracy": _stream_mean(ours_per_stream), "difference": difference, "low": low,
                    "high": high, "peak_tokens": max(s["peak_tokens"] for s in row["streams"].values())})
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
             f"{setup['seed']}, log events {setup['kinds']}, {setup['dials']} dial(s)), fed {setup['chunk']} tokens at a time; every capped row "
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
    if data.get("kvpress"):
        c = data["kvpress"][0]
        lines += ["", "Cross-check: kvpress's own `DecodingPress` around each press (compressing after every forward "
                  "to the tokens our row keeps; `benchmarks/peers/kvpress_eval.py --stream`), on the first "
                  f"{c['streams']} streams with {c['dials']} dials, against our row of the same press on them; answers "
                  "right, and kvpress minus ours with its 90% interval paired by stream:", "",
                  "| kvpress | streams | most tokens held | kvpress | ours | difference | interval |",
                  "|---|---|---|---|---|---|---|"]
        for c in data["kvpress"]:
            lines.append(f"| {c['label']} | {c['streams']} | {c['peak_tokens']:,} | {c['kvpress_accuracy']:.1f} | "
                         f"{c['ours_accuracy']:.1f} ({c['ours']}) | {c['difference']:+.1f} | "
                         f"[{c['low']:+.1f}, {c['high']:+.1f}] |")
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = data["setup"]["budgets"]
    figure, axes = plt.subplots(1, len(budgets), figsize=(6 * len(budgets), 4), sharey=True, squeeze=False)
    by_distance = data["rows"]["original"]["summary"]["by_distance"]  # every row scores the same checks
    counts = {b: by_distance[b]["n"] for b in bin_names()}
    bins = [b for b in bin_names() if counts[b] >= MIN_PLOTTED]
    ticks = [f"{b}\n(n={counts[b]})" for b in bins]
    for axis, budget in zip(axes[0], budgets):
        for name, row in data["rows"].items():
            if name == "original" or name.endswith(f"@{budget}"):
                cells = [row["summary"]["by_distance"][b] for b in bins]
                axis.plot(ticks, [c.get("accuracy") for c in cells], marker="o", label=name,
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
    parser.add_argument("--streams", type=int, default=72,
                        help="streams (72 make the conversion-minus-best-press intervals +/- 3 or less)")
    parser.add_argument("--tokens", type=int, default=3072)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--kinds", default="set,count",
                        help="log events (append is left out: the original answers 33%% of it)")
    parser.add_argument("--budgets", default="0.5,0.25")
    parser.add_argument("--presses", default=",".join(p for p in PRESSES if p != "knorm"),
                        help="the presses on the original (knorm, the weakest at prefill, is left out by default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", default=str(ROWS), help="where each row's JSON is kept")
    parser.add_argument("--out", default=str(RESULTS / "streaming"), help="writes OUT.json, OUT.md and OUT.png")
    parser.add_argument("--kvpress", default=str(RESULTS / "long-context" / "stream-kvpress.json"),
                        help="kvpress's DecodingPress rows to cross-check ours with, if the file is there")
    parser.add_argument("--kvpress-rows", help="where our rows on kvpress's streams are (default: --rows)")
    parser.add_argument("--dials", type=int, default=DIALS, help="dials in each stream")
    args = parser.parse_args(argv)
    try:
        kinds = parse_kinds(args.kinds)
        budgets = budget_fractions(args.budgets)
        presses = list(parse_choices(args.presses, "--presses", PRESSES))

        def options(press: str = "none", budget: float | None = None) -> StreamOptions:
            return StreamOptions(data=[str(HELD_OUT)], tokens=args.tokens, streams=args.streams, chunk=args.chunk,
                                 kinds=",".join(kinds), press=press, budget=budget, dials=args.dials, seed=args.seed)

        for budget in budgets:  # every row's options checked before the first row's minutes
            options(presses[0], budget)
        kvpress = read_kvpress(Path(args.kvpress))
        converted, tokenizer = load_converted(args.converted)
        original = load_teacher(converted)
        rows_dir, identity = Path(args.rows), str(Path(args.converted).resolve())
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
        cross_check = kvpress_check(kvpress, Path(args.kvpress).name, Path(args.kvpress_rows or args.rows)) \
            if kvpress else []
    except RecurformerError as error:
        print(f"streaming: {error}", file=sys.stderr)
        return 2
    data = {"schema": SCHEMA, "setup": {"converted": Path(args.converted).name, "streams": args.streams,
                                        "tokens": args.tokens, "chunk": args.chunk, "kinds": ",".join(kinds),
                                        "budgets": budgets, "presses": presses, "seed": args.seed, "window": size,
                                        "dials": args.dials},
            "rows": {name: portable(row) for name, row in rows.items()},
            "comparisons": comparisons(rows, budgets),
            "kvpress": cross_check}
    out = Path(args.out)
    write_json_atomic(out.with_suffix(".json"), data)
    write_text_atomic(out.with_suffix(".md"), markdown(data))
    plot(data, out.with_suffix(".png"))
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
