"""The shared-context task: contexts of the asked size holding every fact, templates no other task
uses, answers equal to plain greedy decoding in both modes, intervals over contexts, and bad
input as a one-line error with no output file."""

import copy
import json
import re

import numpy as np
import pytest
import torch
from test_ruler import ASCII, TEXT
from tiny_models import MIXERS, WORDS, save_tiny_run_model, spec_for, tiny_model, tiny_tokenizer

from recurformer import convert
from recurformer.cache import CACHE_ARGUMENT
from recurformer.cli import main
from recurformer.evaluate.bootstrap import interval, mean, paired_interval
from recurformer.evaluate.conversation import EXTRA_TOKENS, ask
from recurformer.evaluate.shared_context import context_ids, value_start
from recurformer.retrieval_probe import NEEDLE as PROBE_NEEDLE, QUESTION as PROBE_QUESTION
from recurformer.tasks import passkey, ruler
from recurformer.tasks.ruler import Sources
from recurformer.tasks.shared_context import FORMATS, INSTRUCTION, KINDS, generate_shared_contexts, is_exact


# Sentences of the words the run model's tokenizer knows whole: about a token a word.
RUN_TEXT = "\n".join(f"The {a} near the {b} was quiet. Nobody saw the {c} again."
                     for a, b, c in zip(WORDS, WORDS[5:] + WORDS[:5], WORDS[20:] + WORDS[:20])) * 3
SHORT = "The harbour lantern stood quietly near seven orchards. Nobody walked there after winter.\n"


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer(vocab_size=97, alphabet=ASCII)


@pytest.fixture(scope="module")
def sources():
    return Sources.from_text(TEXT)


def test_every_context_fills_its_budget_and_holds_every_fact_in_its_slice(tokenizer, sources):
    for problem in generate_shared_contexts(tokenizer, sources, 3, 3000, 9, 6, seed=2):
        assert 0.9 * 3000 <= len(tokenizer.encode(problem.context)) <= 3000
        assert sorted(n.kind for n in problem.needles) == sorted(KINDS * 3)
        assert len({n.key for n in problem.needles}) == 9 and len(set(problem.asked)) == 6
        positions = [problem.context.index(n.statement) for n in problem.needles]
        assert positions == sorted(positions)  # in the text's order, one per ninth of it
        for i, (needle, at) in enumerate(zip(problem.needles, positions)):
            assert i / 9 <= needle.depth < (i + 1) / 9
            assert abs(at / len(problem.context) - needle.depth) < 0.1
        for question, later, answer, index in zip(problem.questions, problem.later_questions, problem.answers,
                                                  problem.asked):
            needle = problem.needles[index]
            assert needle.question in question and needle.question in later and answer == needle.answer and answer.strip() == needle.value
            assert question.endswith(needle.answer_start) and needle.value not in question


def test_values_have_their_kinds_formats(tokenizer, sources):
    problem, = generate_shared_contexts(tokenizer, sources, 1, 2000, 6, 6, seed=1)
    patterns = {"number": r"\d{7}", "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}",
                "word": r"[a-z]{4,10}"}
    assert all(re.fullmatch(patterns[n.kind], n.value) for n in problem.needles)


def test_contexts_depend_on_the_seed_and_their_index_only(tokenizer, sources):
    a = generate_shared_contexts(tokenizer, sources, 3, 1500, 4, 4, seed=5)
    b = generate_shared_contexts(tokenizer, sources, 2, 1500, 4, 4, seed=5)
    c = generate_shared_contexts(tokenizer, sources, 2, 1500, 4, 4, seed=6)
    assert a[:2] == b and [p.needles for p in b] != [p.needles for p in c]


def test_no_other_tasks_template_occurs_in_it_nor_its_in_theirs(tokenizer, sources):
    problem, = generate_shared_contexts(tokenizer, sources, 1, 2000, 6, 6)
    ours = problem.context + "".join(problem.questions + problem.later_questions)
    theirs = [task.instruction for task in ruler.TASKS.values()] + [
        "special magic", passkey.INSTRUCTION.strip(), passkey.QUESTION, passkey.ANSWER_START,
        PROBE_NEEDLE.split("{")[0].strip(), PROBE_QUESTION.split("{")[0].strip()]
    assert not [t for t in theirs if t.lower() in ours.lower()]
    templates = [INSTRUCTION, "lock code of the", "tracking ID of the", "password of the"]
    others = " ".join(theirs) + passkey.EXAMPLE
    assert not [t for t in templates if t.lower() in others.lower()]


