import json

import pytest
from tiny_models import save_tiny_model, tiny_model, tiny_tokenizer

from recurformer.cli import main
from recurformer.config import ConfigError
from recurformer.data import DataError
from recurformer.evaluate import lookup_task, make_options
from recurformer.evaluate.passkey import parse_depths
from recurformer.tasks.passkey import FORMATS, generate_passkey, parse_key, score_passkey

# Printable ASCII, space and newline as byte-level characters: every character of the prompts.
ASCII = [chr(c) for c in range(33, 127)] + [chr(256 + 32), chr(256 + 10)]
TEXT = ("The quick brown fox jumps over the lazy dog. A stitch in time saves nine.\n"
        "All that glitters is not gold; the early bird catches the worm.\n") * 60


@pytest.mark.parametrize("fmt", [f for f in FORMATS if not FORMATS[f].chat])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 0.9, 1.0])
def test_the_needle_sits_at_the_asked_depth_of_a_prompt_of_the_asked_length(fmt, depth):
    tokenizer = tiny_tokenizer(alphabet=ASCII)
    haystack = tokenizer.encode(TEXT)
    for problem in generate_passkey(tokenizer, haystack, 500, (depth,), problems=3, fmt=fmt):
        tokens = tokenizer.encode(problem.prompt)
        assert abs(len(tokens) - 500) <= 4
        assert tokenizer.decode(tokens[problem.needle_token:]).startswith("The pass key is " + problem.answer)
        style = FORMATS[fmt]
        prefix = len(tokenizer.encode(style.prefix))
        stack = len(tokens) - prefix - len(tokenizer.encode(style.needle.format(key=problem.answer) + style.suffix))
        assert abs(problem.needle_token - (prefix + depth * stack)) <= 0.02 * 500 + 4
        assert len(problem.answer) == 5 and problem.answer.isdigit()


def test_keys_and_windows_depend_on_the_seed_only():
    tokenizer = tiny_tokenizer(alphabet=ASCII)
    haystack = tokenizer.encode(TEXT)
    a, b = (generate_passkey(tokenizer, haystack, 300, (0.5,), 4, seed=1) for _ in range(2))
    c = generate_passkey(tokenizer, haystack, 300, (0.5,), 4, seed=2)
    assert a == b and [p.answer for p in a] != [p.answer for p in c]


def test_answers_are_parsed_exactly():
    assert parse_key(" 48213. Remember it.") == "48213" and parse_key("\n48213") == "48213"
    assert parse_key(" the key") is None
    tokenizer = tiny_tokenizer(alphabet=ASCII)
    problems = generate_passkey(tokenizer, tokenizer.encode(TEXT), 300, (0.1, 0.9), 2)
    other_first_digit = str((int(problems[3].answer[0]) + 1) % 10) + problems[3].answer[1:]
    completions = [" " + problems[0].answer + ".", problems[1].answer + "7", "", " " + other_first_digit]
    result = score_passkey(completions, problems)
    assert result["accuracy"] == 0.25 and result["n"] == 4
    assert [(c["depth"], c["accuracy"]) for c in result["cells"]] == [(0.1, 0.5), (0.9, 0.0)]


def test_the_task_runs_and_reports_every_cell(tmp_path):
    data = tmp_path / "haystack.txt"
    data.write_text(TEXT)
    task, _ = lookup_task("passkey")
    options = make_options(task, {"data": [str(data)], "context": 500, "depths": (0.2, 0.8), "problems": 3})
    result = task.evaluate(tiny_model("llama"), tiny_tokenizer(alphabet=ASCII), options)
    assert result["n"] == 6 and 0.0 <= result["accuracy"] <= 1.0
    assert [(c["context"], c["depth"], c["n"]) for c in result["cells"]] == [(500, 0.2, 3), (500, 0.8, 3)]


def test_bad_haystacks_and_options_are_one_line_errors(tmp_path):
    task, _ = lookup_task("passkey")
    empty, short = tmp_path / "empty.txt", tmp_path / "short.txt"
    empty.write_text("\n")
    short.write_text("Too short to hide anything in.\n")
    model, tokenizer = tiny_model("llama"), tiny_tokenizer(alphabet=ASCII)
    with pytest.raises(DataError, match="empty"):
        task.evaluate(model, tokenizer, make_options(task, {"data": [str(empty)], "context": 500}))
    with pytest.raises(DataError, match="fewer than"):
        task.evaluate(model, tokenizer, make_options(task, {"data": [str(short)], "context": 500}))
    with pytest.raises(DataError, match="leaves no room for a haystack"):
        task.evaluate(model, tokenizer, make_options(task, {"data": [str(short)], "context": 100}))
    with pytest.raises(ConfigError, match="--depths"):
        parse_depths("0.1,half")
    with pytest.raises(ConfigError, match="--depths"):
        make_options(task, {"data": [str(short)], "depths": (1.5,)})


def test_the_cli_runs_the_long_range_tasks_and_writes_their_json(tmp_path):
    directory = save_tiny_model(tmp_path / "model")
    data = tmp_path / "haystack.txt"
    data.write_text(TEXT)
    out = tmp_path / "passkey.json"
    assert main(["eval", str(directory), "--task", "passkey", "--data", str(data), "--context", "500", "--depths",
                 "0.2,0.8", "--problems", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["task"] == "passkey" and result["depths"] == [0.2, 0.8] and result["n"] == 2
    assert main(["eval", str(directory), "--task", "ppl-by-distance", "--data", str(data), "--context", "300",
                 "--out", str(out)]) == 0
    assert [b["bucket"] for b in json.loads(out.read_text())["buckets"]] == ["0-64", "64-256", "256-300"]
