"""The analyze and convert commands on tiny local models: outputs, and one-line errors on bad input."""

import json
import subprocess
import sys

import pytest
import torch
from tiny_models import save_tiny_model
from transformers import AutoModelForCausalLM

import recurformer  # noqa: F401
from recurformer.cli import build_parser, main
from recurformer.commands import recipe_train_config
from recurformer.mixers import kinds_reading
from recurformer.recipe import RECIPES

TEXT = " = Doc = \n" + " ".join(["the quick brown fox jumps over the lazy dog ."] * 400) + "\n"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    save_tiny_model(root / "model", "llama", seed=0)
    save_tiny_model(root / "other", "llama", seed=1)
    (root / "text.txt").write_text(TEXT)
    return root


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.err


ABLATION = ("--scorer", "ablation", "--ablation-sequences", 2, "--ablation-seq-len", 64, "--ablation-from", 32,
            "--ablation-window", 8, "--ablation-sinks", 1)


def analyze_args(ws, out="scores.json", *extra):
    """`analyze` at sizes a tiny model and TEXT allow (the default scorer, ablation, included)."""
    return ("analyze", ws / "model", "--data", ws / "text.txt", "--out", ws / out,
            "--sequences", 4, "--seq-len", 64, *ABLATION[2:], *extra)


def test_analyze_then_convert(workspace, capsys):
    ws = workspace
    code, err = run(capsys, *analyze_args(ws, "scores.json", "--plot", ws / "heads.png"))
    assert code == 0, err
    scores = json.loads((ws / "scores.json").read_text())
    assert len(scores["groups"]) == 4 and len(scores["heads"]) == 8
    assert (ws / "heads.png").stat().st_size > 1000

    code, err = run(capsys, "convert", ws / "model", "--scores", ws / "scores.json", "--beta", 0.5, "--out", ws / "converted")
    assert code == 0, err
    model = AutoModelForCausalLM.from_pretrained(ws / "converted")
    assert len(model.spec.groups) == 2
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 7)


def one_line_error(code, err, fragment):
    """Exit code 2 and the error as the last line of stderr (progress bars may precede it)."""
    assert code == 2
    assert "Traceback" not in err
    last = err.rstrip("\n").split("\n")[-1]
    assert last.startswith("recurformer: error: ") and fragment in last


@pytest.mark.parametrize("beta", ["1.5", "-0.1", "nan"])
def test_convert_refuses_beta_out_of_range(workspace, capsys, beta):
    code, err = run(capsys, "convert", workspace / "model", "--scores", workspace / "scores.json",
                    "--beta", beta, "--out", workspace / f"bad-{beta}")
    one_line_error(code, err, "beta must be in [0, 1]")
    assert not (workspace / f"bad-{beta}").exists()


def test_convert_refuses_scores_of_another_model(workspace, capsys):
    run(capsys, *analyze_args(workspace, "scores-a.json"))
    code, err = run(capsys, "convert", workspace / "other", "--scores", workspace / "scores-a.json",
                    "--beta", 0.5, "--out", workspace / "wrong")
    one_line_error(code, err, "scores were computed on another model")
    assert not (workspace / "wrong").exists()


def test_analyze_refuses_a_missing_data_file(workspace, capsys):
    code, err = run(capsys, "analyze", workspace / "model", "--data", workspace / "nope.txt",
                    "--out", workspace / "never.json")
    one_line_error(code, err, "data file not found")
    assert not (workspace / "never.json").exists()


def test_unknown_model_name(workspace, capsys):
    code, err = run(capsys, "analyze", "gpt-17", "--data", workspace / "text.txt", "--out", workspace / "never.json")
    one_line_error(code, err, "gpt-17")
    assert not (workspace / "never.json").exists()


def test_convert_refuses_to_overwrite_without_force(workspace, capsys):
    target = workspace / "occupied"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    code, err = run(capsys, "convert", workspace / "model", "--scores", workspace / "scores.json",
                    "--beta", 0.25, "--out", target)
    one_line_error(code, err, "exists and is not empty")
    assert (target / "keep.txt").read_text() == "mine"


def test_sequences_longer_than_the_model_allows(workspace, capsys):
    code, err = run(capsys, "analyze", workspace / "model", "--data", workspace / "text.txt",
                    "--out", workspace / "never.json", "--seq-len", 4096)
    one_line_error(code, err, "longer than the model allows")


