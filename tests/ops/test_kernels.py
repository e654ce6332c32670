"""Building, caching and loading the compiled kernels, and every way of falling back to the
PyTorch path: RECURFORMER_KERNELS=torch, no compiler, a failing compiler; a corrupted or
half-written build cache; two processes building at once."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_selective_scan import make_inputs
from test_ssd import make_inputs as make_ssd_inputs

from recurformer.ops import kernels
from recurformer.ops.selective_scan import selective_scan, selective_scan_chunked
from recurformer.ops.ssd import ssd, ssd_chunked

NOTICE = "recurformer: compiled kernels unavailable ("


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process state in which the kernels were never loaded, with an empty build cache;
    the real state is restored afterwards (the library is found again in its cache)."""
    monkeypatch.setenv("RECURFORMER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(kernels.ENV, raising=False)
    kernels.reset()
    yield tmp_path / "cache" / "kernels"
    kernels.reset()


def assert_torch_path():
    """The auto backends run the PyTorch scans; the compiled ones raise one line."""
    inputs = make_inputs(30, 8, 4)
    assert torch.equal(selective_scan(**inputs), selective_scan_chunked(**inputs))
    ssd_inputs = make_ssd_inputs(30)
    assert torch.equal(ssd(**ssd_inputs), ssd_chunked(**ssd_inputs))
    with pytest.raises(RuntimeError, match="selective_scan: backend='compiled' is unavailable") as raised:
        selective_scan(**inputs, backend="compiled")
    assert "\n" not in str(raised.value)
    return str(raised.value)


def fake_compiler(folder: Path) -> str:
    """A `g++` that answers --version and fails every compilation."""
    path = folder / "fake-g++"
    path.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo fake 1.0; exit 0; fi\n'
                    'echo "x.cpp:1:1: error: simulated failure" >&2\nexit 1\n')
    path.chmod(0o755)
    return str(path)


def test_environment_forces_the_torch_path(fresh, monkeypatch, capsys):
    monkeypatch.setenv(kernels.ENV, "torch")
    assert kernels.library() is None
    assert "RECURFORMER_KERNELS=torch" in assert_torch_path()
    assert capsys.readouterr().err == ""  # asked for, so no notice
    assert not fresh.exists()  # and nothing built


def test_unknown_environment_value_is_rejected(fresh, monkeypatch):
    monkeypatch.setenv(kernels.ENV, "fast")
    with pytest.raises(ValueError, match="RECURFORMER_KERNELS='fast': expected 'auto' or 'torch'"):
        kernels.library()


def test_failed_build_prints_one_notice_and_falls_back(fresh, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("CXX", fake_compiler(tmp_path))
    assert kernels.library() is None
    assert kernels.library() is None  # cached: no second attempt, no second notice
    message = assert_torch_path()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(NOTICE)
    assert "fake-g++ failed: x.cpp:1:1: error: simulated failure" in err
    assert err.rstrip().endswith("; using the torch path")
    assert "simulated failure" in message
    assert [p.name for p in fresh.iterdir() if p.is_dir()] == []  # no half-written build left


def test_no_compiler_prints_one_notice_and_falls_back(fresh, monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++, no c++
    assert kernels.library() is None
    assert_torch_path()
    err = capsys.readouterr().err
    assert err == f"{NOTICE}no C++ compiler found (set CXX or install g++)); using the torch path\n"


def copying_compiler(folder: Path, library: str) -> str:
    """A `g++` that logs its commands, writes empty objects, and "links" by copying the
    real library (built once for the session) after a second: the cache and lock logic
    without the cost of compiling."""
    path = folder / "copying-g++"
    path.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then echo copying 1.0; exit 0; fi\n'
        f'echo "$@" >> "{folder / "log"}"\n'
        'out=""; prev=""; for a in "$@"; do [ "$prev" = -o ] && out="$a"; prev="$a"; done\n'
        f'case " $* " in *" -c "*) : > "$out" ;; *) sleep 1; cp "{library}" "$out" ;; esac\n'
    )
    path.chmod(0o755)
    return str(path)


def links(folder: Path) -> int:
    """How many times the copying compiler linked (once per build)."""
    log = folder / "log"
    return sum(" -c " not in f" {line} " for line in log.read_text().splitlines()) if log.exists() else 0


def assert_loads(lib) -> None:
    assert lib is not None and lib.rf_selective_scan_checkpoint_floats(20, 3) == 2 * 3 * 16


def test_corrupted_and_interrupted_builds_are_rebuilt(compiled, fresh, monkeypatch, tmp_path):
    """A library that does not load (its checksum recorded as if it were right) and the
    leftovers of an interrupted build are replaced by one fresh build, which later loads
    reuse as it is; a library that does not match its checksum is never loaded."""
    monkeypatch.setenv("CXX", copying_compiler(tmp_path, compiled._name))
    folder = fresh / kernels.build_key(kernels.compiler())
    folder.mkdir(parents=True)
    (folder / kernels.LIBRARY).write_bytes(b"not a shared library")
    (folder / kernels.MANIFEST).write_text(json.dumps({"sha256": kernels._sha256(folder / kernels.LIBRARY)}))
    interrupted = fresh / f".{folder.name}.abc123"
    interrupted.mkdir()
    (interrupted / kernels.LIBRARY).write_bytes(b"\x7fELF half written")

    assert_loads(kernels.load(fresh))
    assert links(tmp_path) == 1
    assert not interrupted.exists()
    manifest = json.loads((folder / kernels.MANIFEST).read_text())
    assert manifest["sha256"] == kernels._sha256(folder / kernels.LIBRARY)
    assert sorted(p.name for p in folder.iterdir()) == sorted([kernels.LIBRARY, kernels.MANIFEST])

    assert_loads(kernels.load(fresh))  # found in the cache, not rebuilt
    assert links(tmp_path) == 1

    copy = fresh / "copy"
    shutil.copytree(folder, copy)
    with open(copy / kernels.LIBRARY, "r+b") as library:  # one flipped byte
        library.seek(1000)
        byte = library.read(1)
        library.seek(1000)
        library.write(bytes([byte[0] ^ 0xFF]))
    assert kernels._load_checked(copy) is None


def test_two_processes_build_once(compiled, fresh, tmp_path):
    """Started together on an empty cache, both load the kernels: one builds, under the
    lock, and the other then finds its build."""
    script = "from recurformer.ops import kernels; lib = kernels.library(); assert lib is not None; print(lib._name)"
    env = {**os.environ, "RECURFORMER_CACHE": str(fresh.parent), "CXX": copying_compiler(tmp_path, compiled._name)}
    runs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=600) for run in runs]
    assert all(run.returncode == 0 for run in runs), outputs
    assert outputs[0][0] == outputs[1][0]  # the same library file
    assert links(tmp_path) == 1
