"""The retrieval tables of docs/results/long-context.md ("Retrieval at equal cache bytes"), from our
rows (`ruler_ours.py`) and kvpress's (`benchmarks/peers/kvpress_eval.py --ruler`), and the plot
of RULER-4K score against cache fraction per method.

Every completion is scored here, RULER problems by RULER's string match (`score_ruler`),
passkey problems by our task's rule (`parse_key`), so all rows are scored alike. The
*headline* is the mean over the tasks where the original scores at least 30%; its 90%
interval is a bootstrap over the problems (resampled within each task, the same draws for
every row, so `--compare A,B` gives the interval of the difference of two rows). The tables
replace the part of `--doc` between `<!-- ruler-tables:begin -->` and `<!-- ruler-tables:end -->`.

    python -m benchmarks.peers.ruler_table
    python -m benchmarks.peers.ruler_table --compare conversion@0.5,kvzip@0.5
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from recurformer.errors import RecurformerError
from recurformer.files import atomic_file, write_text_atomic
from recurformer.tasks.passkey import parse_key
from recurformer.tasks.ruler import score_ruler

from benchmarks.common import RESULTS as ALL_RESULTS
from benchmarks.peers.table import TableError, read_rows_file

RESULTS = ALL_RESULTS / "long-context"
SCHEMA = "recurformer-ruler-rows/1"
HEADLINE_FLOOR = 30.0  # a task enters the headline when the original scores at least this
BOOTSTRAP_ROUNDS, BOOTSTRAP_SEED, LEVEL = 2000, 0, 0.90
BEGIN, END = "<!-- ruler-tables:begin -->", "<!-- ruler-tables:end -->"
KIND_NAMES = {"original": "original", "conversion": "our conversion (trained)", "window": "our `window`, no training",
              "duo": "DuoAttention-style", "duo-retrieval": "DuoAttention-style, retrieval-probe groups",
              "streaming": "StreamingLLM", "expected-attention": "kvpress ExpectedAttention",
              "snapkv": "kvpress SnapKV", "kvzip": "kvpress KVzip", "tova": "kvpress TOVA", "knorm": "kvpress Knorm"}


def load(path: Path, what: str, schema: str = SCHEMA) -> dict:
    """The contents of a rows file of `schema` (this table's by default)."""
    return read_rows_file(path, what, schema)


def split_budget(name: str) -> tuple[float, str]:
    """A budget's name is the cache fraction it stands for, optionally with a tag that tells
    two models of one fraction apart: '0.25' -> (0.25, ''),
    '0.25-ablation-retrieval' -> (0.25, 'ablation-retrieval')."""
    fraction, _, tag = name.partition("-")
    try:
        value = float(fraction)
    except ValueError:
        value = -1.0
    if not 0 < value < 1 or name.endswith("-"):
        raise TableError(f"budget {name!r}: a budget is named by its cache fraction in (0, 1), optionally "
                         "followed by -TAG (e.g. 0.25 or 0.25-ablation-retrieval)")
    return value, tag


def kind_name(kind: str, budget: str | None = None) -> str:
    """The method's name in the plot's legend (a tagged budget's rows are a method of their own)."""
    if kind.startswith("compose-global-"):
        name = f"our conversion + {KIND_NAMES[kind.removeprefix('compose-global-')]} on the kept heads, ranked together"
    elif kind.startswith("compose-"):
        name = f"our conversion + {KIND_NAMES[kind.removeprefix('compose-')]} on the kept heads"
    else:
        name = KIND_NAMES.get(kind, kind)
    tag = split_budget(budget)[1] if budget else ""
    return f"{name}, {tag}" if tag else name


def scores(row: dict, index: list[dict]) -> dict[int, float]:
    """Problem index -> score in [0, 1] of each answered problem."""
    out = {}
    for key, completion in row["completions"].items():
        problem = index[int(key)]
        out[int(key)] = (score_ruler(completion, problem["answers"]) if problem["kind"] == "ruler"
                         else float(parse_key(completion) == problem["answers"][0]))
    return out


def ruler_scores(row: dict, index: list[dict], tasks: list[str]) -> dict[str, float] | None:
    """Task -> score (0-100) over its problems; None unless every RULER problem is answered."""
    got = scores(row, index)
    wanted = [i for i, p in enumerate(index) if p["kind"] == "ruler"]
    if not wanted or any(i not in got for i in wanted):
        return None
    return {t: 100 * sum(got[i] for i in wanted if index[i]["task"] == t) /
            sum(1 for i in wanted if index[i]["task"] == t) for t in tasks}


def bootstrap_headlines(rows: list[dict[int, float]], index: list[dict], tasks: list[str],
                        rounds: int = BOOTSTRAP_ROUNDS, seed: int = BOOTSTRAP_SEED) -> list[list[float]]:
    """The headline (0-100) of each row in each of `rounds` resamplings of the problems: each
    task's problems drawn with replacement, the same draws for every row. `rows`: problem
    index -> score of each row. Returns [round][row]."""
    by_task = [[i for i, p in enumerate(index) if p["kind"] == "ruler" and p["task"] == t] for t in tasks]
    rng = random.Random(seed)
    samples = []
    for _ in range(rounds):
        draws = [rng.choices(problems, k=len(problems)) for problems in by_task]
        samples.append([100 * sum(sum(got[i] for i in draw) / len(draw) for draw in draws) / len(draws)
                        for got in rows])
    return samples


def interval(values: list[float], level: float = LEVEL) -> tuple[float, float]:
    """The central `level` interval of `values` (nearest-rank quantiles)."""
    ordered_values = sorted(values)
    tail = (1 - level) / 2
    low = ordered_values[int(tail * (len(values) - 1) + 0.5)]
    high = ordered_values[int((1 - tail) * (len(values) - 1) + 0.5)]
    return low, high


def merged(ours: dict, peers: dict | None) -> tuple[dict, dict[str, float], list[str]]:
    """Our rows and the peers' in one dict (each with its `kind`), the original's task scores,
    and the headline tasks (those the original scores at least `HEADLINE_FLOOR` on)."""
    if peers is not None and peers.get("problems") != ours.get("problems"):
        raise TableError(f"our rows and the peer rows were made on different problem sets "
                         f"({ours.get('problems')} and {peers.get('problems')})")
    rows = {**ours["rows"], **(peers or {}).get("rows", {})}
    for name, row in rows.items():
        row.setdefault("kind", "original" if name == "original" else name.split("@")[0])
    if "original" not in rows:
        raise TableError("our rows have no 'original' row, the reference of every ratio")
    original = ruler_scores(rows["original"], ours["index"], ours["tasks"])
    if original is None:
        raise TableError("the original has not answered every RULER problem yet")
    return rows, original, [t for t in ours["tasks"] if original[t] >= HEADLINE_FLOOR]


def compare(ours: dict, peers: dict | None, first: str, second: str) -> str:
    """One line: the two rows' headlines, their difference and its bootstrap interval."""
    index = ours["index"]
    rows, _, tasks = merged(ours, peers)
    point = []
    for name in (first, second):
        values = ruler_scores(rows[name], index, ours["tasks"]) if name in rows else None
        if values is None:
            raise TableError(f"--compare: row {name!r} does not exist or has not answered every RULER problem")
        point.append(sum(values[t] for t in tasks) / len(tasks))
    got = [scores(rows[name], index) for name in (first, second)]
    low, high = (round(v, 9) + 0.0 for v in interval([a - b for a, b in bootstrap_headlines(got, index, tasks)]))
    return (f"{first} {point[0]:.1f} - {second} {point[1]:.1f} = {point[0] - point[1]:+.1f} "
            f"({LEVEL:.0%} interval {low:+.1f} to {high:+.1f}, {BOOTSTRAP_ROUNDS} resamplings of the problems)")


def ordered(rows: dict) -> list[str]:
    """The original first, then the budgets, largest first, each in the order of `KIND_NAMES`
    (the compositions last)."""
    kinds = list(KIND_NAMES)

    def key(name: str):
        row = rows[name]
        if row["budget"] is None:
            return (0, 0.0, 0, name)
        return (1, -split_budget(row["budget"])[0], kinds.index(row["kind"]) if row["kind"] in kinds else len(kinds),
                name)

    return sorted(rows, key=key)


def render(ours: dict, peers: dict | None) -> tuple[str, dict]:
    """The Markdown tables and the points of the plot {method: [(fraction, headline)]}."""
    index, tasks = ours["index"], ours["tasks"]
    rows, original, headline_tasks = merged(ours, peers)
    ruler_context = next(str(p["context"]) for p in index if p["kind"] == "ruler")
    full = rows["original"]["cache"][ruler_context]
    per_task = {t: sum(1 for p in index if p["kind"] == "ruler" and p["task"] == t) for t in tasks}

    def headline(values: dict[str, float]) -> float:
        return sum(values[t] for t in headline_tasks) / len(headline_tasks)

    lines = [f"RULER at {int(ruler_context):,} tokens, {per_task[tasks[0]]} problems per task, score 0-100 "
             f"(RULER's string match). **Headline**: the mean over the tasks where the original scores at least "
             f"{HEADLINE_FLOOR:.0f} ({', '.join(headline_tasks)}: one problem is at most "
             f"{100 / len(headline_tasks) / min(per_task[t] for t in headline_tasks):.1f} points of it); *all*: the "
             f"mean over every task. *cache*: the row's bytes at this length over the original's. *{LEVEL:.0%} "
             f"interval*: of the headline, over {BOOTSTRAP_ROUNDS} resamplings of each task's problems; the rows "
             "answer the same problems, so a difference between two rows varies less than their intervals "
             "suggest (`ruler_table.py --compare A,B`).", "",
             "| row | method | cache | " + " | ".join(tasks) + f" | all | **headline** | vs original | "
             f"{LEVEL:.0%} interval |",
             "|---|---|---|" + "---|" * (len(tasks) + 4)]
    points: dict[str, list[tuple[float, float]]] = {}
    for name in ordered(rows):
        row = rows[name]
        values = ruler_scores(row, index, tasks)
        if values is None:
            continue
        fraction = row["cache"][ruler_context] / full
        top = headline(values)
        low, high = interval([sample[0] for sample in
                              bootstrap_headlines([scores(row, index)], index, headline_tasks)])
        points.setdefault(kind_name(row["kind"], row["budget"]), []).append((fraction, top))
        lines.append(f"| `{name}` | {row['labels'].get(ruler_context, '')} | {fraction:.3f} | "
                     + " | ".join(f"{values[t]:.0f}" for t in tasks)
                     + f" | {sum(values.values()) / len(tasks):.1f} | **{top:.1f}** | "
                     f"{top / headline(original):.0%} | {low:.1f}-{high:.1f} |")
    passkey = [i for i, p in enumerate(index) if p["kind"] == "passkey"]
    cells = sorted({(index[i]["context"], index[i]["depth"]) for i in passkey})
    contexts = sorted({c for c, _ in cells})
    lines += ["", "Passkey at equal bytes at each length (found / problems; depth: the fraction of the haystack "
              "before the key). *cache*: the row's bytes over the original's at each length.", "",
              "| row | " + " | ".join(f"{c:,} @ {d}" for c, d in cells) + " | " +
              " | ".join(f"cache {c:,}" for c in contexts) + " |",
              "|---|" + "---|" * (len(cells) + len(contexts))]
    for name in ordered(rows):
        row = rows[name]
        got = scores(row, index)
        if not passkey or any(i not in got for i in passkey):
            continue
        found = [f"{sum(got[i] for i in passkey if (index[i]['context'], index[i]['depth']) == cell):.0f}/"
                 f"{sum(1 for i in passkey if (index[i]['context'], index[i]['depth']) == cell)}" for cell in cells]
        lines.append(f"| `{name}` | " + " | ".join(found) + " | " +
                     " | ".join(f"{row['cache'][str(c)] / rows['original']['cache'][str(c)]:.3f}" for c in contexts)
                     + " |")
    return "\n".join(lines) + "\n", points


def write_section(doc: Path, begin: str, end: str, text: str) -> None:
    """Replace what stands between the lines `begin` and `end` of `doc` by `text`."""
    if not doc.is_file():
        raise TableError(f"--doc {doc} does not exist")
    content = doc.read_text()
    if content.count(begin) != 1 or content.count(end) != 1:
        raise TableError(f"{doc} needs one {begin} and one {end} line")
    head, rest = content.split(begin)
    write_text_atomic(doc, head + begin + "\n" + text + end + rest.split(end, 1)[1])


def plot(points: dict[str, list[tuple[float, ...]]], path: Path, ylabel: str = "RULER-4K headline (0-100)",
         xlabel: str = "cache bytes at 4K tokens / the original's") -> None:
    """Score against cache fraction, a line per method; points `(fraction, score)`, or
    `(fraction, score, low, high)` to draw each score's interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(11, 5.5))
    colors = plt.get_cmap("tab10").colors
    for number, (method, values) in enumerate(sorted(points.items())):
        values = sorted(values)  # more than ten methods: the next ten take the colors again with another marker
        errors = [[v[1] - v[2] for v in values], [v[3] - v[1] for v in values]] if len(values[0]) == 4 else None
        axes.errorbar([v[0] for v in values], [v[1] for v in values], yerr=errors, capsize=3,
                      marker="os^D"[number // 10 % 4], color=colors[number % 10],
                      linestyle="-" if method.startswith("our ") else "--", label=method)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: many methods
    figure.tight_layout()
    with atomic_file(path) as temporary:
        figure.savefig(temporary, format="png", dpi=120, bbox_inches="tight")
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ours", default=str(RESULTS / "ruler-ours.json"))
    parser.add_argument("--peers", default=str(RESULTS / "ruler-kvpress.json"))
    parser.add_argument("--doc", default=str(ALL_RESULTS / "long-context.md"))
    parser.add_argument("--plot", default=str(RESULTS / "ruler-4k.png"))
    parser.add_argument("--compare", metavar="A,B", help="print the headline difference of two rows and its "
                        "interval, and write nothing")
    args = parser.parse_args()
    try:
        ours = load(Path(args.ours), "our rows")
        peers = load(Path(args.peers), "peer rows") if Path(args.peers).exists() else None
        if args.compare:
            names = args.compare.split(",")
            if len(names) != 2:
                raise TableError(f"--compare takes two row names separated by a comma, not {args.compare!r}")
            print(compare(ours, peers, *names))
            return 0
        tables, points = render(ours, peers)
        write_section(Path(args.doc), BEGIN, END, tables)
    except RecurformerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    plot(points, Path(args.plot))
    print(tables, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
