"""Damaged inputs and hostile folders (#35): each is refused with exit code 2 and one line
that names the file and what is wrong, never a traceback; no output folder or temporary
file is left behind, and the inputs are intact. One test per row of the issue's table (and
the ones found while fixing them), on tiny models, through the command line."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny_model

from recurformer.cli import main
from recurformer.data import load_documents, token_sequences
from recurformer.memory import PeakMemory
from recurformer.outputs import LOCK, MARKER

TEXT = " = Doc = \n" + " ".join(["the quick brown fox jumps over the lazy dog ."] * 400) + "\n"
TRAIN = ("--stage", "transfer", "--steps", 2, "--seq-len", 32, "--batch-size", 2)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny model, its scores, its conversion and a training run with its checkpoint: the
    good inputs that each test copies and damages."""
    root = tmp_path_factory.mktemp("made")
    save_tiny_model(root / "model")
    (root / "text.txt").write_text(TEXT)
    for argv in (("analyze", root / "model", "--data", root / "text.txt", "--out", root / "scores.json",
                  "--sequences", 4, "--seq-len", 64, "--scorer", "recency"),
                 ("convert", root / "model", "--scores", root / "scores.json", "--scorer", "recency",
                  "--out", root / "converted"),
                 ("train", root / "converted", "--data", root / "text.txt", *TRAIN, "--out", root / "trained",
                  "--keep-checkpoint")):
        assert main([str(a) for a in argv]) == 0
    return root


@pytest.fixture
def ws(made, tmp_path):
    """A fresh copy of the good inputs for one test."""
    for name in ("model", "converted", "trained"):
        shutil.copytree(made / name, tmp_path / name)
    for name in ("text.txt", "scores.json"):
        shutil.copy(made / name, tmp_path / name)
    return tmp_path


def listing(root: Path) -> dict[str, str]:
    """Every file and folder under `root` (hidden ones too) with its content hash."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def refused(capsys, root: Path, argv, *fragments):
    """Run the command line; it must exit 2 with one `recurformer: error:` line holding every
    fragment (the file named, what is wrong), print no traceback, and leave every file and
    folder under `root` as it was: nothing written, no temporary file, the inputs intact."""
    before = listing(root)
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err and "weights_only=False" not in err
    last = err.rstrip("\n").split("\n")[-1]
    assert code == 2 and last.startswith("recurformer: error: "), err[-2000:]
    for fragment in fragments:
        assert str(fragment) in last, last
    assert listing(root) == before
    return last


def generate(model):
    return ("generate", model, "--prompt", "the quick", "--max-new-tokens", 2)


def evaluate(ws, model):
    return ("eval", model, "--task", "ppl", "--data", ws / "text.txt", "--context", 32, "--out", ws / "eval.json")


def convert(ws, out, *extra):
    return ("convert", ws / "model", "--scores", ws / "scores.json", "--scorer", "recency", "--out", out, *extra)


def analyze(ws, out, *extra):
    return ("analyze", ws / "model", "--data", ws / "text.txt", "--out", out, "--sequences", 2, "--seq-len", 32,
            "--scorer", "recency", *extra)


# --- the checked loader: damaged model folders -------------------------------------------


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[10:20] = b"\xff" * 10  # inside the JSON header, after its 8-byte length
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, fragment", [(truncate, "truncated (its tensors need"),
                                              (flip_header, "not a safetensors file (its header is not JSON")])
@pytest.mark.parametrize("command", [generate, evaluate])
def test_damaged_safetensors_are_named(ws, capsys, damage, fragment, command):
    weights = ws / "converted" / "model.safetensors"
    damage(weights)
    refused(capsys, ws, command(ws, ws / "converted") if command is evaluate else command(ws / "converted"),
            weights, fragment)


def test_a_truncated_config_is_named(ws, capsys):
    truncate(ws / "model" / "config.json")
    refused(capsys, ws, generate(ws / "model"), ws / "model" / "config.json", "truncated (its JSON stops")


def test_a_truncated_tokenizer_is_named(ws, capsys):
    truncate(ws / "model" / "tokenizer.json")
    refused(capsys, ws, generate(ws / "model"), ws / "model" / "tokenizer.json", "truncated (its JSON stops")


@pytest.mark.parametrize("model_type, fragment", [("nosuchthing", "unknown architecture 'nosuchthing'"),
                                                  ("clip", "not a causal language model")])
def test_an_unknown_or_unfit_architecture_is_named(ws, capsys, model_type, fragment):
    config = ws / "model" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": model_type}))
    refused(capsys, ws, generate(ws / "model"), config, fragment)


class RunsCode:
    """Unpickling this would create `marker` (os.system runs the command)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("name", ["optimizer.bin", "scheduler.bin", "random_states_0.pkl"])
