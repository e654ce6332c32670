"""The retrieval mix: sequences of exactly the training length holding their facts, questions
and answers, facts spread so that distances reach the sequence's length, deterministic by
seed, templates disjoint from every evaluation task's, and a share of the training sequences
replaced by them."""

import random
import re

import pytest
import torch
from test_ruler import ASCII, TEXT
from tiny_models import tiny_tokenizer

from recurformer import retrieval_probe
from recurformer.data import DataError, token_sequences
from recurformer.retrieval_mix import KINDS, NAMES, NOUNS, draw_facts, mix_retrieval, retrieval_sequence
from recurformer.tasks import passkey, ruler, shared_context

SEQ_LEN = 1024
# Sentinel for the keys and values of a template: a template is what stays when they are cut out.
HOLE = "\x00"
CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE learned on the text, on facts and questions of every kind and on the
    evaluation tasks' templates: about a token a word, as a real tokenizer; with a chat
    template, for the evaluation tasks' chat formats."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    facts = draw_facts(random.Random(0), 400)
    lines = TEXT.splitlines() + [f.statement + f.question + f" {f.value}" for f in facts] + evaluation_templates() * 5
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    model.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=1500, special_tokens=["<eos>"],
                                                         initial_alphabet=ASCII, show_progress=False))
    made = PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<eos>", pad_token="<eos>")
    made.chat_template = CHAT
    return made


@pytest.fixture(scope="module")
def text(tokenizer):
    """`[N, SEQ_LEN]` training sequences of the text."""
    return token_sequences(tokenizer, [TEXT], SEQ_LEN, num_sequences=12, seed=1)


def made(tokenizer, text, seed=0):
    return [retrieval_sequence(tokenizer, row.tolist(), random.Random(f"{seed}-{i}")) for i, row in enumerate(text)]


def test_a_sequence_holds_its_facts_in_order_then_each_question_with_its_answer(tokenizer, text):
    for sequence in made(tokenizer, text):
        assert len(sequence.ids) == len(sequence.answers) == SEQ_LEN
        k = len(sequence.facts)
        assert k == SEQ_LEN // 128 and len(sequence.asked) == len(set(sequence.asked)) == (k + 1) // 2
        decoded = tokenizer.decode(sequence.ids)
        starts = [decoded.index(fact.statement) for fact in sequence.facts]
        assert starts == sorted(starts)
        for fact, at in zip(sequence.facts, sequence.fact_starts):
            assert tokenizer.decode(sequence.ids[at:]).startswith(fact.statement)
        assert min(sequence.question_starts) > max(sequence.fact_starts)
        values = [sequence.facts[i].value for i in sequence.asked]
        for i, at in zip(sequence.asked, sequence.question_starts):
            fact = sequence.facts[i]
            assert tokenizer.decode(sequence.ids[at:]).startswith(f"{fact.question} {fact.value}")
        marked = [token for token, answer in zip(sequence.ids, sequence.answers) if answer]
        assert tokenizer.decode(marked) == "".join(f" {value}" for value in values)
        assert not any(sequence.answers[:min(sequence.question_starts)])


def test_facts_spread_over_the_text_so_that_distances_reach_the_sequence_length(tokenizer, text):
    distances = []
    for sequence in made(tokenizer, text):
        k = len(sequence.facts)
        statements = [len(tokenizer.encode(f.statement)) for f in sequence.facts]
        text_tokens = min(sequence.question_starts) - sum(statements)
        for i, at in enumerate(sequence.fact_starts):  # in the i-th of k equal slices of the text
            assert i * text_tokens // k <= at - sum(statements[:i]) <= (i + 1) * text_tokens // k
        distances += [q - sequence.fact_starts[i] for i, q in zip(sequence.asked, sequence.question_starts)]
    assert max(distances) > 0.8 * SEQ_LEN and min(distances) < 0.3 * SEQ_LEN


def test_values_have_their_kinds_formats_and_keys_are_distinct():
    facts = draw_facts(random.Random(3), 40)
    patterns = {"number": r"[1-9]\d{5}", "code": r"[A-Z]{2}-\d{3}[A-Z]", "word": "|".join(NAMES),
                "date": r"([1-9]|1\d|2[0-8]) [A-Z][a-z]+ (19\d\d|20[0-2]\d)"}
    assert {f.kind for f in facts} == set(KINDS) and len({f.key for f in facts}) == 40
    assert all(re.fullmatch(patterns[f.kind], f.value) for f in facts)
    assert all(re.fullmatch(rf"({'|'.join(NOUNS)}) [1-9]\d{{1,2}}", f.key) for f in facts)


def test_sequences_depend_on_their_seed_only(tokenizer, text):
    assert made(tokenizer, text[:3]) == made(tokenizer, text[:3])
    assert [s.ids for s in made(tokenizer, text[:3])] != [s.ids for s in made(tokenizer, text[:3], seed=1)]


def test_as_many_facts_as_fit_and_none_is_an_error_naming_the_length():
    wordy = tiny_tokenizer(vocab_size=97, alphabet=ASCII)  # a token a character: facts 5 times longer
    rows = token_sequences(wordy, [TEXT], SEQ_LEN, num_sequences=4)
    for row in rows:
        sequence = retrieval_sequence(wordy, row.tolist(), random.Random(0))
        assert 1 <= len(sequence.facts) < SEQ_LEN // 128 and len(sequence.ids) == SEQ_LEN
        statements = sum(len(wordy.encode(f.statement)) for f in sequence.facts)
        assert min(sequence.question_starts) - statements >= SEQ_LEN // 4  # the text keeps a quarter
    with pytest.raises(DataError, match=r"a 96-token training sequence has no room for a fact and its question "
                                        r"\(\d+ tokens, at most 72\)"):
        retrieval_sequence(wordy, rows[0, :96].tolist(), random.Random(0))


