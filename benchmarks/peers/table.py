"""The equal-cache table of docs/results/long-context.md ("Peers at equal cache bytes"), rendered
from our rows (`benchmarks/peers/ours.py`) and kvpress's (`peers/kvpress_eval.py`).

Both files must hold rows made on the same problem set. Every passkey completion is scored
here, by our task's scorer (`tasks/passkey.py`: the first run of digits equals the key), so all
rows are scored alike. A missing or malformed file fails with one line naming it.

    python -m benchmarks.peers.table [--out table.md]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from recurformer.errors import RecurformerError
from recurformer.files import write_text_atomic
from recurformer.tasks.passkey import parse_key

from benchmarks.common import RESULTS as ALL_RESULTS

RESULTS = ALL_RESULTS / "long-context"
SCHEMA = "recurformer-long-context-rows/1"
TEXTS = ("heldout", "ood")


class TableError(RecurformerError):
    """A results file is missing, malformed, or not comparable with the other."""


def check_row(path: Path, name: str, row) -> None:
    """One-line error unless `row` has what the table shows."""
    def fail(problem: str):
        raise TableError(f"{path}: row {name!r} {problem}")

    if not isinstance(row, dict) or not isinstance(row.get("label"), str):
        fail("has no label")
    cache = row.get("cache")
    if not isinstance(cache, dict) or not isinstance(cache.get("cache_bytes"), int) or cache["cache_bytes"] <= 0:
        fail("has no positive cache.cache_bytes")
    loss = row.get("loss")
    for text in TEXTS:
        entry = loss.get(text) if isinstance(loss, dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("nll"), (int, float)) or not math.isfinite(entry["nll"]):
            fail(f"has no finite loss.{text}.nll")
    problems = row.get("passkey")
    if not isinstance(problems, list) or not all(
            isinstance(p, dict) and {"context", "answer", "completion"} <= p.keys() for p in problems):
        fail("has no passkey list of {context, answer, completion}")


def read_rows_file(path: str | Path, what: str, schema: str) -> dict:
    """The contents of a results file of `schema` with a `rows` mapping (`what` names it in
    errors: 'our rows', 'peer rows'); every table of benchmarks/peers reads its files so."""
    path = Path(path)
    if not path.is_file():
        raise TableError(f"{what} file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise TableError(f"{what} file {path} is not valid JSON: {error}") from None
    if not isinstance(data, dict) or data.get("schema") != schema or not isinstance(data.get("rows"), dict):
        raise TableError(f"{what} file {path} is not a {schema} file with rows "
                         f"(schema {data.get('schema') if isinstance(data, dict) else None!r})")
    return data


def load_rows(path: str | Path, what: str) -> dict:
    """The checked contents of a passkey rows file (`what` names it in errors)."""
    data = read_rows_file(path, what, SCHEMA)
    if not data["rows"]:
        raise TableError(f"{what} file {path} has no rows")
    for name, row in data["rows"].items():
        check_row(path, name, row)
    return data


def passkey_cell(problems: list[dict], context: int) -> str:
    """'2/3' (found / problems at `context`), '-' without problems there."""
    hits = [parse_key(p["completion"]) == p["answer"] for p in problems if p["context"] == context]
    return f"{sum(hits)}/{len(hits)}" if hits else "-"


def render(ours: dict, peers: dict) -> str:
    """The Markdown table: the original first, then by cache bytes, largest first."""
    if ours.get("problems") != peers.get("problems"):
        raise TableError(f"our rows and the peer rows were made on different problem sets "
                         f"({ours.get('problems')} and {peers.get('problems')})")
    rows = {**ours["rows"], **peers["rows"]}
    if "original" not in rows:
        raise TableError("our rows have no 'original' row, the reference of every ratio")
    reference = rows["original"]
    contexts = sorted({p["context"] for row in rows.values() for p in row["passkey"]})
    header = ["row", "how", "cache at 8K (MB)", "vs original",
              *(f"passkey {c:,}" for c in contexts), "held-out loss (nats)", "vs original", "Lee news loss", "vs original"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    order = sorted(rows, key=lambda n: (n != "original", -rows[n]["cache"]["cache_bytes"], n))
    for name in order:
        row = rows[name]
        size = row["cache"]["cache_bytes"]
        cells = [f"`{name}`", row["label"], f"{size / 1e6:.1f}", f"{size / reference['cache']['cache_bytes']:.3f}",
                 *(passkey_cell(row["passkey"], c) for c in contexts)]
        for text in TEXTS:
            nll = row["loss"][text]["nll"]
            cells += [f"{nll:.3f}", f"{nll - reference['loss'][text]['nll']:+.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ours", default=str(RESULTS / "peers-ours.json"))
    parser.add_argument("--peers", default=str(RESULTS / "peers-kvpress.json"))
    parser.add_argument("--out", help="write the table here (default: print it)")
    args = parser.parse_args()
    try:
        table = render(load_rows(args.ours, "our rows"), load_rows(args.peers, "peer rows"))
    except RecurformerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.out:
        write_text_atomic(args.out, table)
    else:
        print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
