"""llama.cpp's own tests of architectures and memory on the patched build (`make engine-tests`,
built by `make test`): `test-llama-archs` over every architecture its fixture makes, `recurformer`
included (the fixture writes its keys: one layer with every KV group replaced, one mixed, one with
none; a window with sinks and a tail); `test-save-load-state` and `test-recurrent-state-rollback`
over the models it saves; and `test-save-load-state`, `test-recurrent-state-rollback` and
`test-state-restore-fragmented` on tiny conversions of each kind from our own exporter. Skipped
where these tests are not built."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from tiny_models import MIXERS, mixed_layout, open_gates, tiny_model, tiny_tokenizer

from benchmarks.gguf_converter_shim import unknown_tokenizer_converter
from recurformer.export import EXPORT_KINDS, engine_root, export_command
from recurformer.surgery import convert

BIN = engine_root() / "build" / "bin"
TESTS = ("test-llama-archs", "test-save-load-state", "test-recurrent-state-rollback", "test-state-restore-fragmented")
pytestmark = pytest.mark.skipif(not all((BIN / t).exists() for t in TESTS),
                                reason="llama.cpp's tests are not built (make engine-tests)")


def run(test: str, *args: str, cwd: Path) -> str:
    """`test`'s output with its colours taken out; fails the test with its tail if it fails."""
    done = subprocess.run([str(BIN / test), *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    out = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)
    assert done.returncode == 0, f"{test} {' '.join(args)} failed:\n{out[-3000:]}"
    return out


def row(table: str, model: str) -> list[str]:
    """The cells of `model`'s row in a `--models` summary table."""
    [line] = [line for line in table.splitlines() if line.startswith(model + " ")]
    return line.split()[1:]


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    """The models `test-llama-archs -o` saves, one per architecture and configuration."""
    folder = tmp_path_factory.mktemp("test-models")
    run("test-llama-archs", "-o", str(folder), cwd=folder)
    assert (folder / "recurformer-dense.gguf").exists()
    return folder


def test_every_architecture_of_the_fixture_runs_and_round_trips_recurformer_included(tmp_path):
    """Its exit status says whether every configuration passed (its log thread may drop the
    last lines of the table when the output is a pipe, so the status is what is read); each row
    starts before its model runs, so recurformer's row shows it ran."""
    out = run("test-llama-archs", cwd=tmp_path)
    assert re.search(r"\|\s*recurformer\|[^|]*\| Dense\|", out), out[-3000:]


def test_state_save_load_and_rollback_pass_for_every_saved_architecture(generated):
    table = run("test-save-load-state", "--models", str(generated), cwd=generated)
    assert row(table, "recurformer-dense.gguf") == ["PASS"] * 9
    table = run("test-recurrent-state-rollback", "--models", str(generated), cwd=generated)
    # the tail keeps no per-token snapshots (its graph is not llama.cpp's Mamba-2 builder): the
    # context clamps n_rs_seq to 0 and both rollback tests skip, as for any architecture without them
    assert row(table, "recurformer-dense.gguf") == ["SKIP", "SKIP"]


@pytest.fixture(scope="module")
def conversions(tmp_path_factory) -> Path:
    """Tiny Llama conversions of each kind, 256 wide (the state tests corrupt a state of 12 KB or
    more), exported as F32 GGUFs into one folder."""
    folder = tmp_path_factory.mktemp("conversions")
    for kind in EXPORT_KINDS:
        source = folder / "src" / kind.replace("+", "-")
        model = tiny_model("llama", num_hidden_layers=3, hidden_size=256, intermediate_size=384, max_position_embeddings=8192)
        open_gates(convert(model, mixed_layout(model), MIXERS[kind])).save_pretrained(source)
        tiny_tokenizer().save_pretrained(source)
        with unknown_tokenizer_converter():
            export_command(str(source), str(folder / f"recurformer-{kind.replace('+', '-')}.gguf"), "f32")
    return folder


def test_our_conversions_pass_llamas_state_tests(conversions):
    names = [f"recurformer-{kind.replace('+', '-')}.gguf" for kind in EXPORT_KINDS]
    table = run("test-save-load-state", "--models", str(conversions), cwd=conversions)
    for name in names:
        assert row(table, name) == ["PASS"] * 9, name
    table = run("test-recurrent-state-rollback", "--models", str(conversions), cwd=conversions)
    for name in names:
        assert row(table, name) == ["SKIP", "SKIP"], name
    for name in names:
        out = run("test-state-restore-fragmented", "-m", str(conversions / name), cwd=conversions)
        assert "SUCCESS - state restore works with fragmented KV cache" in out, name