def test_no_traceback_from_the_installed_command(workspace):
    result = subprocess.run(
        [sys.executable, "-m", "recurformer.cli", "convert", str(workspace / "model"), "--scores",
         str(workspace / "missing.json"), "--beta", "0.5", "--out", str(workspace / "x")],
        capture_output=True, text=True,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "scores file not found" in result.stderr


def scores_file(ws, capsys):
    if not (ws / "scores.json").exists():
        assert run(capsys, *analyze_args(ws, "scores.json"))[0] == 0
    return ws / "scores.json"


@pytest.mark.parametrize("mixer, flags, expected", [
    ("mamba2", [], {"kind": "mamba2"}),
    ("window", ["--window", 8, "--sinks", 1], {"kind": "window", "window": 8, "sinks": 1}),
])
def test_convert_and_train_with_another_mixer(workspace, capsys, mixer, flags, expected):
    ws = workspace
    converted, trained = ws / f"converted-{mixer}", ws / f"trained-{mixer}"
    code, err = run(capsys, "convert", ws / "model", "--scores", scores_file(ws, capsys), "--beta", 0.5,
                    "--mixer", mixer, *flags, "--out", converted)
    assert code == 0, err
    saved = json.loads((converted / "config.json").read_text())["mixer"]
    assert {k: saved[k] for k in expected} == expected
    code, err = run(capsys, "train", converted, "--data", ws / "text.txt", "--stage", "transfer", "--steps", 2,
                    "--seq-len", 32, "--batch-size", 2, "--out", trained)
    assert code == 0, err
    model = AutoModelForCausalLM.from_pretrained(trained)
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 7)


@pytest.mark.parametrize("flags, fragment", [
    (["--mixer", "window", "--window", 0], "window must be 'auto' or a positive integer, got 0"),
    (["--mixer", "window", "--sinks", -2], "sinks must be a non-negative integer, got -2"),
    # the readers of a field are every registered kind that declares it (`Mixer.reads`)
    (["--mixer", "mamba", "--window", 8], f"--window applies to --mixer {'|'.join(kinds_reading('window'))}, "
     "not --mixer mamba"),
    (["--mixer", "mamba2", "--sinks", 2], f"--sinks applies to --mixer {'|'.join(kinds_reading('sinks'))}, "
     "not --mixer mamba2"),
    (["--mixer", "window", "--state-dtype", "bfloat16"],
     f"--state-dtype applies to --mixer {'|'.join(kinds_reading('state_dtype'))}, not --mixer window"),
    (["--state-dtype", "fp8"], "state_dtype: unknown 'fp8'; choose one of float32, bfloat16, float16"),
])
def test_convert_refuses_bad_mixer_flags(workspace, capsys, flags, fragment):
    target = workspace / "never-mixer"
    code, err = run(capsys, "convert", workspace / "model", "--scores", scores_file(workspace, capsys), "--beta", 0.5,
                    *flags, "--out", target)
    one_line_error(code, err, fragment)
    assert not target.exists()


def test_analyze_with_the_ablation_scorer_then_convert_the_cheapest_groups(workspace, capsys):
    ws = workspace
    code, err = run(capsys, *analyze_args(ws, "ablation.json", *ABLATION))
    assert code == 0, err
    saved = json.loads((ws / "ablation.json").read_text())
    assert saved["ablation"]["ablation_window"] == 8 and saved["ablation"]["ablation_sequences"] == 2
    assert saved["ablation"]["ablation_rounds"] == 1  # one round: the greedy rounds are ablation-greedy's
    costs = {(g["layer"], g["kv_head"]): g["ablation"] for g in saved["groups"]}
    assert len(costs) == 4 and not (ws / "ablation.json.ablation-partial.json").exists()
    code, err = run(capsys, "convert", ws / "model", "--scores", ws / "ablation.json", "--scorer", "ablation",
                    "--beta", 0.5, "--out", ws / "converted-ablation")
    assert code == 0, err
    config = json.loads((ws / "converted-ablation" / "config.json").read_text())
    replaced = {tuple(g) for g in config["replacement"]["groups"]}
    assert replaced == set(sorted(costs, key=lambda g: (costs[g], g))[:2])


def test_analyze_with_the_greedy_ablation_scorer_then_convert_its_first_rounds_groups(workspace, capsys):
    ws = workspace
    code, err = run(capsys, *analyze_args(ws, "greedy.json", "--scorer", "ablation-greedy", *ABLATION[2:],
                                          "--ablation-rounds", 2))
    assert code == 0, err
    saved = json.loads((ws / "greedy.json").read_text())
    assert saved["ablation"]["ablation_rounds"] == 2 and len(saved["ablation"]["round_base_nll"]) == 2
    order = {(g["layer"], g["kv_head"]): g["ablation_order"] for g in saved["groups"]}
    assert sorted(order.values()) == [0, 1, 2, 3]
    code, err = run(capsys, "convert", ws / "model", "--scores", ws / "greedy.json", "--scorer", "ablation-greedy",
                    "--beta", 0.5, "--out", ws / "converted-greedy")
    assert code == 0, err
    config = json.loads((ws / "converted-greedy" / "config.json").read_text())
    assert {tuple(g) for g in config["replacement"]["groups"]} == {g for g, o in order.items() if o < 2}


