"""benchmarks/speed/operator_calls.py: counts that do not grow with the prefill's length, and
a static decode step on the GPU's paths that launches no more kernels per layer than the
original's."""

import importlib.util
import json

import pytest
from benchmark_scripts import benchmark_script

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


@pytest.fixture
def no_interpreter(monkeypatch):
    """The script without its count of the GPU paths (a subprocess in Triton's interpreter),
    for the tests of everything else."""
    with benchmark_script("speed.operator_calls") as module:
        monkeypatch.setattr(module, "gpu_step_launches_in_interpreter", lambda window: None)


def test_the_counts_are_written_and_the_prefill_does_not_grow_with_its_length(tmp_path, monkeypatch, no_interpreter):
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
    assert results["gpu_step_launches"] is None
    assert "not counted: Triton is not installed" in out.with_suffix(".md").read_text()


@needs_triton
def test_on_the_gpu_paths_the_conversion_launches_no_more_per_layer_than_the_original(tmp_path, monkeypatch):
    """Counted with every Triton kernel in the step (the interpreter runs them); the
    conversion's layer holds the original's projections and MLP, and two more projections,
    its tail's and the window's, so this fails as soon as a step adds a launch."""
    monkeypatch.setenv("RECURFORMER_KERNELS", "auto")
    out = tmp_path / "calls.json"
    with benchmark_script("speed.operator_calls") as module:
        module.main(["--lengths", "64", "--window", "24", "--out", str(out)])
    launches = json.loads(out.read_text())["gpu_step_launches"]
    assert launches["conversion"]["per_layer"] <= launches["original-split"]["per_layer"]
    for counts in launches.values():
        assert counts["layers_32"] == counts["besides_layers"] + 32 * counts["per_layer"] > 0
    assert "| a step of 32 layers (8B-shaped) |" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("argv", [["--lengths", "0"], ["--window", "0"]])
def test_bad_sizes_are_one_line(argv, tmp_path):
    with benchmark_script("speed.operator_calls") as module, pytest.raises(SystemExit, match="must be positive"):
        module.main([*argv, "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_an_output_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, no_interpreter):
    monkeypatch.setenv("RECURFORMER_KERNELS", "auto")  # the script sets `torch` itself
    (tmp_path / "file").write_text("")
    with benchmark_script("speed.operator_calls") as module, pytest.raises(SystemExit, match="^error: cannot write"):
        module.main(["--lengths", "64", "--out", str(tmp_path / "file" / "x.json")])


def test_a_prefill_shorter_than_the_window_is_counted(tmp_path, monkeypatch, no_interpreter):
    monkeypatch.setenv("RECURFORMER_KERNELS", "auto")
    out = tmp_path / "calls.json"
    with benchmark_script("speed.operator_calls") as module:
        module.main(["--lengths", "64", "--out", str(out)])  # the default window, 141
    assert json.loads(out.read_text())["prefill"]["64"]["conversion"]["calls"] > 0
