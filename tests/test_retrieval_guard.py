"""The text guard of the retrieval trainings (`benchmarks/retrieval/guard.py`): its table sets
each row against the original and the plain trainings' mean, the rival `window` included, and
bad arguments fail in one line before any model loads."""

import sys

import pytest
from benchmark_scripts import benchmark_script


@pytest.fixture(scope="module")
def guard():
    with benchmark_script("retrieval.guard") as module:
        yield module


def test_the_table_divides_by_the_original_and_the_plain_trainings_mean(guard):
    scores = {"original": {"heldout": 20.0, "ood": 30.0}, "plain": {"heldout": 21.0, "ood": 31.0},
              "window": {"heldout": 22.0, "ood": 33.0}, "mix": {"heldout": 22.0, "ood": 30.0},
              "plain~s1": {"heldout": 23.0, "ood": 29.0}}
    rows = {line.split(" | ")[0].strip("| "): line for line in guard.table(scores).splitlines()[2:]}
    assert list(rows) == ["original", "plain", "plain~s1", "mix", "window"]
    assert rows["window"] == "| window | 22.000 | 1.1000x | 1.0000x | 33.000 | 1.1000x | 1.1000x |"
    assert rows["original"].endswith("| 30.000 | 1.0000x | - |")


@pytest.mark.parametrize("argv, message", [
    (["--model", "plain"], "NAME=DIR"),
    (["--model", "window=runs/x"], "not 'original' or 'window'"),
    (["--model", "plain={folder}", "--window", "retrieval"], "--window retrieval: not one of --model's names"),
    (["--model", "plain=/nonexistent"], "not a model folder"),
])
def test_bad_arguments_fail_in_one_line(guard, argv, message, tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    argv = [a.format(folder=tmp_path) for a in argv]
    monkeypatch.setattr(sys, "argv", ["guard", *argv, "--out", str(tmp_path / "out.json")])
    with pytest.raises(SystemExit, match=message) as error:
        guard.main()
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out.json").exists()
