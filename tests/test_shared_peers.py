"""The shared-context comparison's scripts (`benchmarks/peers/shared_*.py`): the table scores every
row alike, pools a row's trainings, gives paired intervals over contexts; our rows' script
refuses bad input before it loads a model and answers a context as the task does."""

import json

import pytest
import torch
from benchmark_scripts import benchmark_script
from tiny_models import tiny_model, tiny_tokenizer

from recurformer.cache import CACHE_ARGUMENT
from recurformer.evaluate.conversation import ask
from recurformer.evaluate.shared_context import ends_answer


@pytest.fixture(scope="module")
def table():
    with benchmark_script("peers.shared_table") as module:
        yield module


NEEDLES = [{"kind": "number", "depth": 0.2, "value": "1234567"}, {"kind": "word", "depth": 0.7, "value": "harbour"},
           {"kind": "uuid", "depth": 0.9, "value": "0a1b2c3d-0000-4000-8000-000000000000"}]


def answers(right: set[int], turn_right: set[int] | None = None) -> dict:
    """One context's answers: question q right in multi-request when q in `right`."""
    def records(good):
        return [{"completion": f" {n['value']}." if q in good else " nothing",
                 "logprobs": [-0.01, -0.1 if q in good else -3.0], "argmax": [True, q in good]}
                for q, n in enumerate(NEEDLES)]
    return {"multi-request": records(right), "multi-turn": records(right if turn_right is None else turn_right)}


def rows_file(table, rows: dict, contexts: int = 4, digest: str = "abc") -> dict:
    return {"schema": table.SCHEMA, "problems": digest, "context": 4096,
            "index": [{"needles": NEEDLES, "starts": [1, 1, 1]} for _ in range(contexts)], "rows": rows}


def row(budget, kind, per_context: list[set[int]], cache: int = 400, full: int = 400) -> dict:
    return {"budget": budget, "kind": kind, "label": kind, "cache": cache, "full": full, "seconds": 1.0,
            "contexts": {str(i): answers(r) for i, r in enumerate(per_context)}}


def main_table(text: str) -> dict[str, str]:
    """The main table's lines by row name (the table by depth follows it)."""
    main = text.split("The headline by where the fact stands")[0]
    return {line.split("`")[1]: line for line in main.splitlines() if line.startswith("| `")}


def test_the_table_scores_every_row_alike_and_pools_trainings(table):
    everything = [{0, 1, 2}] * 4
    ours = rows_file(table, {
        "original": row(None, "original", everything),
        "conversion@0.5": row("0.5", "conversion", [{0, 1}, {0, 1}, {0}, {0, 1, 2}], cache=208),
        "conversion@0.5~s1": row("0.5~s1", "conversion", [{0}, {0}, {0}, {0}], cache=208),
        "window@0.5": row("0.5", "window", [{0}, {0}, {0}, {0}], cache=208),
        "duo@0.5": row("0.5", "duo", [{0}, {0}], cache=208),  # unfinished: not in the table, compared on 2 contexts
    })
    peers = {"schema": table.SCHEMA, "problems": "abc", "rows": {"kvzip@0.5": row("0.5", "kvzip", everything, 208)}}
    text, points = table.Table(ours, peers).render()
    lines = main_table(text)
    assert set(lines) == {"original", "conversion@0.5", "window@0.5", "kvzip@0.5"}
    assert "| 1.000 | **100.0** (100.0-100.0) | 100% |" in lines["original"]
    # conversion: trainings (2+2+1+3)/12 = 8/12 and 4/12 -> 50.0 over both
    assert "| conversion | 2 | 0.520 | **50.0** (" in lines["conversion@0.5"]
    assert "| 0.520 | **33.3** (33.3-33.3) | 33% |" in lines["window@0.5"]
    assert lines["window@0.5"].endswith("| 100 | 0 | 0 |")  # by kind: number, uuid, word
    assert points["our `window`, no training"] == [(0.52, pytest.approx(33.33, abs=0.01), pytest.approx(33.33, abs=0.01),
                                                     pytest.approx(33.33, abs=0.01))]
    assert "- `conversion@0.5` - `window@0.5`: multi-request/exact +16.7 (" in text
    assert "`window@0.5` - `original`: multi-request/exact -66.7 (-66.7 to -66.7)" in text
    assert "Answered on part of the contexts (still being measured, or stopped once decided; not in the table" in text
    assert "`duo@0.5` (2 of 4 contexts)" in text
    assert "`conversion@0.5` - `duo@0.5` (on the 2 contexts both have answered): multi-request/exact +16.7" in text


