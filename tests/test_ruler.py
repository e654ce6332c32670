"""The RULER-style tasks (`tasks/ruler.py`) and `recurformer eval --task ruler`: prompts of the asked
size holding what the answer needs, seeded, scored by RULER's string match; bad input is a
one-line error with no output file."""

import json
import re
from collections import Counter

import pytest
from tiny_models import save_tiny_model, tiny_model, tiny_tokenizer

from recurformer.cli import main
from recurformer.config import ConfigError
from recurformer.data import DataError
from recurformer.evaluate import lookup_task, make_options
from recurformer.tasks.ruler import FORMATS, NOISE, TASKS, Sources, generate_ruler, parse_tasks, score_ruler, summarize

ASCII = [chr(c) for c in range(33, 127)] + [chr(256 + 32), chr(256 + 10)]
# Sentences with a vocabulary of a thousand made-up words of three syllables.
SYLLABLES = ["ba", "ko", "ri", "mu", "te", "lo", "sa", "ni", "po", "de"]
WORDS = [a + b + c for a in SYLLABLES for b in SYLLABLES for c in SYLLABLES]
TEXT = "\n".join(f"The {a} near the {b} was quiet today. Nobody saw the {c} again!"
                  for a, b, c in zip(WORDS, WORDS[7:] + WORDS[:7], WORDS[50:] + WORDS[:50]))


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE learned on the haystack and the prompts' words: about a token a word, as
    a real tokenizer (a byte-level one of 97 tokens makes a word list 3 times longer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lines = TEXT.splitlines() + [task.instruction for task in TASKS.values()] + [NOISE] * 5
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    model.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=1500, special_tokens=["<eos>"],
                                                         initial_alphabet=ASCII, show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<eos>", pad_token="<eos>")


@pytest.fixture(scope="module")
def sources():
    return Sources.from_text(TEXT)


def size(tokenizer, problem):
    return len(tokenizer.encode(problem.context)) + len(tokenizer.encode(problem.question, add_special_tokens=False))


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "chat"])
def test_every_task_fills_its_prompt_and_holds_its_answers(tokenizer, sources, fmt):
    budget = 4096
    for problem in generate_ruler(tokenizer, sources, tuple(TASKS), budget, 1, seed=3, fmt=fmt):
        tokens = size(tokenizer, problem)
        assert budget * 0.9 <= tokens <= budget, (problem.task, tokens)
        assert problem.answers and all(answer in problem.context for answer in problem.answers)
        assert problem.question.rstrip().endswith(("are", "are:")), problem.question[-40:]
        assert all(answer not in problem.question for answer in problem.answers)


def test_needles_keys_and_values_are_as_ruler_lays_them_out(tokenizer, sources):
    by_task = {p.task: p for p in generate_ruler(tokenizer, sources, tuple(TASKS), 3000, 1, seed=1)}
    noise = by_task["niah_single_1"]
    assert noise.context.count(NOISE) > 20 and len(noise.answers) == 1 and re.fullmatch(r"\d{7}", noise.answers[0])
    assert re.search(r"One of the special magic numbers for [a-z]+-[a-z]+ is: " + noise.answers[0], noise.context)
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}",
                        by_task["niah_single_3"].answers[0])
    assert by_task["niah_single_2"].context.count("One of the special magic") == 1
    assert by_task["niah_multikey_1"].context.count("One of the special magic") == 4
    assert len(by_task["niah_multikey_1"].answers) == 1
    multivalue = by_task["niah_multivalue"]
    keys = set(re.findall(r"special magic numbers for (\S+) is:", multivalue.context))
    assert len(keys) == 1 and len(multivalue.answers) == 4 and keys.pop() in multivalue.question
    multiquery = by_task["niah_multiquery"]
    assert len(multiquery.answers) == 4 and multiquery.question.count("-") >= 4
    vt = by_task["vt"]
    chain = re.findall(r"VAR ([A-Z]{5}) = (VAR ([A-Z]{5})|\d{5})\.", vt.context)
    assert [name for name, _, _ in chain] == list(vt.answers) and chain[0][1] in vt.question
    assert all(before == previous for (previous, _, _), (_, _, before) in zip(chain, chain[1:]))


def test_the_word_counts_make_the_answers_the_most_frequent(tokenizer, sources):
    cwe, fwe = generate_ruler(tokenizer, sources, ("cwe", "fwe"), 4096, 1, seed=2)
    counts = Counter(re.findall(r"\d+\. ([a-z]+)", cwe.context.split(TASKS["cwe"].instruction)[-1]))
    common = {word for word, _ in counts.most_common(10)}
    assert common == set(cwe.answers) and min(counts[w] for w in common) > max(
        c for w, c in counts.items() if w not in common)
    words = Counter(fwe.context.split(TASKS["fwe"].instruction)[-1].split())
    del words["...."]
    top = [word for word, _ in words.most_common(4)]
    assert top[:3] == list(fwe.answers) and words[top[2]] > words[top[3]]


def test_problems_depend_on_the_seed_only(tokenizer, sources):
    a, b = (generate_ruler(tokenizer, sources, ("niah_single_2", "vt"), 1500, 2, seed=5) for _ in range(2))
    c = generate_ruler(tokenizer, sources, ("niah_single_2", "vt"), 1500, 2, seed=6)
    assert a == b and [p.answers for p in a] != [p.answers for p in c]


