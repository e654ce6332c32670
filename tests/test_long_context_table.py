"""The equal-cache table's reader (`benchmarks/peers/table.py`): a missing or malformed
rows file fails with one line naming it; good files render one line per row, scored alike."""

import json
import sys

import pytest
from benchmark_scripts import benchmark_script


@pytest.fixture(scope="module")
def table():
    with benchmark_script("peers.table") as module:
        yield module


def row(label, cache_bytes, heldout, ood, completions):
    passkey = [{"context": context, "depth": 0.5, "answer": "12345", "completion": completion}
               for context, completion in completions]
    return {"label": label, "cache": {"cache_bytes": cache_bytes}, "passkey": passkey,
            "loss": {"heldout": {"nll": heldout}, "ood": {"nll": ood}}}


def write(path, rows, problems="abc"):
    path.write_text(json.dumps({"schema": "recurformer-long-context-rows/1", "problems": problems, "rows": rows}))
    return path


@pytest.fixture
def ours(tmp_path):
    return write(tmp_path / "ours.json", {
        "original": row("original", 1000, 2.5, 3.0, [(2048, " 12345."), (8000, " 12345")]),
        "window64-b0.5": row("window", 500, 2.7, 3.1, [(2048, "12345"), (8000, " 54321")]),
    })


@pytest.fixture
def peers(tmp_path):
    return write(tmp_path / "peers.json", {"knorm@window64-b0.5": row("Knorm", 510, 2.9, 3.4, [(2048, "no"), (8000, "")])})


def test_good_files_render_every_row_scored_alike(table, ours, peers):
    text = table.render(table.load_rows(ours, "our rows"), table.load_rows(peers, "peer rows"))
    lines = text.splitlines()
    assert len(lines) == 2 + 3
    assert lines[2].startswith("| `original` |")  # the reference first, then by cache bytes
    assert lines[3].startswith("| `knorm@window64-b0.5` |") and lines[4].startswith("| `window64-b0.5` |")
    assert "| 0.500 | 1/1 | 0/1 | 2.700 | +0.200 | 3.100 | +0.100 |" in lines[4]
    assert "| 0.510 | 0/1 | 0/1 | 2.900 | +0.400 |" in lines[3]
    assert "| 1/1 | 1/1 |" in lines[2]


def test_missing_file_names_it(table, ours, tmp_path):
    with pytest.raises(table.TableError, match=r"peer rows file .*absent\.json does not exist"):
        table.load_rows(tmp_path / "absent.json", "peer rows")


@pytest.mark.parametrize("content, problem", [
    ("{not json", "is not valid JSON"),
    (json.dumps({"schema": "other", "rows": {}}), "is not a recurformer-long-context-rows/1 file"),
    (json.dumps({"schema": "recurformer-long-context-rows/1", "rows": {}}), "has no rows"),
    (json.dumps({"schema": "recurformer-long-context-rows/1", "rows": {"x": {"label": "x", "cache": {}}}}),
     "row 'x' has no positive cache.cache_bytes"),
    (json.dumps({"schema": "recurformer-long-context-rows/1", "rows": {"x": {
        "label": "x", "cache": {"cache_bytes": 5}, "loss": {"heldout": {"nll": 1.0}}, "passkey": []}}}),
     "row 'x' has no finite loss.ood.nll"),
])
def test_malformed_file_names_it_and_the_problem(table, tmp_path, content, problem):
    path = tmp_path / "peers.json"
    path.write_text(content)
    with pytest.raises(table.TableError, match=problem) as error:
        table.load_rows(path, "peer rows")
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_rows_of_different_problem_sets_are_refused(table, ours, tmp_path):
    other = write(tmp_path / "other.json", {"knorm": row("Knorm", 510, 2.9, 3.4, [])}, problems="xyz")
    with pytest.raises(table.TableError, match="different problem sets"):
        table.render(table.load_rows(ours, "our rows"), table.load_rows(other, "peer rows"))


def test_main_prints_one_line_error(table, ours, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["table", "--ours", str(ours), "--peers", str(tmp_path / "absent.json")])
    assert table.main() == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: peer rows file") and "absent.json" in err
