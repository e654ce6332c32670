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


def test_the_joint_selection_merges_both_costs_and_compares_the_three_scorers(tmp_path):
    from recurformer.scoring import HeadScores

    def scores(statistic, costs, fingerprint="f"):
        heads = {"rr_16": [[0.5] * 4] * 3, "sink": [[0.0] * 4] * 3}
        made = HeadScores("toy", 3, 4, 2, 16, [16], 1, 8, heads)
        made.fingerprint, made.groups[statistic], made.ablation = fingerprint, costs, {"seconds": 1.0}
        return made

    text = [[0.01, 0.02], [0.03, 0.04], [0.05, 0.06]]
    retrieval = [[0.9, 0.3], [0.7, 0.2], [0.4, -0.1]]
    with benchmark_script("retrieval.joint_selection") as module:
        both = module.merged(scores("ablation", text), scores("ablation_retrieval", retrieval))
        result = module.compare(both, 0.5)
        with pytest.raises(SystemExit, match="different models"):
            module.merged(scores("ablation", text), scores("ablation_retrieval", retrieval, fingerprint="g"))
        with pytest.raises(SystemExit, match="no ablation_retrieval costs"):
            module.merged(scores("ablation", text), scores("ablation", text))
    assert both.ablation["probe"] == "text+retrieval" and both.ablation["seconds"] == 2.0
    # ablation: (0,0) (0,1) (1,0); retrieval: (0,1) (1,1) (2,1); joint: (0,0) (0,1) (1,1)
    assert result["ablation-joint"]["shared"] == {"ablation": 2, "ablation-retrieval": 2}
    assert result["ablation"]["text_cost"] == pytest.approx(0.06)
    assert result["ablation-retrieval"]["retrieval_cost"] == pytest.approx(0.4)
    both.save(tmp_path / "scores.json")
    assert HeadScores.load(tmp_path / "scores.json").groups["ablation_retrieval"] == retrieval


def test_a_window_perplexity_that_is_not_finite_is_refused(guard, monkeypatch):
    from types import SimpleNamespace

    from recurformer.errors import RecurformerError
    monkeypatch.setattr(guard, "load_any", lambda name: (object(), object()))
    monkeypatch.setattr(guard, "window_baseline", lambda teacher, model: (SimpleNamespace(eval=lambda: None), 169))
    task = SimpleNamespace(measure=lambda model, tokenizer, options: {"ppl": float("nan")})
    monkeypatch.setattr(guard, "lookup_task", lambda name: (task, None))
    monkeypatch.setattr(guard, "make_options", lambda task, values: values)
    with pytest.raises(RecurformerError, match="the window's .* perplexity"):
        guard.window_perplexities("original", "converted")


@pytest.mark.parametrize("betas", ["1.5", "x", "0", ""])
def test_the_joint_selection_refuses_bad_betas_in_one_line(betas, tmp_path, monkeypatch):
    with benchmark_script("retrieval.joint_selection") as module:
        monkeypatch.setattr(sys, "argv", ["joint_selection.py", "--betas", betas, "--out", str(tmp_path / "out.json")])
        monkeypatch.setattr(module.HeadScores, "load", lambda path: pytest.fail("read scores"))
        with pytest.raises(SystemExit, match="--betas takes fractions in"):
            module.main()
    assert not (tmp_path / "out.json").exists()