def test_a_conversion_to_the_window_mixer_counts_as_untrained(table):
    """A `conversion@B` row whose model is a plain `window` conversion has nothing to train: no
    count in the table, and the plot draws it with the training-free windows."""
    everything = [{0, 1, 2}] * 4
    ours = rows_file(table, {"original": row(None, "original", everything),
                             "conversion@0.75-cheap": {**row("0.75-cheap", "conversion", everything, cache=300),
                                                       "label": "window (window 169 + 4 sinks), beta 0.26"}})
    text, points = table.Table(ours, None).render()
    assert "| window (window 169 + 4 sinks), beta 0.26 | - | 0.750 |" in main_table(text)["conversion@0.75-cheap"]
    assert list(points) == ["original", "our `window`, no training, cheap"]


def test_a_comparison_pairs_contexts(table):
    ours = rows_file(table, {"original": row(None, "original", [{0, 1, 2}, set(), {0, 1, 2}, set()]),
                             "window@0.5": row("0.5", "window", [{0, 1, 2}, set(), {0, 1, 2}, set()])})
    line = table.Table(ours, None).compare("original", "window@0.5")
    assert line.startswith("`original` - `window@0.5`: multi-request/exact +0.0 (+0.0 to +0.0)")
    with pytest.raises(table.TableError, match="row 'bogus' does not exist"):
        table.Table(ours, None).compare("original", "bogus")


def test_bad_files_are_named(table, tmp_path):
    with pytest.raises(table.TableError, match="does not exist"):
        table.load(tmp_path / "none.json", "our rows")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "other"}))
    with pytest.raises(table.TableError, match="is not a"):
        table.load(bad, "our rows")
    ours = rows_file(table, {"window@0.5": row("0.5", "window", [{0}] * 4)})
    with pytest.raises(table.TableError, match="original has not answered"):
        table.Table(ours, None)
    ours["rows"]["original"] = row(None, "original", [{0}] * 4)
    with pytest.raises(table.TableError, match="different problem sets"):
        table.Table(ours, {"schema": table.SCHEMA, "problems": "other", "rows": {}})


