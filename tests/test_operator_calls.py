"""benchmarks/speed/operator_calls.py: counts that do not grow with the prefill's length."""

import json

import pytest
from benchmark_scripts import benchmark_script


def test_the_counts_are_written_and_the_prefill_does_not_grow_with_its_length(tmp_path, monkeypatch):
    monkeypatch.setenv("RECURFORMER_KERNELS", "auto")  # the script sets `torch` itself
    out = tmp_path / "calls.json"
    with benchmark_script("speed.operator_calls") as module:
        module.main(["--lengths", "200,900", "--window", "24", "--out", str(out)])
    results = json.loads(out.read_text())
    prefill = results["prefill"]
    assert set(prefill) == {"200", "900"}
    assert prefill["200"]["conversion"] == prefill["900"]["conversion"]  # 8 blocks of the window against 38
    assert prefill["200"]["original"]["calls"] < prefill["200"]["conversion"]["calls"]
    step = results["decode_step"]
    assert all(0 < step[m]["not_views"] < step[m]["calls"] for m in ("original", "conversion"))
    assert "| one static decode step |" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("argv", [["--lengths", "0"], ["--window", "0"]])
def test_bad_sizes_are_one_line(argv, tmp_path):
    with benchmark_script("speed.operator_calls") as module, pytest.raises(SystemExit, match="must be positive"):
        module.main([*argv, "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_an_output_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("RECURFORMER_KERNELS", "auto")  # the script sets `torch` itself
    (tmp_path / "file").write_text("")
    with benchmark_script("speed.operator_calls") as module, pytest.raises(SystemExit, match="^error: cannot write"):
        module.main(["--lengths", "64", "--out", str(tmp_path / "file" / "x.json")])


def test_a_prefill_shorter_than_the_window_is_counted(tmp_path, monkeypatch):
    monkeypatch.setenv("RECURFORMER_KERNELS", "auto")
    out = tmp_path / "calls.json"
    with benchmark_script("speed.operator_calls") as module:
        module.main(["--lengths", "64", "--out", str(out)])  # the default window, 141
    assert json.loads(out.read_text())["prefill"]["64"]["conversion"]["calls"] > 0
