"""The shared-context table of docs/results/long-context.md ("Shared context: one prefill, many
questions"), from our rows (`shared_ours.py`) and kvpress's (`kvpress_eval.py --shared`), the
paired comparisons the docs state, and the plot of the headline against cache fraction.

Every answer is scored here, alike for all rows: *exact* (the completion starts with the value,
`recurformer.tasks.shared_context.is_exact`), *log-probability* (the mean over the value's tokens
from its first visible one) and *first* (that token was the greedy one). The **headline** is the
multi-request exact match (0-100). Intervals (90%) resample whole contexts, and a row's
trainings where it has several (rows `NAME~sN` pool into `NAME`); a comparison resamples the
contexts of both rows together (`recurformer.evaluate.bootstrap`). The tables replace the part
of `--doc` between `<!-- shared-context:begin -->` and `<!-- shared-context:end -->`.

The table reads the first `--contexts` contexts (40), which every row answers; the problem set
may hold more (`shared_problems.py` grows it), and the rows that answered more are listed again
on all of theirs, and compared on every context both rows answered.

    python -m benchmarks.peers.shared_table
    python -m benchmarks.peers.shared_table --compare conversion@0.5,window@0.5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from recurformer.errors import RecurformerError
from recurformer.evaluate.bootstrap import interval, mean, paired_interval
from recurformer.tasks.shared_context import KINDS, is_exact

from benchmarks.common import RESULTS as ALL_RESULTS
from benchmarks.peers.ruler_table import TableError, kind_name, load, ordered, plot, write_section

RESULTS = ALL_RESULTS / "long-context"
SCHEMA = "recurformer-shared-context-rows/1"
BEGIN, END = "<!-- shared-context:begin -->", "<!-- shared-context:end -->"
MODES = ("multi-request", "multi-turn")
TABLE_CONTEXTS = 40
DEPTH_QUARTERS = 4
# The comparisons the docs state, each printed with its paired interval when both rows exist.
COMPARISONS = ("conversion@0.5,original", "conversion@0.5,window@0.5", "conversion@0.5,duo@0.5",
               "conversion@0.5,kvzip@0.5", "conversion@0.5,streaming@0.5", "conversion@0.5,tova@0.5",
               "conversion@0.5,expected-attention@0.5", "conversion@0.5,snapkv@0.5", "conversion@0.5,knorm@0.5",
               "conversion@0.5-retrieval25,conversion@0.5", "conversion@0.5-q-retrieval25,conversion@0.5",
               "conversion@0.5-q-retrieval25,conversion@0.5-retrieval25", "conversion@0.5-retrieval25,kvzip@0.5",
               "window@0.5,original", "kvzip@0.5,original",
               "conversion@0.25,window@0.25", "conversion@0.25,kvzip@0.25", "conversion@0.25,streaming@0.25",
               "conversion@0.25,tova@0.25", "conversion@0.25,expected-attention@0.25",
               "conversion@0.25,snapkv@0.25", "conversion@0.25,knorm@0.25",
               "conversion@0.25-ablation-retrieval,window@0.25-ablation-retrieval",
               "conversion@0.25-ablation-retrieval,kvzip@0.25",
               "conversion@0.25-ablation-retrieval,conversion@0.25",
               "window@0.25-ablation-retrieval,window@0.25",
               "compose-kvzip@0.25,kvzip@0.25", "compose-kvzip@0.25,conversion@0.25-ablation-retrieval",
               "compose-global-kvzip@0.25,kvzip@0.25", "compose-global-kvzip@0.25,conversion@0.25",
               "compose-global-kvzip@0.25,compose-kvzip@0.25",
               "conversion@0.5-long-retrieval25,conversion@0.5",
               "conversion@0.5-long-retrieval25,conversion@0.5-retrieval25",
               "conversion@0.5-long-retrieval25,kvzip@0.5",
               "conversion@0.5-ablation-joint,conversion@0.5", "conversion@0.5-ablation-joint,window@0.5-ablation-joint",
               "conversion@0.5-ablation-joint,kvzip@0.5", "window@0.5-ablation-joint,window@0.5",
               "conversion@0.25-ablation-joint,conversion@0.25",
               "conversion@0.25-ablation-joint,conversion@0.25-ablation-retrieval",
               "conversion@0.25-ablation-joint,window@0.25-ablation-joint",
               "conversion@0.25-ablation-joint,kvzip@0.25", "window@0.25-ablation-joint,window@0.25",
               "kvzip@0.25,original",
               "conversion@0.5-ablation-retrieval,conversion@0.5",
               "conversion@0.5-ablation-retrieval,window@0.5-ablation-retrieval",
               "conversion@0.5-ablation-retrieval,duo@0.5", "conversion@0.5-ablation-retrieval,kvzip@0.5",
               "window@0.5-ablation-retrieval,window@0.5", "duo-retrieval@0.25,duo@0.25",
               "conversion@0.25,duo-retrieval@0.25", "compose-tova@0.25,conversion@0.25",
               "compose-tova@0.25,compose-kvzip@0.25", "compose-tova@0.25,tova@0.25",
               "conversion@0.5-long-retrieval25,window@0.5",
               "conversion@0.5-long-retrieval50,conversion@0.5-long-retrieval25",
               "conversion@0.5-long-retrieval50,kvzip@0.5", "conversion@0.5-long-retrieval50,window@0.5",
               "conversion@0.5-long-retrieval25-answers16,conversion@0.5-long-retrieval25",
               "conversion@0.5-long-retrieval25-answers16,kvzip@0.5",
               "conversion@0.5-long-retrieval25-answers16,window@0.5",
               "conversion@0.5-long-q-retrieval25-answers16,conversion@0.5-long-retrieval25-answers16",
               "conversion@0.5-long-q-retrieval25-answers16,conversion@0.5-long-retrieval25",
               "conversion@0.5-long-q-retrieval25-answers16,kvzip@0.5",
               "conversion@0.5-long-q-retrieval25-answers16,window@0.5",
               "conversion@0.5-long-retrieval25,conversion@0.5-long-retrieval25-transfer",
               "conversion@0.5-long-retrieval25-transfer,window@0.5",
               "conversion@0.5,conversion@0.5-transfer", "conversion@0.5-transfer,window@0.5",
               "conversion@0.5-long-lm-retrieval25,conversion@0.5",
               "conversion@0.5-long-lm-retrieval25,conversion@0.5-long-retrieval25",
               "conversion@0.5-long-lm-retrieval25,conversion@0.5-retrieval25",
               "conversion@0.5-long-lm-retrieval25,kvzip@0.5", "conversion@0.5-long-lm-retrieval25,window@0.5",
               "conversion@0.5-long-lm-retrieval25-lm26,conversion@0.5",
               "conversion@0.5-long-lm-retrieval25-lm26,conversion@0.5-long-lm-retrieval25",
               "conversion@0.5-long-lm-retrieval25-lm26,conversion@0.5-retrieval25",
               "conversion@0.5-long-lm-retrieval25-lm26,duo@0.5",
               "conversion@0.5-long-lm-retrieval25-lm26,kvzip@0.5",
               "conversion@0.5-long-lm-retrieval25-lm26,window@0.5",
               "conversion@0.5-long-lm-retrieval25,conversion@0.5-long-lm-retrieval25-transfer",
               "conversion@0.5-long-lm-retrieval25-transfer,conversion@0.5-transfer",
               "conversion@0.5-retrieval25,original", "conversion@0.5-retrieval25,window@0.5",
               "conversion@0.5-retrieval25,duo@0.5", "conversion@0.5-retrieval25,streaming@0.5",
               "conversion@0.5-retrieval25-steps37-21,conversion@0.5-retrieval25",
               "conversion@0.5-retrieval25-steps37-21,window@0.5",
               "compose-global-kvzip@0.5-w25,kvzip@0.5", "compose-global-kvzip@0.5-w25,conversion@0.5-retrieval25",
               "compose-global-kvzip@0.5-w25,original", "compose-global-kvzip@0.5-w25,conversion@0.75-window",
               "conversion@0.75-window,original", "conversion@0.75-window,kvzip@0.25",
               "conversion@0.5-retrieval25,conversion@0.75-window",
               "conversion@0.75-window-sinks64,conversion@0.75-window")


def score(answers: dict, context: dict) -> dict[str, list[list[float]]]:
    """One context's answers -> {measure: [question scores]} per mode: exact and first in 0-100."""
    out = {}
    for mode in MODES:
        records = answers[mode]
        out[f"{mode}/exact"] = [100.0 * is_exact(r["completion"], n["value"])
                                for r, n in zip(records, context["needles"])]
        out[f"{mode}/first"] = [100.0 * r["argmax"][s] for r, s in zip(records, context["starts"])]
        out[f"{mode}/logprob"] = [sum(r["logprobs"][s:]) / len(r["logprobs"][s:])
                                  for r, s in zip(records, context["starts"])]
    out["by_kind"] = {k: [e for e, n in zip(out["multi-request/exact"], context["needles"]) if n["kind"] == k]
                      for k in KINDS}
    out["by_depth"] = {q: [e for e, n in zip(out["multi-request/exact"], context["needles"]) if depth_quarter(n) == q]
                       for q in range(DEPTH_QUARTERS)}
    return out