def test_the_chat_format_asks_in_user_turns_and_answers_in_assistant_turns(tokenizer, sources):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    problem, = generate_shared_contexts(tokenizer, sources, 1, 1500, 3, 3, fmt="chat")
    needle = problem.needles[problem.asked[1]]
    assert problem.context.startswith("<user>" + INSTRUCTION)
    assert problem.questions[1] == f"\n\n{needle.question}</><assistant>{needle.answer_start}"
    assert problem.later_questions[1] == f"</><user>{needle.question}</><assistant>{needle.answer_start}"


def test_exact_match_wants_the_whole_value_first():
    assert is_exact(" 4827193.\n", "4827193") and is_exact("harbour", "harbour")
    assert not is_exact(" 48271930", "4827193") and not is_exact(" harbours", "harbour")
    assert not is_exact(" The code is 4827193", "4827193") and not is_exact("", "4827193")


def test_bad_sizes_are_named(tokenizer, sources):
    with pytest.raises(ValueError, match="questions must be between 1 and"):
        generate_shared_contexts(tokenizer, sources, 1, 1500, 4, 0)
    with pytest.raises(ValueError, match="fewer needles or a longer context"):
        generate_shared_contexts(tokenizer, sources, 1, 300, 12, 12)
    with pytest.raises(ValueError, match="too short"):
        generate_shared_contexts(tokenizer, Sources.from_text(SHORT), 1, 1500, 2, 2)
    with pytest.raises(ValueError, match="unknown shared-context format"):
        generate_shared_contexts(tokenizer, sources, 1, 1500, 2, 2, fmt="fancy")
    assert set(FORMATS) == {"plain", "chat"}


@torch.no_grad()
def greedy_reference(model, cache, position, prompt, most, eos):
    """Plain greedy decoding, one token at a time: what `ask` must reproduce."""
    answer, step = [], prompt
    while True:
        positions = torch.arange(position, position + len(step))[None]
        logits = model(input_ids=torch.tensor([step]), position_ids=positions, use_cache=True,
                       **{CACHE_ARGUMENT: cache}).logits
        position += len(step)
        token = int(logits[0, -1].argmax())
        if token in eos:
            return answer, []
        answer.append(token)
        if len(answer) >= most:
            return answer, [token]
        step = [token]


@torch.no_grad()
def reference(model, context, questions, later, golds, eos):
    """Both modes by plain greedy decoding: every question from a fresh prefill; then one conversation."""
    def prefill():
        return model(input_ids=torch.tensor([context]), use_cache=True)[CACHE_ARGUMENT]

    requests = [greedy_reference(model, prefill(), len(context), q, len(g) + EXTRA_TOKENS, eos)[0]
                for q, g in zip(questions, golds)]
    cache, position, pending, turns = prefill(), len(context), [], []
    for i, gold in enumerate(golds):
        prompt = pending + (questions[0] if i == 0 else later[i])
        answer, pending = greedy_reference(model, cache, position, prompt, len(gold) + EXTRA_TOKENS, eos)
        turns.append(answer)
        position += len(prompt) + len(answer) - len(pending)
    return {"multi-request": requests, "multi-turn": turns}


@pytest.mark.parametrize("kind", [None, "window+mamba2", "window"])
@torch.no_grad()
def test_answers_are_plain_greedy_decoding_in_both_modes(kind):
    torch.manual_seed(0)
    model = tiny_model("llama")
    if kind is not None:
        model = convert(model, spec_for(model, 0.5), MIXERS[kind]).eval()
    context = torch.randint(1, 97, (40,)).tolist()
    questions = [torch.randint(1, 97, (n,)).tolist() for n in (3, 5, 4, 2)]
    later = [[7] + q for q in questions]
    eos = {0}
    # Half the golds are the model's own greedy answers (the teacher-forced shortcut is taken),
    # half random tokens (the answer leaves the gold and is decoded token by token).
    own = reference(model, context, questions, later, [[1] * 4] * 4, eos)
    golds = [own["multi-request"][0][:4], [5, 9, 11], own["multi-request"][2][:3], [60, 2]]
    golds = [g if g else [3] for g in golds]
    expected = reference(model, context, questions, later, golds, eos)
    prefilled = model(input_ids=torch.tensor([context]), use_cache=True)[CACHE_ARGUMENT]
    got = ask(model, prefilled, len(context), questions, later, golds, eos, cache_key=CACHE_ARGUMENT)
    for mode in expected:
        assert [r["answer"] for r in got[mode]] == expected[mode], mode
        assert all(len(r["logprobs"]) == len(g) and all(lp <= 0 for lp in r["logprobs"])
                   for r, g in zip(got[mode], golds))
    assert all(got["multi-request"][0]["argmax"]) and not all(got["multi-request"][1]["argmax"])


