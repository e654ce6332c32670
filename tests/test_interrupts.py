"""Interrupts (#35): a command stopped by SIGINT or SIGKILL and run again the same way ends
where an uninterrupted one does; a second command into a folder being written is refused.

The commands run in child processes (`interrupt_driver.py`) that hold still at a chosen
point until the test signals them. The fast cases: SIGKILL in the middle of training, then
the same models; SIGKILL in the middle of a save, then nothing left behind; a second `run`
or `train` into a folder in use. The exhaustive one (`slow`): a `run --quick` interrupted in
every stage, by SIGINT and by SIGKILL, ends with the metrics of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import save_tiny_run_model

from recurformer.cli import main
from recurformer.run import STAGES as PIPELINE_STAGES
from recurformer.run import RunConfig, run_pipeline

DRIVER = Path(__file__).parent / "interrupt_driver.py"
STAGES = ["resolve", "analyze", "convert", "plan", "transfer", "lm", "evaluate", "bench", "report"]
# what a re-run may change: wall times, speeds and memory peaks
TIMING = ("seconds_", "peak_rss", "total_minutes", "_minutes", "_s_per_step", "decode_", "prefill_")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    save_tiny_run_model(root / "model")
    (root / "train.txt").write_text("the quick brown fox jumps over the lazy dog . " * 400)
    (root / "test.txt").write_text("a recurrent state has a fixed size . " * 400)
    (root / "ood.txt").write_text("attention heads that only look at the last few tokens can be replaced . " * 300)
    return root


def run_args(inputs: Path, out: Path, *extra) -> list[str]:
    return ["run", "--quick", "--model", str(inputs / "model"), "--data", str(inputs / "train.txt"), "--eval-data",
            str(inputs / "test.txt"), "--ood-data", str(inputs / "ood.txt"), "--out", str(out), *map(str, extra)]


def train_args(model: Path, data: Path, out: Path, *extra) -> list[str]:
    return ["train", str(model), "--data", str(data), "--stage", "transfer", "--steps", "3", "--checkpoint-every", "1",
            "--seq-len", "32", "--batch-size", "2", "--out", str(out), *map(str, extra)]


def driver(args: list[str], hold: str | None = None, ready: Path | None = None, until: str | None = None,
           ) -> subprocess.Popen:
    command = [sys.executable, str(DRIVER)]
    if hold:
        command += ["--hold", hold, "--ready", str(ready)]
    if until:
        command += ["--until", until]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                        str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([*command, "--", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def held(args: list[str], hold: str, ready: Path, until: str | None = None) -> subprocess.Popen:
    """A child process running `args`, waiting at `hold` (ready has been written)."""
    process = driver(args, hold, ready, until)
    deadline = time.monotonic() + 600
    while not ready.exists():
        if process.poll() is not None:
            raise AssertionError(f"the command ended before {hold}: {process.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"never reached {hold}"
        time.sleep(0.1)
    return process


def interrupt(process: subprocess.Popen, signum: int) -> str:
    """Send `signum`; the process must end as that signal ends it; returns its stderr."""
    process.send_signal(signum)
    _, err = process.communicate(timeout=120)
    if signum == signal.SIGKILL:
        assert process.returncode == -signal.SIGKILL
    else:  # Ctrl-C: the command says how to continue, exit code 130
        assert process.returncode == 130, err[-3000:]
        assert "Traceback" not in err and "interrupted; run the same command again to continue" in err
    return err


def completes(args: list[str], until: str | None = None) -> None:
    process = driver(args, until=until)
    _, err = process.communicate(timeout=900)
    assert process.returncode == 0, err[-3000:]


def staging_left(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if ".partial" in p.name or ".old-" in p.name]


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "train_log.jsonl").read_text().splitlines()]


def test_a_run_killed_in_the_middle_of_training_resumes_to_the_same_models(inputs, tmp_path):
    """SIGKILL after the transfer stage's checkpoint of step 5 of 6 (run checkpoints every 5
    steps); the same command again trains step 6 from it, then the lm stage: the models and
    losses of an uninterrupted run, bit for bit."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    args = ("--steps", "6,2", "--scorer", "recency")
    config = RunConfig(model=str(inputs / "model"), data=[str(inputs / "train.txt")], eval_data=[str(inputs / "test.txt")],
                       ood_data=[str(inputs / "ood.txt")], quick=True, steps=(6, 2), scorer="recency")
    with pytest.raises(FileNotFoundError, match="metrics.json"):  # up to lm: no report
        run_pipeline(config, straight, progress=False, stages=PIPELINE_STAGES[:STAGES.index("lm") + 1])
    process = held(run_args(inputs, killed, *args), "checkpoint:5", tmp_path / "ready", until="lm")
    interrupt(process, signal.SIGKILL)
    assert json.loads((killed / "transfer" / "checkpoint" / "trainer_state.json").read_text())["step"] == 5
    assert not (killed / "stages" / "transfer.json").exists()
    completes(run_args(inputs, killed, *args), until="lm")
    for stage, folder in (("transfer", "transfer"), ("lm", "final")):
        a, b = tensors(straight / folder), tensors(killed / folder)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), folder
        assert losses(straight / folder) == losses(killed / folder)
        records = [json.loads((run / "stages" / f"{stage}.json").read_text()) for run in (straight, killed)]
        assert records[0]["final_loss"] == records[1]["final_loss"]
    assert not staging_left(killed)