def test_the_chat_format_puts_the_question_after_the_context_in_the_user_turn(tokenizer, sources):
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    problem, = generate_ruler(tokenizer, sources, ("niah_single_2",), 1500, 1, fmt="chat")
    assert problem.context.startswith("<user>" + TASKS["niah_single_2"].instruction)
    assert problem.question.startswith("\nWhat are all") and "</><assistant>The special magic" in problem.question


def test_scoring_is_rulers_string_match_all():
    assert score_ruler(" 1234567.", ["1234567"]) == 1.0
    assert score_ruler("ABCDE, fghij and KLMNO", ["abcde", "FGHIJ", "xyzzy", "klmno"]) == 0.75
    assert score_ruler("", ["1234567"]) == 0.0
    summary = summarize([{"task": "a", "score": 1.0}, {"task": "a", "score": 0.5}, {"task": "b", "score": 0.0}])
    assert summary["tasks"] == {"a": {"n": 2, "score": 75.0}, "b": {"n": 1, "score": 0.0}}
    assert summary["mean"] == 37.5


def test_unknown_tasks_and_short_texts_are_named(tokenizer, sources):
    assert parse_tasks("all") == tuple(TASKS) and parse_tasks("vt, cwe") == ("vt", "cwe")
    with pytest.raises(ValueError, match="unknown RULER task 'nope'"):
        parse_tasks("vt,nope")
    short = Sources.from_text("A short text. It has three sentences. That is all.")
    with pytest.raises(ValueError, match="too short"):
        generate_ruler(tokenizer, short, ("niah_single_2",), 1000, 1)
    with pytest.raises(ValueError, match="no room"):
        generate_ruler(tokenizer, sources, ("niah_single_2",), 60, 1)
    with pytest.raises(ValueError, match="no room"):  # the example does not fit half the prompt
        generate_ruler(tokenizer, sources, ("niah_multikey_1",), 150, 1, fmt="oneshot")


def test_a_short_prompts_example_takes_a_larger_share(tokenizer, sources):
    problem, = generate_ruler(tokenizer, sources, ("niah_multikey_1",), 700, 1, fmt="oneshot")
    example, haystack = problem.context.split(TASKS["niah_multikey_1"].instruction)[1:]  # example first
    assert size(tokenizer, problem) <= 700 and problem.answers[0] in haystack and "are" in example


def test_the_task_answers_every_problem_and_reports_every_task(tmp_path):
    data = tmp_path / "haystack.txt"
    data.write_text(TEXT)
    task, _ = lookup_task("ruler")
    options = make_options(task, {"data": [str(data)], "context": 480, "tasks": "niah_single_1,niah_single_2",
                                  "problems": 2, "format": "plain"})
    result = task.evaluate(tiny_model("llama"), tiny_tokenizer(alphabet=ASCII), options)
    assert set(result["tasks"]) == {"niah_single_1", "niah_single_2"} and all(t["n"] == 2 for t in result["tasks"].values())
    assert len(result["records"]) == 4 and all(0.0 <= r["score"] <= 1.0 for r in result["records"])
    assert re.fullmatch(r"[0-9a-f]{16}", result["digest"])


@pytest.mark.parametrize("flags, message", [
    (["--context", "600"], "longer than the model allows"),
    (["--tasks", "niah_single_1,nope"], "unknown RULER task 'nope'"),
    (["--problems", "0"], "--problems must be >= 1"),
    (["--context", "480", "--tasks", "niah_single_2", "--format", "plain", "--data", "{short}"], "too short"),
])
def test_bad_input_is_one_line_exit_2_and_no_output(tmp_path, capsys, flags, message):
    model = save_tiny_model(tmp_path / "model")
    short = tmp_path / "short.txt"
    short.write_text("Too short. Nothing to hide in.\n")
    out = tmp_path / "out.json"
    flags = [f.format(short=short) for f in flags]
    try:
        code = main(["eval", str(model), "--task", "ruler", "--out", str(out), *flags])
    except SystemExit as stop:  # argparse's own errors (a bad --tasks value)
        code = stop.code
    assert code == 2 and not out.exists()
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in error, error


def test_options_are_checked_up_front(tmp_path):
    task, _ = lookup_task("ruler")
    with pytest.raises(ConfigError, match="--problems"):
        make_options(task, {"data": ["x.txt"], "problems": 0})
    with pytest.raises(ConfigError, match="--format"):
        make_options(task, {"data": ["x.txt"], "format": "fancy"})
    with pytest.raises(ConfigError, match="unknown RULER task"):
        make_options(task, {"data": ["x.txt"], "tasks": "vt,nope"})
    data = tmp_path / "short.txt"
    data.write_text("Too short. Nothing to hide in.\n")
    with pytest.raises(DataError, match="too short"):
        task.evaluate(tiny_model("llama"), tiny_tokenizer(alphabet=ASCII),
                      make_options(task, {"data": [str(data)], "context": 480, "tasks": "niah_single_2",
                                           "format": "plain"}))


def test_the_result_file_is_written(tmp_path, capsys):
    model = save_tiny_model(tmp_path / "model")
    data = tmp_path / "haystack.txt"
    data.write_text(TEXT)
    out = tmp_path / "out.json"
    main(["eval", str(model), "--task", "ruler", "--data", str(data), "--context", "480", "--tasks", "niah_single_2",
          "--problems", "1", "--format", "plain", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["task"] == "ruler" and result["tasks"]["niah_single_2"]["n"] == 1