def test_a_share_of_the_sequences_is_replaced_chosen_by_the_seed(tokenizer, text):
    same, none = mix_retrieval(tokenizer, text, 0.0, seed=0)
    assert torch.equal(same, text) and not none.any()
    mixed, answers = mix_retrieval(tokenizer, text, 0.25, seed=0)
    replaced = [i for i in range(len(text)) if not torch.equal(mixed[i], text[i])]
    assert len(replaced) == 3 and answers.any(dim=1).nonzero().flatten().tolist() == replaced
    assert mixed.shape == text.shape and mixed.dtype == text.dtype
    assert torch.equal(mix_retrieval(tokenizer, text, 0.25, seed=0)[0], mixed)
    other = mix_retrieval(tokenizer, text, 0.25, seed=1)[0]
    assert [i for i in range(len(text)) if not torch.equal(other[i], text[i])] != replaced
    for row in replaced:  # made from its own text: without facts and questions, a start of it
        own = re.sub(r" (Inventory|Filing|Naming|Calendar) note: .*?\.(?= |\n|$)", "",
                     tokenizer.decode(mixed[row].tolist()).split("\nQ: ")[0])
        assert len(own) > SEQ_LEN and tokenizer.decode(text[row].tolist()).startswith(own)
    with pytest.raises(DataError, match=r"--retrieval-share 0.01 of the 12 training sequences is none"):
        mix_retrieval(tokenizer, text, 0.01, seed=0)


def evaluation_templates() -> list[str]:
    """Every evaluation task's instruction, needle, question and answer start, from its module,
    keys and values cut out: the pieces of at least two words."""
    draw = ruler.Draw(keys=(HOLE,) * 5, values=(HOLE,), depths=(0.0,) * 5, start=0, seed=0, query=(HOLE,),
                      answers=(HOLE,))
    filled = [ruler.NOISE, passkey.INSTRUCTION, passkey.QUESTION, passkey.ANSWER_START, passkey.EXAMPLE,
              passkey.TWICE.format(key=HOLE), passkey.ONCE.format(key=HOLE), shared_context.INSTRUCTION,
              retrieval_probe.NEEDLE.format(key=HOLE, value=HOLE), retrieval_probe.QUESTION.format(key=HOLE)]
    for task in ruler.TASKS.values():
        filled += [task.instruction, task.question(draw), task.answer_start(draw)]
        filled += [task.needle(HOLE, HOLE)] if isinstance(task, ruler.Niah) else []
    filled.append(ruler.TASKS["vt"].haystack(draw, 0, ruler.Sources((), ())))  # the variable chain alone
    for kind in shared_context.KINDS:
        needle = shared_context.Needle(kind, HOLE, HOLE, 0.0)
        filled += [needle.statement, needle.question, needle.answer_start]
    pieces = [piece.strip() for text in filled for piece in text.split(HOLE)]
    return [piece for piece in pieces if len(piece.split()) >= 2]


def evaluation_prompts(tokenizer) -> str:
    """The evaluation tasks' prompts, every format, as their generators make them."""
    sources, haystack = ruler.Sources.from_text(TEXT), tokenizer.encode(TEXT)
    prompts = []
    for fmt in ruler.FORMATS:
        prompts += [p.context + p.question for p in ruler.generate_ruler(tokenizer, sources, tuple(ruler.TASKS), 800, 1,
                                                                          fmt=fmt)]
    for fmt in passkey.FORMATS:
        prompts += [p.prompt for p in passkey.generate_passkey(tokenizer, haystack, 400, (0.5,), 1, fmt=fmt)]
    for fmt in shared_context.FORMATS:
        prompts += [c.context + "".join(c.questions + c.later_questions)
                    for c in shared_context.generate_shared_contexts(tokenizer, sources, 1, 600, 6, 6, fmt=fmt)]
    probes, _ = retrieval_probe.probe_sequences(tokenizer, token_sequences(tokenizer, [TEXT], 300, 2), TEXT)
    return "\n".join(prompts + tokenizer.batch_decode(probes))


def test_no_evaluation_template_occurs_in_the_training_sequences_nor_theirs_in_the_evaluation_prompts(tokenizer, text):
    theirs = evaluation_templates()
    wording = ("special magic numbers", "special magic uuids", "pass key", "lock code of the", "tracking ID of the",
               "password of the", "What is the", "Below is a long text", "The special magic number for")
    assert all(any(words in piece for piece in theirs) for words in wording)  # the tasks' wording is in the pieces
    ours = "\n".join(tokenizer.decode(s.ids) for s in made(tokenizer, text)).lower()
    assert not [piece for piece in theirs if piece.lower() in ours]
    templates = [kind.statement + kind.question for kind in KINDS.values()]
    pieces = [p.strip() for t in templates for p in re.split(r"\{\w+\}", t) if len(p.split()) >= 2]
    prompts = evaluation_prompts(tokenizer)
    assert "<assistant>" in prompts  # the chat formats were built too
    prompts = (prompts + "\n".join(theirs)).lower()
    assert len(pieces) >= 12 and not [piece for piece in pieces if piece.lower() in prompts]
    assert not [noun for noun in NOUNS if re.search(rf"\b{noun}\b", prompts)]