def test_the_ablation_scorer_says_how_much_text_it_needs(workspace, capsys):
    code, err = run(capsys, *analyze_args(workspace, "never.json", *ABLATION[:2], "--ablation-sequences", 1000, "--ablation-from", 32,
                                          "--ablation-seq-len", 64))
    one_line_error(code, err, "needs 1000 x 64 = 64000 tokens of calibration text")
    assert not (workspace / "never.json").exists()


def test_the_default_scorer_needs_ablation_scores_and_names_the_alternative(workspace, capsys):
    assert run(capsys, *analyze_args(workspace, "recency.json", "--scorer", "recency"))[0] == 0
    code, err = run(capsys, "convert", workspace / "model", "--scores", workspace / "recency.json",
                    "--beta", 0.5, "--out", workspace / "never")
    one_line_error(code, err, "no ablation costs")
    assert "--scorer recency" in err
    code, err = run(capsys, "convert", workspace / "model", "--scores", workspace / "recency.json",
                    "--scorer", "recency", "--beta", 0.5, "--out", workspace / "recency-converted")
    assert code == 0, err


def test_eval_refuses_a_missing_data_file_before_loading_the_model(workspace, capsys, monkeypatch):
    def never(name):
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr("recurformer.commands.load_any", never)
    code, err = run(capsys, "eval", workspace / "model", "--task", "ppl", "--data", workspace / "nope.txt",
                    "--out", workspace / "never.json")
    one_line_error(code, err, "data file not found")
    assert not (workspace / "never.json").exists()


def test_train_takes_its_defaults_from_the_recipe_of_the_folders_kind(tmp_path):
    """`train` without flags trains as `run` does: the tail recipe for window+mamba2."""
    folder = tmp_path / "converted"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "recurformer", "mixer": {"kind": "window+mamba2"}}))
    lm = recipe_train_config(str(folder), {"stage": "lm", "steps": 3})
    expected = RECIPES["tail-mamba2"].lm
    assert (lm.trainable, lm.lr, lm.seq_len, lm.batch_size, lm.ce_weight, lm.distill_weight) == (
        expected.trainable, expected.lr, expected.seq_len, expected.batch_size, expected.ce_weight,
        expected.distill_weight)
    given = recipe_train_config(str(folder), {"steps": 3, "lr": 0.01, "batch_size": 2, "seq_len": 64})
    assert (given.stage, given.trainable, given.lr, given.batch_size, given.grad_accum) == ("transfer", "tail", 0.01,
                                                                                            2, 1)


def test_one_name_per_concept_and_the_old_names_still_work():
    parser = build_parser()

    def parsed(*argv):
        return vars(parser.parse_args(list(argv)))

    assert parsed("train", "d", "--data", "t", "--out", "o", "--original", "m")["teacher"] == "m"
    assert parsed("train", "d", "--data", "t", "--out", "o", "--teacher", "m")["teacher"] == "m"
    assert parsed("bench", "d", "--out", "o", "--original", "m")["baseline"] == "m"
    assert parsed("bench", "d", "--out", "o", "--baseline", "m", "--context", "64")["contexts"] == (64,)
    assert parsed("bench", "d", "--out", "o", "--contexts", "64,128")["contexts"] == (64, 128)
    assert parsed("eval", "d", "--task", "agreement", "--original", "m")["reference"] == "m"
    assert parsed("eval", "d", "--task", "agreement", "--reference", "m")["reference"] == "m"
    assert parsed("analyze", "m", "--data", "t", "--out", "o", "--recency-window", "8")["window"] == 8
    assert parsed("analyze", "m", "--data", "t", "--out", "o", "--window", "8")["window"] == 8
    assert parsed("run", "some/model", "--out", "o")["model_argument"] == "some/model"


def test_version_and_one_line_argparse_errors(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.strip().startswith("recurformer ")
    for argv, message in [(["eval", "m", "--task", "ppl", "--context", "abc"], "--context: expected an integer, got 'abc'"),
                          (["convert", "m", "--scores", "s", "--out", "o", "--mixer", "bogus"],
                           "--mixer: invalid choice: 'bogus' (choose from"),
                          (["bench", "d", "--out", "o", "--contexts", "0"], "--contexts: expected positive integers")]:
        with pytest.raises(SystemExit) as stop:
            main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(err) == 1 and message in err[0], err
        assert err[0].count(message.split(":")[0] + ":") == 1  # the flag named once


def test_run_takes_the_model_as_the_other_commands_do(capsys):
    assert main(["run", "a/model", "--model", "b/model", "--out", "o"]) == 2
    assert "MODEL 'a/model' and --model 'b/model' disagree" in capsys.readouterr().err