def depth_quarter(needle: dict) -> int:
    """0-3: the quarter of the context a fact stands in (0: the first, farthest from the questions)."""
    return min(DEPTH_QUARTERS - 1, int(needle["depth"] * DEPTH_QUARTERS))


class Table:
    """Rows pooled over their trainings and scored per context."""

    def __init__(self, ours: dict, peers: dict | None, contexts: int = TABLE_CONTEXTS):
        if peers is not None and not same_set(ours, peers):
            raise TableError(f"our rows and the peer rows were made on different problem sets "
                             f"({ours.get('problems')} and {peers.get('problems')})")
        self.index = ours["index"]
        self.base = min(contexts, len(self.index))
        self.rows: dict[str, list[dict]] = {}
        for name, row in {**ours["rows"], **(peers or {}).get("rows", {})}.items():
            if row["contexts"]:
                row.setdefault("kind", "original" if name == "original" else name.split("@")[0])
                row["budget"] = row["budget"].split("~")[0] if row.get("budget") else None
                self.rows.setdefault(name.split("~")[0], []).append(row)
        if "original" not in self.rows or not self.finished("original"):
            raise TableError("the original has not answered every context yet: it is the reference of every ratio")

    def answered(self, name: str) -> list[int]:
        """The contexts every training of row `name` has answered."""
        if name not in self.rows:
            raise TableError(f"row {name!r} does not exist")
        common = set.intersection(*[{int(i) for i in row["contexts"]} for row in self.rows[name]])
        return sorted(i for i in common if i < len(self.index))

    def finished(self, name: str) -> bool:
        """Row `name` has answered the table's contexts."""
        return set(range(self.base)) <= set(self.answered(name))

    def measure(self, name: str, measure: str, contexts: list[int] | None = None) -> list[list[list[float]]]:
        """`[training][context][question]` scores of a pooled row on `contexts` (default: the table's)."""
        contexts = range(self.base) if contexts is None else contexts
        if not set(contexts) <= set(self.answered(name)):
            raise TableError(f"row {name!r} has not answered every context asked for")
        return [[score(row["contexts"][str(i)], self.index[i])[measure] for i in contexts] for row in self.rows[name]]

    def compare(self, first: str, second: str, depth: bool = False) -> str:
        """The paired differences of two rows on the contexts both have answered (`depth`: and the
        headline's in each quarter of the context, `depth_quarter`)."""
        contexts = sorted(set(self.answered(first)) & set(self.answered(second)))
        if not contexts:
            raise TableError(f"rows {first!r} and {second!r} have no answered context in common")
        parts = []
        for measure, unit in (("multi-request/exact", ""), ("multi-turn/exact", ""), ("multi-request/logprob", " nats")):
            diff, low, high = paired_interval(self.measure(first, measure, contexts),
                                              self.measure(second, measure, contexts))
            parts.append(f"{measure} {diff:+.{1 if not unit else 3}f}{unit} "
                         f"({low:+.{1 if not unit else 3}f} to {high:+.{1 if not unit else 3}f})")
        if depth:
            a, b = self.measure(first, "by_depth", contexts), self.measure(second, "by_depth", contexts)
            for q in range(DEPTH_QUARTERS):
                first_quarter = in_quarter(a, q)
                if first_quarter:
                    diff, low, high = paired_interval(first_quarter, in_quarter(b, q))
                    parts.append(f"quarter {q + 1} exact {diff:+.1f} ({low:+.1f} to {high:+.1f})")
        on = "" if contexts == list(range(self.base)) else f" (on the {len(contexts)} contexts both have answered)"
        return f"`{first}` - `{second}`{on}: " + "; ".join(parts)

    def render(self) -> tuple[str, dict]:
        contexts, questions = self.base, sum(len(c["needles"]) for c in self.index[:self.base])
        original = self.measure("original", "multi-request/exact")
        top = mean(original)
        lines = [f"{contexts} contexts, {questions} questions in all. *cache*: the row's bytes at the context length "
                 "over the original's. **Headline**: multi-request exact match (0-100); every value is the mean "
                 "over the contexts (and trainings: *trained* counts them) with its 90% interval, which resamples "
                 "whole contexts and the row's trainings. *log p*: the gold value's mean log-probability per token "
                 "(nats); *first*: its first token was the greedy one (%).", "",
                 "| row | method | trained | cache | **headline** | vs original | multi-turn exact | log p | first "
                 "| number | uuid | word |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        points: dict[str, list[tuple[float, float, float, float]]] = {}
        flat = {name: rows[0] for name, rows in self.rows.items() if self.finished(name)}
        for name in ordered(flat):
            rows, first = self.rows[name], flat[name]
            fraction = first["cache"] / first["full"]
            head, low, high = interval(self.measure(name, "multi-request/exact"))
            turn = interval(self.measure(name, "multi-turn/exact"))
            logp = interval(self.measure(name, "multi-request/logprob"))
            firsts = mean(self.measure(name, "multi-request/first"))
            by_kind = [mean([[c[k] for c in training] for training in self.measure(name, "by_kind")])
                       for k in KINDS]
            # a conversion's label starts with its mixer kind (ruler_ours.Rows.build); `window` has nothing to train
            untrained = first["kind"] != "conversion" or first["label"].startswith("window (")
            trained = "-" if untrained else str(len(rows))
            kind = "window" if first["kind"] == "conversion" and untrained else first["kind"]
            points.setdefault(kind_name(kind, first["budget"]), []).append((fraction, head, low, high))
            lines.append(f"| `{name}` | {first['label']} | {trained} | {fraction:.3f} | **{head:.1f}** ({low:.1f}-"
                         f"{high:.1f}) | {head / top:.0%} | {turn[0]:.1f} ({turn[1]:.1f}-{turn[2]:.1f}) | "
                         f"{logp[0]:.3f} ({logp[1]:.3f} to {logp[2]:.3f}) | {firsts:.1f} | "
                         + " | ".join(f"{v:.0f}" for v in by_kind) + " |")
        unfinished = [f"`{name}` ({len(self.answered(name))} of {contexts} contexts)" for name in self.rows
                      if not self.finished(name)]
        if unfinished:
            lines += ["", "Answered on part of the contexts (still being measured, or stopped once decided; not in "
                      "the table; a comparison with them reads the contexts both rows have answered): "
                      + ", ".join(unfinished) + "."]
        lines += self.by_depth(flat)
        lines += self.more_contexts()
        stated = [self.compare(*pair.split(",")) for pair in COMPARISONS if all(n in self.rows for n in pair.split(","))]
        if stated:
            lines += ["", "Paired differences (first row minus second; 90% intervals resampling the contexts of both "
                      "rows together and each row's trainings), `shared_table.py --compare A,B`:", ""]
            lines += [f"- {line}" for line in stated]
        return "\n".join(lines) + "\n", points

    def by_depth(self, finished: dict) -> list[str]:
        """The headline of each finished row by the quarter of the context its facts stand in."""
        lines = ["", "The headline by where the fact stands (the quarter of the context's text before it; the first "
                 "quarter is farthest from the questions, 3-4K tokens back):", "",
                 "| row | " + " | ".join(f"quarter {q + 1}" for q in range(DEPTH_QUARTERS)) + " |",
                 "|---|" + "---|" * DEPTH_QUARTERS]
        for name in ordered(finished):
            per_training = self.measure(name, "by_depth")
            cells = [in_quarter(per_training, q) for q in range(DEPTH_QUARTERS)]
            lines.append(f"| `{name}` | " + " | ".join(f"{mean(c):.1f}" if c else "-" for c in cells) + " |")
        return lines

    def more_contexts(self) -> list[str]:
        """The rows that answered more than the table's contexts, on all of theirs, beside the original."""
        lines = []
        for name in sorted(self.rows):
            contexts = self.answered(name)
            if len(contexts) <= self.base or not self.finished(name):
                continue
            head, low, high = interval(self.measure(name, "multi-request/exact", contexts))
            line = f"- `{name}` on {len(contexts)} contexts: **{head:.1f}** ({low:.1f}-{high:.1f})"
            if name != "original" and set(contexts) <= set(self.answered("original")):
                top = mean(self.measure("original", "multi-request/exact", contexts))
                line += f", {head / top:.0%} of the original's {top:.1f} on them"
            lines.append(line)
        if lines:
            lines = ["", "The rows that have answered more contexts (the headline on all of them):", "", *lines]
        return lines


def in_quarter(by_depth: list[list[dict]], quarter: int) -> list[list[list[float]]]:
    """`[training][context][question]` scores of the facts in `quarter` (`measure(..., "by_depth")`),
    the contexts with none there left out (the same for every row: they share the index); [] if none has."""
    return [kept for kept in ([c[quarter] for c in training if c[quarter]] for training in by_depth) if kept]


def same_set(ours: dict, peers: dict) -> bool:
    """Two rows files made on one problem set, or on one set and a prefix of it (`extends`)."""
    mine, theirs = {ours.get("problems"), *ours.get("extends", ())}, {peers.get("problems"), *peers.get("extends", ())}
    return ours.get("problems") in theirs or peers.get("problems") in mine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ours", default=str(RESULTS / "shared-ours.json"))
    parser.add_argument("--peers", default=str(RESULTS / "shared-kvpress.json"))
    parser.add_argument("--doc", default=str(ALL_RESULTS / "long-context.md"))
    parser.add_argument("--plot", default=str(RESULTS / "shared-context.png"))
    parser.add_argument("--contexts", type=int, default=TABLE_CONTEXTS, help="the table's contexts: the first N")
    parser.add_argument("--compare", metavar="A,B", help="print the paired differences of two rows (also by the "
                        "quarter of the context the facts stand in), write nothing")
    args = parser.parse_args()
    if args.contexts < 1:
        print(f"error: --contexts must be >= 1, got {args.contexts}", file=sys.stderr)
        return 1
    try:
        ours = load(Path(args.ours), "our rows", SCHEMA)
        peers = load(Path(args.peers), "peer rows", SCHEMA) if Path(args.peers).exists() else None
        table = Table(ours, peers, args.contexts)
        if args.compare:
            names = args.compare.split(",")
            if len(names) != 2:
                raise TableError(f"--compare takes two row names separated by a comma, not {args.compare!r}")
            print(table.compare(*names, depth=True))
            return 0
        text, points = table.render()
        write_section(Path(args.doc), BEGIN, END, text)
    except RecurformerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    plot(points, Path(args.plot), ylabel="shared-context headline (multi-request exact, 0-100)",
         xlabel="cache bytes at the context length / the original's")
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