@pytest.mark.parametrize("argv, message", [
    (["--budget", "0.25r=FOLDER", "--rows", "original"], "--budget '0.25r': a budget is named by its cache fraction"),
    (["--budget", "0.5~s1=FOLDER", "--rows", "bogus@0.5~s1"], "rows are original or KIND@BUDGET"),
    (["--budget", "0.5=FOLDER", "--rows", "original", "--problems", "NOWHERE"], "no problem set at"),
])
def test_shared_ours_refuses_bad_input_before_loading_a_model(argv, message, tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    argv = [arg.replace("FOLDER", str(tmp_path)).replace("NOWHERE", str(tmp_path / "none.json")) for arg in argv]
    with benchmark_script("peers.shared_ours") as module:
        monkeypatch.setattr("sys.argv", ["shared_ours.py", *argv])
        monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
        with pytest.raises(SystemExit, match=message):
            module.main()


def test_a_row_answers_a_context_as_the_task_does(tmp_path):
    """`answer_context` prefills once and hands the cache to the task's own answering core."""
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    context = {"ids": list(range(3, 40)), "questions": [[50, 51], [52, 53, 54]], "later": [[60, 50, 51], [60, 52]],
               "golds": [[70, 71], [72]]}
    with benchmark_script("peers.shared_ours") as module:
        got = module.answer_context(model, tokenizer, context, eos={0})
    with torch.no_grad():
        cache = model(input_ids=torch.tensor([context["ids"]]), use_cache=True)[CACHE_ARGUMENT]
        expected = ask(model, cache, len(context["ids"]), context["questions"], context["later"], context["golds"], {0},
                       ends_answer(tokenizer), cache_key=CACHE_ARGUMENT)
    for mode, records in expected.items():
        assert [r["completion"] for r in got[mode]] == [tokenizer.decode(r["answer"], skip_special_tokens=True)
                                                         for r in records]
        assert [r["argmax"] for r in got[mode]] == [r["argmax"] for r in records]


def test_rows_made_before_the_set_grew_are_read_on_their_contexts(table):
    """A set grown to 6 contexts: rows made on its first 4 stay in the table, the rows that answered
    all 6 are listed on them and compared on every context both rows answered."""
    ours = rows_file(table, {
        "original": row(None, "original", [{0, 1, 2}] * 6),
        "window@0.5": row("0.5", "window", [{0}] * 4, cache=208),
        "conversion@0.5": row("0.5", "conversion", [{0, 1}] * 4 + [{0}, {0}], cache=208),
    }, contexts=6, digest="grown")
    ours["extends"] = ["first4"]
    peers = {"schema": table.SCHEMA, "problems": "first4", "rows": {"kvzip@0.5": row("0.5", "kvzip", [{0}] * 6, 208)}}
    text, _ = table.Table(ours, peers, contexts=4).render()
    assert text.startswith("4 contexts, 12 questions in all.")
    lines = main_table(text)
    assert set(lines) == {"original", "window@0.5", "conversion@0.5", "kvzip@0.5"}
    assert "| **66.7** (66.7-66.7) | 67% |" in lines["conversion@0.5"]
    assert "- `conversion@0.5` on 6 contexts: **55.6** (" in text and ", 56% of the original's 100.0 on them" in text
    assert "- `original` on 6 contexts: **100.0**" in text and "`window@0.5` on" not in text
    assert "`conversion@0.5` - `kvzip@0.5` (on the 6 contexts both have answered): multi-request/exact +22.2" in text
    assert "`conversion@0.5` - `window@0.5`: multi-request/exact +33.3" in text
    with pytest.raises(table.TableError, match="different problem sets"):
        table.Table(ours, {**peers, "problems": "another"})


def test_a_grown_set_names_the_sets_it_extends(tmp_path):
    with benchmark_script("peers.shared_problems") as module:
        base = {"schema": module.SCHEMA, "model": "m", "seed": 0, "context": 64}
        old = {**base, "contexts": [{"ids": [1]}, {"ids": [2]}], "digest": "old", "extends": ["older"]}
        path = tmp_path / "set.json"
        path.write_text(json.dumps(old))
        grown = {**base, "contexts": [{"ids": [1]}, {"ids": [2]}, {"ids": [3]}], "digest": "new"}
        assert module.grown_from(path, grown) == ["old", "older"]
        assert module.grown_from(path, {**grown, "contexts": [{"ids": [9]}, {"ids": [2]}, {"ids": [3]}]}) == []
        assert module.grown_from(path, {**grown, "seed": 1}) == []
        assert module.grown_from(tmp_path / "none.json", grown) == []
        path.write_text('{"schema": ')
        assert module.grown_from(path, grown) == []
    with benchmark_script("peers.ruler_ours") as module:
        rows = tmp_path / "rows.json"
        rows.write_text(json.dumps({"schema": "s", "problems": "old", "rows": {"original": {}}}))
        assert module.load_results(rows, "new", "s", ("old",))["problems"] == "new"
        with pytest.raises(SystemExit, match="was made on problem set old, not new"):
            module.load_results(rows, "new", "s")


def test_the_table_refuses_no_contexts(table, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["shared_table.py", "--contexts", "0", "--ours", str(tmp_path / "none.json")])
    assert table.main() == 1
    assert capsys.readouterr().err == "error: --contexts must be >= 1, got 0\n"


def test_the_headline_is_split_by_where_the_facts_stand(table):
    # NEEDLES stand in quarters 1, 3 and 4; quarter 2 holds none
    ours = rows_file(table, {"original": row(None, "original", [{0, 1, 2}] * 4),
                             "window@0.5": row("0.5", "window", [{2}, {2}, {1, 2}, {2}], cache=208)})
    text, _ = table.Table(ours, None).render()
    assert "| `original` | 100.0 | - | 100.0 | 100.0 |" in text
    assert "| `window@0.5` | 0.0 | - | 25.0 | 100.0 |" in text
    line = table.Table(ours, None).compare("window@0.5", "original", depth=True)
    assert "quarter 1 exact -100.0 (-100.0 to -100.0)" in line and "quarter 2" not in line
    assert "quarter 4 exact +0.0 (+0.0 to +0.0)" in line
    assert [table.depth_quarter({"depth": d}) for d in (0.0, 0.249, 0.25, 0.99, 1.0)] == [0, 0, 1, 3, 3]