def test_a_convert_killed_while_saving_leaves_nothing_once_run_again(inputs, tmp_path):
    scores = tmp_path / "scores.json"
    assert main(["analyze", str(inputs / "model"), "--data", str(inputs / "train.txt"), "--out", str(scores),
                 "--sequences", "2", "--seq-len", "32", "--scorer", "recency"]) == 0
    out = tmp_path / "converted"
    args = ["convert", str(inputs / "model"), "--scores", str(scores), "--scorer", "recency", "--out", str(out)]
    interrupt(held(args, "save:converted", tmp_path / "ready"), signal.SIGKILL)
    left = staging_left(tmp_path)
    assert left and not out.exists()  # the staging copy of the model, and no half model
    assert main(args) == 0
    assert not staging_left(tmp_path) and (out / "model.safetensors").is_file()


def test_a_second_run_into_a_folder_being_written_is_refused(inputs, tmp_path, capsys):
    out = tmp_path / "run"
    first = held(run_args(inputs, out), "stage:resolve", tmp_path / "ready")
    try:
        before = sorted(p.name for p in out.rglob("*"))
        assert main(run_args(inputs, out)) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.count("\n") == 1
        assert f"{out} is being written by another recurformer command" in err
        assert main(run_args(inputs, out, "--force")) == 2  # --force does not break the lock either
        assert "being written by another recurformer command" in capsys.readouterr().err
        assert sorted(p.name for p in out.rglob("*")) == before
    finally:
        interrupt(first, signal.SIGINT)


def test_a_second_train_into_a_folder_being_written_is_refused(inputs, tmp_path, capsys):
    scores, converted = tmp_path / "scores.json", tmp_path / "converted"
    assert main(["analyze", str(inputs / "model"), "--data", str(inputs / "train.txt"), "--out", str(scores),
                 "--sequences", "2", "--seq-len", "32", "--scorer", "recency"]) == 0
    assert main(["convert", str(inputs / "model"), "--scores", str(scores), "--scorer", "recency", "--out",
                 str(converted)]) == 0
    out = tmp_path / "trained"
    first = held(train_args(converted, inputs / "train.txt", out), "checkpoint:1", tmp_path / "ready")
    try:
        capsys.readouterr()
        assert main(train_args(converted, inputs / "train.txt", out, "--force")) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and f"{out} is being written by another recurformer command" in err
        log = (out / "train_log.jsonl").read_text()
        assert [json.loads(line)["step"] for line in log.splitlines()] == [1]  # one writer
    finally:
        interrupt(first, signal.SIGKILL)
    assert main(train_args(converted, inputs / "train.txt", out, "--resume")) == 0  # the first continues


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_a_run_interrupted_in_every_stage_ends_with_the_metrics_of_an_uninterrupted_run(inputs, tmp_path, signum):
    """The same command, interrupted in each stage after its work and before its marker (and
    in the middle of the convert stage's save and of each training stage), then run to the
    end, gives every non-timing metric of a run never interrupted."""
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    completes(run_args(inputs, straight, "--steps", "7,7"))
    holds = ["stage:resolve", "stage:analyze", "save:converted", "stage:convert", "stage:plan", "checkpoint:5:transfer",
             "stage:transfer", "checkpoint:5:final", "stage:lm", "stage:evaluate", "stage:bench", "stage:report"]
    for number, hold in enumerate(holds):
        ready = tmp_path / f"ready-{number}"
        interrupt(held(run_args(inputs, interrupted, "--steps", "7,7"), hold, ready), signum)
    completes(run_args(inputs, interrupted, "--steps", "7,7"))
    a, b = (json.loads((run / "metrics.json").read_text()) for run in (straight, interrupted))
    assert a.keys() == b.keys()
    differ = {k: (a[k], b[k]) for k in a if a[k] != b[k] and not any(t in k for t in TIMING)}
    assert not differ
    assert not staging_left(interrupted)
    for folder in ("converted", "transfer", "final"):
        x, y = tensors(straight / folder), tensors(interrupted / folder)
        assert all(torch.equal(x[k], y[k]) for k in x), folder