@torch.no_grad()
def test_the_gold_log_probability_is_the_models_under_teacher_forcing():
    model = tiny_model("llama")
    context, question, gold = list(range(5, 35)), [40, 41, 42], [50, 51, 52]
    prefilled = model(input_ids=torch.tensor([context]), use_cache=True)[CACHE_ARGUMENT]
    got = ask(model, prefilled, len(context), [question], [question], [gold], {0}, modes=("multi-request",),
              cache_key=CACHE_ARGUMENT)["multi-request"][0]
    logits = model(input_ids=torch.tensor([context + question + gold])).logits[0].log_softmax(-1)
    expected = [float(logits[len(context) + len(question) - 1 + i, t]) for i, t in enumerate(gold)]
    assert got["logprobs"] == pytest.approx(expected, abs=1e-4)


def test_the_value_starts_at_its_first_visible_token(tokenizer):
    gold = tokenizer.encode(" 4827193", add_special_tokens=False)
    start = value_start(tokenizer, gold)
    assert tokenizer.decode(gold[start:]).strip() and not tokenizer.decode(gold[:start]).strip()


def test_intervals_resample_contexts_and_trainings():
    rng = np.random.default_rng(0)
    row = [[list(rng.integers(0, 2, 8)) for _ in range(30)]]
    centre, low, high = interval(row)
    assert low < centre < high and centre == pytest.approx(np.mean(row)) == mean(row)
    assert mean([[[1, 1, 1, 1], [0, 0]]]) == 0.5  # each context weighs alike, whatever its questions
    assert paired_interval(row, row) == (0.0, 0.0, 0.0)
    constant = [[[1, 0]] * 30]  # every context the same: nothing to resample
    assert interval(constant) == (0.5, 0.5, 0.5)
    trainings = [[[1, 0]] * 30, [[1, 1]] * 30, [[0, 0]] * 30]  # only the trainings differ
    centre, low, high = interval(trainings)
    assert centre == pytest.approx(0.5) and high - low > 0.3
    shifted = [[[min(1, v + 1) for v in c] for c in row[0]]]
    diff, low, high = paired_interval(shifted, row)
    assert 0 < low <= diff <= high
    with pytest.raises(ValueError, match="same"):
        paired_interval(row, [row[0][:10]])


def test_the_task_answers_every_question_in_both_modes(tmp_path):
    data = tmp_path / "haystack.txt"
    data.write_text(RUN_TEXT)
    model = save_tiny_run_model(tmp_path / "model")
    out = tmp_path / "out.json"
    assert main(["eval", str(model), "--task", "shared-context", "--data", str(data), "--context", "260",
                 "--contexts", "2", "--needles", "2", "--out", str(out)]) in (0, None)
    result = json.loads(out.read_text())
    assert result["task"] == "shared-context" and re.fullmatch(r"[0-9a-f]{16}", result["digest"])
    assert len(result["records"]) == 2 and all(len(c[m]) == 2 for c in result["records"] for m in c)
    assert set(result["modes"]) == {"multi-request", "multi-turn"}
    assert result["headline"] == result["modes"]["multi-request"]["exact"]["mean"]
    assert all(set(r) >= {"kind", "depth", "value", "completion", "exact", "logprob", "first"}
               for c in result["records"] for r in c["multi-request"])


@pytest.mark.parametrize("flags, message", [
    (["--questions", "0"], "--questions must be between 1 and --needles"),
    (["--needles", "40"], "fewer needles or a longer context"),
    (["--data", "{short}"], "too short"),
    (["--context", "400"], "more than the model allows"),
    (["--modes", "multi-request,sideways"], "--modes: unknown 'sideways'"),
])
def test_bad_input_is_one_line_exit_2_and_no_output(tmp_path, capsys, flags, message):
    model = save_tiny_run_model(tmp_path / "model")
    data, short = tmp_path / "haystack.txt", tmp_path / "short.txt"
    data.write_text(RUN_TEXT)
    short.write_text(SHORT)
    out = tmp_path / "out.json"
    flags = [f.format(short=short) for f in flags]
    base = ["--data", str(data), "--context", "260", "--contexts", "1", "--needles", "2"]
    code = main(["eval", str(model), "--task", "shared-context", "--out", str(out), *base, *flags])
    assert code == 2 and not out.exists()
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in error, error
