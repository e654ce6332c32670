"""The retrieval study's pipeline (`python -m benchmarks.retrieval.study --quick`): outputs are
well-formed, measured cache sizes are consistent, and a second run redoes nothing."""

import json
import shutil
import sys

import pytest
from benchmark_scripts import benchmark_script


@pytest.fixture(scope="module")
def study():
    with benchmark_script("retrieval.study") as module:
        yield module


@pytest.fixture(scope="module")
def quick_run(study, tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    args = ["--quick", "--out", str(root / "out"), "--work", str(root / "work")]
    assert study.main(args) == 0
    return root, args


def test_outputs_are_complete_and_well_formed(study, quick_run):
    root, _ = quick_run
    out = root / "out"
    results = json.loads((out / "results.json").read_text())
    config = study.Study.quick(tuple(results["study"]["mixers"]))
    evals = [u for u in study.plan(config, root / "work", "all") if u.kind == "eval"]
    assert len(results["rows"]) == len(evals)
    assert {(b["task"], b["seed"]) for b in results["base_models"]} == {(t.name, s) for t in config.tasks for s in config.seeds}
    for row in results["rows"]:
        for scale in config.scales:
            assert 0.0 <= row[f"accuracy_x{scale}"] <= 1.0
            assert row[f"tokens_x{scale}"] == scale * next(t.seq_len for t in config.tasks if t.name == row["task"])
    for name in ("pareto.png", "heads-mqar.png", "heads-hashhop.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    readme = (out / "README.md").read_text()
    assert "All planned units are finished." in readme and "## Conclusions" in readme
    entries = sys.modules["benchmarks.retrieval.report"].summarize(results["rows"], config.scales)
    table_rows = [line for line in readme.splitlines()
                  if line.startswith("| ") and line.count("|") == 14 and not line.startswith("| selection")]
    assert len(table_rows) == len(entries)
    assert any("±" in line for line in table_rows)  # the headline rows have several seeds


def test_measured_cache_follows_what_was_replaced(quick_run):
    root, _ = quick_run
    rows = json.loads((root / "out" / "results.json").read_text())["rows"]
    for row in rows:
        if row["selector"] in ("original", "none"):
            assert row["state_bytes"] == 0 and row["kv_bytes_per_token"] > 0
        if row["selector"] == "all":
            assert row["kv_bytes_per_token"] == 0 and row["state_bytes"] > 0
            assert row["cache_bytes_x4"] == row["cache_bytes_x1"]  # a fixed-size state only
        if 0 < row["fraction"] < 1:
            assert row["cache_bytes_x4"] > row["cache_bytes_x1"] and row["state_bytes"] > 0
    for task in {r["task"] for r in rows}:
        full = next(r for r in rows if r["task"] == task and r["selector"] == "original")
        for row in (r for r in rows if r["task"] == task):
            # KV bytes are the kept fraction of the original's, whichever groups were kept
            assert row["kv_bytes_per_token"] == pytest.approx(full["kv_bytes_per_token"] * (1 - row["fraction"]))


def test_a_second_run_redoes_nothing(study, quick_run, capsys):
    root, args = quick_run
    units = sorted((root / "work").rglob("unit.json"))
    before = [p.stat().st_mtime_ns for p in units]
    assert study.main(args) == 0
    assert "0 units run" in capsys.readouterr().out
    assert [p.stat().st_mtime_ns for p in units] == before


def test_report_only_keeps_the_hand_written_reading(study, quick_run, tmp_path):
    root, _ = quick_run
    out = tmp_path / "out"
    out.mkdir()
    (out / "reading.md").write_text("Recency beat nothing at these toy sizes.\n")
    assert study.main(["--quick", "--work", str(root / "work"), "--out", str(out), "--report-only"]) == 0
    readme = (out / "README.md").read_text()
    assert "## What it means" in readme and "Recency beat nothing at these toy sizes." in readme
    assert readme.index("## What it means") > readme.index("## Conclusions (computed from the table)")


def test_a_work_dir_made_with_other_settings_is_refused(study, quick_run, tmp_path, capsys):
    root, _ = quick_run
    work = tmp_path / "work"
    shutil.copytree(root / "work", work)
    settings = json.loads((work / "hashhop" / "settings.json").read_text())
    (work / "hashhop" / "settings.json").write_text(json.dumps({**settings, "lm_steps": settings["lm_steps"] + 1}))
    assert study.main(["--quick", "--work", str(work), "--out", str(tmp_path / "out"), "--estimate"]) == 2
    assert "made with other settings (lm_steps)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--mixers", "lstm"], "--mixers: lstm not available"),
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--tasks", "mqar,babi"], "--tasks: unknown babi"),
])
def test_bad_arguments_give_a_one_line_error(study, capsys, argv, message):
    assert study.main(argv + ["--estimate"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