def test_a_pickle_that_runs_code_in_a_checkpoint_is_refused_without_running(ws, capsys, name, tmp_path_factory):
    marker = tmp_path_factory.mktemp("marker") / "code-ran"
    target = ws / "trained" / "checkpoint" / name
    torch.save({"state": RunsCode(marker)}, target)
    refused(capsys, ws, ("train", ws / "converted", "--data", ws / "text.txt", *TRAIN, "--out", ws / "trained",
                         "--resume"), target, "pickle that is not plain tensors", "refused")
    assert not marker.exists()


def test_a_pickle_that_runs_code_in_a_weights_file_is_refused_without_running(ws, capsys, tmp_path_factory):
    marker = tmp_path_factory.mktemp("marker") / "code-ran"
    (ws / "model" / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": RunsCode(marker)}, ws / "model" / "pytorch_model.bin")
    refused(capsys, ws, generate(ws / "model"), ws / "model" / "pytorch_model.bin", "not plain tensors")
    assert not marker.exists()


@pytest.mark.parametrize("command", [generate, evaluate])
def test_nan_weights_are_refused_at_load(ws, capsys, command):
    weights = ws / "converted" / "model.safetensors"
    tensors = load_file(weights)
    name = next(k for k in sorted(tensors) if k.endswith("q_proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    refused(capsys, ws, command(ws, ws / "converted") if command is evaluate else command(ws / "converted"),
            weights, "holds NaN")


def test_a_model_name_of_hundreds_of_characters_is_one_line(ws, capsys):
    name = "m" * 300
    refused(capsys, ws, generate(name), "File name too long")
    refused(capsys, ws, ("analyze", name, "--data", ws / "text.txt", "--out", ws / "s.json"), "File name too long")
    refused(capsys, ws, ("run", "--quick", "--model", name, "--data", ws / "text.txt", "--out", ws / "r"),
            "File name too long")


def test_a_data_file_or_out_name_of_hundreds_of_characters_is_one_line(ws, capsys):
    refused(capsys, ws, ("analyze", ws / "model", "--data", "d" * 300, "--out", ws / "s.json"), "File name too long")
    refused(capsys, ws, analyze(ws, ws / ("o" * 300)), "File name too long")


# --- outputs checked before the work ----------------------------------------------------


@contextmanager
def read_only_folder(path: Path):
    """A folder nobody can write into: without write permission, or (root ignores
    permissions) a read-only mount."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("as root any folder is writable, and a read-only mount is not allowed here")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.parametrize("command", ["analyze", "convert", "train", "run"])
def test_out_in_a_read_only_folder_is_refused_before_the_work(ws, capsys, command, tmp_path_factory, monkeypatch):
    for loader in ("commands.load_model", "commands.load_converted", "run.stages.load_model"):
        monkeypatch.setattr(f"recurformer.{loader}", lambda *a, **k: pytest.fail("a model was loaded"))
    (ws / "held-out.txt").write_text("a recurrent state has a fixed size . " * 200)
    with read_only_folder(tmp_path_factory.mktemp("ro") / "locked") as locked:
        argv = {"analyze": analyze(ws, locked / "scores.json"), "convert": convert(ws, locked / "converted"),
                "train": ("train", ws / "converted", "--data", ws / "text.txt", *TRAIN, "--out", locked / "trained"),
                "run": ("run", "--quick", "--model", ws / "model", "--data", ws / "text.txt", "--eval-data",
                        ws / "held-out.txt", "--ood-data", ws / "held-out.txt", "--out", locked / "run")}[command]
        refused(capsys, ws, argv, locked, "cannot write there")


@pytest.mark.parametrize("command", ["analyze", "convert"])
def test_out_where_no_file_can_be_created_is_refused(ws, capsys, command):
    argv = analyze(ws, "/proc/recurformer/scores.json") if command == "analyze" else convert(ws, "/proc/recurformer/out")
    refused(capsys, ws, argv, "/proc/recurformer", "cannot write there")


def test_out_without_room_for_the_model_is_refused(ws, capsys, monkeypatch):
    free = shutil.disk_usage(ws)._replace(free=1000)
    monkeypatch.setattr("recurformer.outputs.shutil.disk_usage", lambda path: free)
    refused(capsys, ws, convert(ws, ws / "out"), "not enough room", "0 MiB are free")


def test_convert_into_its_input_folder_is_refused_even_with_force(ws, capsys):
    refused(capsys, ws, convert(ws, ws / "model", "--force"), "is the input", ws / "model")
    refused(capsys, ws, convert(ws, ws / "model" / "sub", "--force"), "is inside the input", ws / "model")


def test_train_into_its_input_folder_is_refused_even_with_force(ws, capsys):
    refused(capsys, ws, ("train", ws / "converted", "--data", ws / "text.txt", *TRAIN, "--out", ws / "converted",
                         "--force"), "is the input", ws / "converted")


def test_analyze_onto_its_data_file_is_refused(ws, capsys):
    refused(capsys, ws, analyze(ws, ws / "text.txt"), "is the input", ws / "text.txt")


def test_run_force_never_empties_a_folder_that_is_not_a_run(ws, capsys, monkeypatch):
    (ws / "mine").mkdir()
    (ws / "mine" / "notes.txt").write_text("mine")
    monkeypatch.chdir(ws / "mine")
    (ws / "held-out.txt").write_text("a recurrent state has a fixed size . " * 200)
    refused(capsys, ws, ("run", "--quick", "--model", ws / "model", "--data", ws / "text.txt", "--eval-data",
                         ws / "held-out.txt", "--ood-data", ws / "held-out.txt", "--out", ".", "--force"),
            "not removing . with --force", f"no {MARKER}")
    assert (ws / "mine" / "notes.txt").read_text() == "mine"


def test_convert_force_replaces_only_a_previous_conversion(ws, capsys):
    assert main([str(a) for a in convert(ws, ws / "out")]) == 0
    assert json.loads((ws / "out" / MARKER).read_text()) == {"command": "convert"}
    assert main([str(a) for a in convert(ws, ws / "out", "--force")]) == 0  # its own output: replaced
    refused(capsys, ws, convert(ws, ws / "trained", "--force"), "not removing", "not made by recurformer convert")


def test_train_force_empties_only_a_previous_training(ws, capsys):
    (ws / "other").mkdir()
    (ws / "other" / "notes.txt").write_text("mine")
    refused(capsys, ws, ("train", ws / "converted", "--data", ws / "text.txt", *TRAIN, "--out", ws / "other",
                         "--force"), "not removing", "not made by recurformer train")


def test_stale_staging_of_a_killed_convert_is_swept_and_a_live_ones_kept(ws, capsys):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = ws / f".out.partial-{int(dead.stdout)}-abcd1234"  # its process has ended
    legacy = ws / ".out.partial-k2j4h5g6"  # an older version's name, without a process id
    for folder in (stale, legacy):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 1000)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        writing = ws / f".out.partial-{live.pid}-efgh5678"  # another convert still writing
        writing.mkdir()
        assert main([str(a) for a in convert(ws, ws / "out")]) == 0
        assert not stale.exists() and not legacy.exists() and writing.exists()
    finally:
        live.kill()
        live.wait()


def test_a_run_folder_is_swept_of_what_a_killed_run_left(ws, capsys):
    """Staging copies of a run killed while saving (at the top, inside a stage's folder) go
    at the next start; the run's own files stay."""
    from recurformer.run import Run, RunConfig

    (ws / "held-out.txt").write_text("a recurrent state has a fixed size . " * 200)
    config = RunConfig(model=str(ws / "model"), data=[str(ws / "text.txt")], eval_data=[str(ws / "held-out.txt")],
                       ood_data=[str(ws / "held-out.txt")], quick=True)
    Run(config, ws / "run").claim(force=False).release()
    (ws / "run" / "final").mkdir()
    (ws / "run" / "final" / "train_log.jsonl").write_text("")
    left = [ws / "run" / ".converted.partial-4194304-x1y2z3", ws / "run" / "final" / ".partial-4194304-a1b2c3",
            ws / "run" / "final" / ".checkpoint.partial", ws / "run" / ".metrics.partial-4194304-q9.json"]
    for path in left:
        path.mkdir() if path.suffix != ".json" else path.write_text("{")
    with Run(config, ws / "run").claim(force=False):
        assert not any(path.exists() for path in left)
        assert (ws / "run" / "final" / "train_log.jsonl").exists() and (ws / "run" / "run.json").exists()


# --- scores -----------------------------------------------------------------------------


def damaged_scores(ws, change) -> Path:
    scores = json.loads((ws / "scores.json").read_text())
    change(scores)
    path = ws / "damaged-scores.json"
    path.write_text(json.dumps(scores))  # json writes NaN as NaN, as a careless tool would
    return path


def nan_statistic(scores):
    scores["heads"][3]["rr_16"] = float("nan")


def few_heads(scores):
    scores["heads"] = scores["heads"][:3]


def layer_minus_one(scores):
    scores["heads"][0]["layer"] = -1


def other_window(scores):
    scores["window"] = 99


def duplicate_head(scores):
    scores["heads"][1] = dict(scores["heads"][0])


@pytest.mark.parametrize("change, fragment", [
    (other_window, "no rr_99, the statistic of its window 99"),
    (nan_statistic, "rr_16 of layer 0, head 3 is nan, not a finite number"),
    (few_heads, "it has 3 records of layers x heads, the model has 2 x 4 = 8"),
    (layer_minus_one, "layer -1, head 0 is out of range"),
    (duplicate_head, "layer 0, head 0 appears twice"),
])
def test_damaged_scores_are_refused(ws, capsys, change, fragment):
    path = damaged_scores(ws, change)
    refused(capsys, ws, ("convert", ws / "model", "--scores", path, "--scorer", "recency", "--out", ws / "out"),
            path, fragment)


def test_truncated_scores_are_named(ws, capsys):
    truncate(ws / "scores.json")
    refused(capsys, ws, convert(ws, ws / "out"), ws / "scores.json", "truncated (its JSON stops")


# --- no silent wrong answers ----------------------------------------------------------


def test_a_nan_evaluation_result_is_an_error_not_a_number_in_a_json(ws, capsys, monkeypatch):
    monkeypatch.setattr("recurformer.evaluate.perplexity.perplexity",
                        lambda *a, **k: type("R", (), {"to_dict": lambda self: {"ppl": float("nan"), "tokens": 9}})())
    refused(capsys, ws, evaluate(ws, ws / "model"), "--task ppl", "ppl is not a finite number")


@pytest.mark.parametrize("flags, fragment", [
    (("--beta", "0"), "--beta 0 replaces no KV group"),
    (("--beta", "0.01"), "--beta 0.01 replaces none of the model's 4 KV groups"),
    (("--budget-minutes", "inf"), "--budget-minutes must be at most 525,600"),
    (("--budget-minutes", "1e308"), "--budget-minutes must be at most 525,600"),
])
def test_run_flags_that_cannot_work_are_refused_before_the_work(ws, capsys, flags, fragment):
    (ws / "held-out.txt").write_text("a recurrent state has a fixed size . " * 200)
    refused(capsys, ws, ("run", "--quick", "--model", ws / "model", "--data", ws / "text.txt", "--eval-data",
                         ws / "held-out.txt", "--ood-data", ws / "held-out.txt", "--out", ws / "run", *flags), fragment)


@pytest.mark.parametrize("argv, fragment", [
    (("--task", "hashhop", "--context", 50), "--task hashhop: target_tokens=50 is too small"),
    (("--task", "mqar", "--context", 8, "--kv-pairs", 16), "--task mqar: "),
])
def test_evaluation_sizes_the_tokenizer_cannot_meet_are_one_line(ws, capsys, argv, fragment):
    refused(capsys, ws, ("eval", ws / "model", *argv), fragment)


def test_a_training_log_cut_by_an_interruption_resumes(ws, capsys):
    log = ws / "trained" / "train_log.jsonl"
    log.write_text(log.read_text() + '{"step": 3, "lo')  # the write of a later step was cut
    argv = ("train", ws / "converted", "--data", ws / "text.txt", *TRAIN, "--out", ws / "trained", "--resume")
    assert main([str(a) for a in argv]) == 0, capsys.readouterr().err
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]


# --- lazy corpora ---------------------------------------------------------------------


class SpaceTokenizer:
    """A fast whitespace tokenizer with the call signature data.py uses."""

    eos_token_id = 0

    def __call__(self, texts, add_special_tokens=False, verbose=True):
        return {"input_ids": [[1 + len(word) for word in text.split()] for text in texts]}


def test_a_few_sequences_of_a_large_file_take_memory_for_the_sequences_not_the_file(tmp_path):
    big = tmp_path / "big.txt"
    line = " ".join(f"w{'x' * (i % 9)}" for i in range(40)) + "\n"
    big.write_text(line * 100_000)  # 18 MB, 4 million tokens: 150 MB as a list of ints
    with PeakMemory(interval=0.01, settle=True) as memory:
        sequences = token_sequences(SpaceTokenizer(), load_documents([big]), 256, num_sequences=2, seed=3)
    assert sequences.shape == (2, 256)
    assert memory.growth < 40 * 2**20, f"{memory.growth / 2**20:.0f} MiB"


def test_lazy_sequences_are_the_sequences_of_the_whole_token_stream(tmp_path, monkeypatch):
    """Pieces of huge documents, documents, files: the same sequences as packing the list of
    every token and shuffling it."""
    import random

    monkeypatch.setattr("recurformer.data.PIECE_CHARS", 500)  # cut the documents into many pieces
    first, second = tmp_path / "a.txt", tmp_path / "b.jsonl"
    # documents of many lines, some longer than a piece: they are cut between lines
    first.write_text("".join(f" = Title {d} = \n" + "word and more\n" * (7 * d + 3) + "end .\n" for d in range(1, 30)))
    second.write_text("".join(json.dumps({"text": "x y z\n" * (60 + 13 * d) + "more words"}) + "\n" for d in range(40)))
    tokenizer = SpaceTokenizer()
    ids = []
    for document in load_documents([first, second]):
        ids += [1 + len(word) for word in document.split()] + [0]
    for count in (None, 1, 7):
        got = token_sequences(tokenizer, load_documents([first, second]), 16, num_sequences=count, seed=5)
        whole = torch.tensor(ids[: len(ids) // 16 * 16]).view(-1, 16)
        order = list(range(len(whole)))
        random.Random(5).shuffle(order)
        assert torch.equal(got, whole[order[:count]])


def test_marker_and_lock_stay_out_of_model_files(ws, capsys):
    """A converted model's folder carries the marker, and loads as it did."""
    assert main([str(a) for a in convert(ws, ws / "out")]) == 0
    assert (ws / "out" / MARKER).is_file() and not (ws / "out" / LOCK).exists()
    assert not [p for p in ws.iterdir() if ".partial" in p.name]
    assert main([str(a) for a in generate(ws / "out")]) == 0


# --- a device or precision that cannot be had (issue 47) ---------------------------------


def bench(ws, *extra):
    return ("bench", ws / "converted", "--contexts", 16, "--out", ws / "bench.json", *extra)


def train(ws, *extra):
    return ("train", ws / "converted", "--data", ws / "text.txt", *TRAIN, "--out", ws / "out", *extra)


@pytest.mark.parametrize("command", [
    lambda ws: generate(ws / "converted"), lambda ws: evaluate(ws, ws / "converted"),
    lambda ws: analyze(ws, ws / "scores2.json"), lambda ws: bench(ws), lambda ws: train(ws),
], ids=["generate", "eval", "analyze", "bench", "train"])
@pytest.mark.parametrize("flags, fragment", [
    (("--device", "tpu"), "--device: unknown 'tpu'"),
    (("--device", "cuda:"), "--device: unknown 'cuda:'"),
    *([(("--device", "cuda"), "--device cuda: no CUDA GPU is available here")] if not torch.cuda.is_available() else []),
])
def test_a_device_that_cannot_be_had_is_one_line(ws, capsys, command, flags, fragment):
    refused(capsys, ws, (*command(ws), *flags), fragment)


@pytest.mark.parametrize("command", [lambda ws: generate(ws / "converted"), lambda ws: analyze(ws, ws / "scores2.json")],
                         ids=["generate", "analyze"])
def test_an_unknown_precision_is_one_line(ws, capsys, command):
    refused(capsys, ws, (*command(ws), "--precision", "fp8"), "--precision: unknown 'fp8'")


# --- bad arguments refused before any weight is loaded ------------------------------------
# (`eval --task shared-context --context 100000` tokenized and prefilled for six minutes
# before it said the context was longer than the model's positions)

REFUSE_WITHIN_S = 5.0


@pytest.fixture
def no_weights(monkeypatch):
    """Every load of a model's weights refused, and recorded: a bad argument must be refused
    before one (`loading.load_checked` is where every command and stage loads a model)."""
    from transformers import AutoModelForCausalLM

    loaded = []

    def refuse(where, *args, **kwargs):
        loaded.append(str(where))
        raise RuntimeError(f"the weights of {where} were loaded before the argument was refused")

    monkeypatch.setattr("recurformer.loading.load_checked", refuse)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    return loaded


def tokens_of(ws, text: str) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(ws / "model")(text, add_special_tokens=False)["input_ids"])


def text_of(ws, path: Path, sentence: str, low: int, high: int) -> Path:
    """A file of `sentence` repeated to between `low` and `high` tokens of the tiny tokenizer."""
    count = (low + high) // 2 // tokens_of(ws, sentence)
    path.write_text(sentence * count)
    assert low <= tokens_of(ws, sentence * count) + 1 < high  # + 1: the EOS after the document
    return path


def with_positions(ws, positions: int) -> Path:
    """The tiny model with `positions` positions (its rotary embedding has no weights)."""
    folder = ws / f"model-{positions}"
    shutil.copytree(ws / "model", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}))
    return folder


@pytest.fixture
def pre(ws):
    """The good inputs, and the files the table's rows need besides them."""
    held_out = "a recurrent state has a fixed size . "
    (ws / "held-out.txt").write_text(held_out * 200)
    (ws / "short.txt").write_text("a few words .")
    (ws / "long.txt").write_text(TEXT * 12)  # more than 16 x 1,024 tokens: a full run's analysis
    text_of(ws, ws / "mid.txt", held_out, 4096 + 200, 8192 - 200)  # a full run's RULER, not its ppl-by-distance
    text_of(ws, ws / "small.txt", "the quick brown fox jumps over the lazy dog . ", 128 + 20, 256 - 20)
    scores = json.loads((ws / "scores.json").read_text())
    scores.update(num_layers=1, heads=[h for h in scores["heads"] if h["layer"] == 0],
                  groups=[g for g in scores.get("groups", []) if g["layer"] == 0])
    (ws / "one-layer-scores.json").write_text(json.dumps(scores))
    for positions in (1536, 4096, 8192):
        with_positions(ws, positions)
    return ws


def run_args(ws, *extra, model="model", data="text.txt", eval_data="held-out.txt"):
    return ("run", "--model", ws / model, "--data", ws / data, "--eval-data", ws / eval_data, "--ood-data",
            ws / eval_data, "--out", ws / "run", *extra)


def eval_args(ws, model, task, *extra, out=None):
    return ("eval", ws / model, "--task", task, *extra, *(("--out", out) if out else ()))


UNWRITABLE = Path("/proc/recurformer")
FULL_RUN = ("--scorer", "recency", "--retrieval-share", "0")  # no ablation, no retrieval mix: to reach later stages

# row -> (argv, given the workspace; fragments of the one-line error, "{ws}" standing for the workspace)
BAD_ARGUMENTS = {
    # analyze: sequences, the ablation the scorer needs, the text, the output
    "analyze --seq-len beyond positions": (
        lambda ws: (*analyze(ws, ws / "s.json"), "--seq-len", 1024),
        ["seq_len 1024 is longer than the model allows (512 positions)"]),
    "analyze --ablation-seq-len beyond positions": (
        lambda ws: (*analyze(ws, ws / "s.json"), "--scorer", "ablation", "--ablation-seq-len", 1024,
                    "--ablation-from", 32),
        ["seq_len 1024 is longer than the model allows (512 positions)"]),
    "analyze --ablation-rounds beyond the groups": (
        lambda ws: (*analyze(ws, ws / "s.json"), "--scorer", "ablation-greedy", "--ablation-rounds", 5,
                    "--ablation-seq-len", 64, "--ablation-from", 32),
        ["--ablation-rounds 5 must be <= the model's 4 KV groups"]),
    "analyze --sequences beyond the text": (
        lambda ws: (*analyze(ws, ws / "s.json"), "--sequences", 1000, "--seq-len", 64),
        ["asked for 1000 sequences of 64 tokens, the data has"]),
    "analyze calibration beyond the text": (
        lambda ws: (*analyze(ws, ws / "s.json"), "--scorer", "ablation", "--ablation-sequences", 1000,
                    "--ablation-seq-len", 64, "--ablation-from", 32),
        ["needs 1000 x 64 = 64000 tokens of calibration text"]),
    "analyze --out unwritable": (
        lambda ws: analyze(ws, UNWRITABLE / "scores.json"), [UNWRITABLE, "cannot write there"]),
    # convert: the window, the scores, the output
    "convert --window beyond positions": (
        lambda ws: convert(ws, ws / "out", "--mixer", "window", "--window", 1000),
        ["window 1000 is larger than the model's position limit (512 positions)"]),
    "convert scores of another shape": (
        lambda ws: ("convert", ws / "model", "--scores", ws / "one-layer-scores.json", "--scorer", "recency", "--out",
                    ws / "out"),
        ["scores are for a model with layers x heads x kv_heads = 1 x 4 x 2", "has 2 x 4 x 2"]),
    "convert --scorer without its statistic": (
        lambda ws: convert(ws, ws / "out", "--scorer", "ablation"), ["these scores have no ablation costs"]),
    "convert --out unwritable": (lambda ws: convert(ws, UNWRITABLE / "out"), [UNWRITABLE, "cannot write there"]),
    # train: the sequences, the text, the folder, the output
    "train --seq-len beyond positions": (
        lambda ws: train(ws, "--seq-len", 1024), ["seq_len 1024 is longer than the model allows (512 positions)"]),
    "train text shorter than a sequence": (
        lambda ws: ("train", ws / "converted", "--data", ws / "short.txt", *TRAIN, "--out", ws / "out"),
        ["tokens, fewer than one sequence of 32"]),
    "train a model that is not converted": (
        lambda ws: ("train", ws / "model", "--data", ws / "text.txt", *TRAIN, "--out", ws / "out"),
        ["not a converted RecurFormer model"]),
    "train --out unwritable": (
        lambda ws: ("train", ws / "converted", "--data", ws / "text.txt", *TRAIN, "--out", UNWRITABLE / "out"),
        [UNWRITABLE, "cannot write there"]),
    # eval: every task's lengths against the positions, its problems against the context, its text
    "eval ppl --context beyond positions": (
        lambda ws: (*evaluate(ws, ws / "model"), "--context", 1024),
        ["seq_len 1024 is longer than the model allows (512 positions)"]),
    "eval ppl-by-distance --context beyond positions": (
        lambda ws: eval_args(ws, "model", "ppl-by-distance", "--data", ws / "text.txt", "--context", 1024),
        ["--context 1024 is longer than the model allows (512 positions)"]),
    "eval ppl-by-distance text shorter than the sequences": (
        lambda ws: eval_args(ws, "model", "ppl-by-distance", "--data", ws / "text.txt", "--context", 256,
                             "--sequences", 100),
        ["tokens, fewer than --sequences 100 x --context 256"]),
    "eval agreement on a model that is not converted": (
        lambda ws: eval_args(ws, "model", "agreement", "--data", ws / "text.txt"),
        ["--task agreement compares a converted model with its original; this model is not converted"]),
    "eval agreement --original converted": (
        lambda ws: eval_args(ws, "converted", "agreement", "--data", ws / "text.txt", "--original", ws / "trained"),
        ["the reference {ws}/trained is a converted model; give the original with --reference"]),
    "eval agreement --context beyond positions": (
        lambda ws: eval_args(ws, "converted", "agreement", "--data", ws / "text.txt", "--context", 1024),
        ["--context 1024 is longer than the model allows (512 positions)"]),
    "eval agreement text shorter than a window": (
        lambda ws: eval_args(ws, "converted", "agreement", "--data", ws / "short.txt", "--context", 256,
                             "--max-tokens", 256),
        ["short.txt has", "tokens, fewer than one window of --context 256"]),
    "eval passkey --context beyond positions": (
        lambda ws: eval_args(ws, "model", "passkey", "--data", ws / "text.txt", "--context", 1024),
        ["--context 1024 (+ 8 generated tokens) is longer than the model allows (512 positions)"]),
    "eval ruler --context beyond positions": (
        lambda ws: eval_args(ws, "model", "ruler", "--data", ws / "text.txt", "--context", 1024),
        ["--context 1024 (+ up to", "generated tokens) is longer than the model allows (512 positions)"]),
    "eval shared-context --context 100000": (
        lambda ws: eval_args(ws, "model", "shared-context", "--data", ws / "text.txt", "--context", 100000,
                             out=ws / "s.json"),
        ["--context 100000 and 8 question turns reach more positions than the model allows (512)"]),
    "eval hashhop problems beyond --context": (
        lambda ws: eval_args(ws, "model", "hashhop", "--context", 50),
        ["--task hashhop: target_tokens=50 is too small"]),
    "eval mqar pairs beyond --context": (
        lambda ws: eval_args(ws, "model", "mqar", "--context", 8, "--kv-pairs", 16), ["--task mqar: "]),
    "eval --out unwritable": (
        lambda ws: eval_args(ws, "model", "ppl", "--data", ws / "text.txt", out=UNWRITABLE / "eval.json"),
        [UNWRITABLE, "cannot write there"]),
    # bench
    "bench --contexts beyond positions": (
        lambda ws: bench(ws, "--contexts", 1000), ["--contexts 1000 plus decoding exceeds the model's 512 positions"]),
    "bench a model that is not converted": (
        lambda ws: ("bench", ws / "model", "--contexts", 16, "--out", ws / "bench.json"),
        ["not a converted RecurFormer model"]),
    "bench --out unwritable": (
        lambda ws: ("bench", ws / "converted", "--contexts", 16, "--out", UNWRITABLE / "bench.json"),
        [UNWRITABLE, "cannot write there"]),
    # run: each stage's arguments before the first stage starts
    "run --beta that replaces none": (
        lambda ws: run_args(ws, "--quick", "--beta", "0.01"), ["--beta 0.01 replaces none of the model's 4 KV groups"]),
    "run --window beyond positions": (
        lambda ws: run_args(ws, "--quick", "--window", 513),
        ["window 513 is larger than the model's position limit (512 positions)"]),
    "run training sequences beyond positions": (
        lambda ws: run_args(ws, "--retrieval-share", "0.5"),
        ["seq_len 1024 is longer than the model allows (512 positions)"]),
    "run training sequences without room for a fact": (
        lambda ws: run_args(ws, "--quick", "--retrieval-share", "0.5"),
        ["a 96-token training sequence has no room for a fact and its question"]),
    "run analysis beyond the training text": (
        lambda ws: run_args(ws, "--quick", data="small.txt"), ["asked for 2 sequences of 128 tokens, the data has 1"]),
    "run ablation beyond positions (analyze stage)": (
        lambda ws: run_args(ws, model="model-1536"), ["seq_len 2048 is longer than the model allows (1536 positions)"]),
    "run RULER beyond positions (evaluate stage)": (
        lambda ws: run_args(ws, *FULL_RUN, model="model-4096"),
        ["--context 4096 (+ up to 64 generated tokens) is longer than the model allows (4096 positions)"]),
    "run ppl-by-distance beyond the held-out text (evaluate stage)": (
        lambda ws: run_args(ws, *FULL_RUN, model="model-8192", data="long.txt", eval_data="mid.txt"),
        ["tokens, fewer than --sequences 2 x --context 4096"]),
    "run HashHop problems beyond their context (evaluate stage)": (
        lambda ws: run_args(ws, "--quick"), ["--task hashhop: target_tokens=160 is too small"]),
    "run --out unwritable": (
        lambda ws: (*run_args(ws, "--quick")[:-3], "--out", UNWRITABLE / "run"), [UNWRITABLE, "cannot write there"]),
}


@pytest.mark.parametrize("row", list(BAD_ARGUMENTS))
def test_a_bad_argument_is_refused_before_any_weight_is_loaded(pre, capsys, no_weights, row):
    """Each row: exit 2, the one-line error, nothing written, no weight loaded, within a few seconds."""
    argv, fragments = BAD_ARGUMENTS[row]
    fragments = [str(f).replace("{ws}", str(pre)) for f in fragments]
    started = time.monotonic()
    refused(capsys, pre, argv(pre), *fragments)
    seconds = time.monotonic() - started
    assert not no_weights
    assert seconds < REFUSE_WITHIN_S, f"{row}: refused after {seconds:.1f} s"
    print(f"\nrefused in {seconds:.2f} s: {row}")
