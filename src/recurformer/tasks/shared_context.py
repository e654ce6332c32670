"""Shared-context retrieval: one long context holding many facts, then many questions about it.

**[ours]** After SCBench (Li et al., 2024, arXiv 2412.10319: shared context, multiple requests
and multiple turns): a cache compression acts once, on the context, before it knows which of
the later questions will come. A *context* is held-out real text (its sentences, in order,
from a seeded start) with `needles` facts inserted between sentences, one per equal slice of
the text (so their depths cover the whole context), each of one of three kinds:

- `number`: "The lock code of the KEY is 4827193." (7 digits)
- `uuid`: "The tracking ID of the KEY is 3f9a1c2e-7b41-4d2a-9c3e-1f2a3b4c5d6e."
- `word`: 'The password of the KEY is "harbour".' (a word of the text's vocabulary, quoted)

KEY is two words of the text's own vocabulary ("the silver orchard"), distinct within a context.
Then `questions` of the needles are asked, one per question, in a seeded order:
"What is the lock code of the KEY?", answered after "The lock code of the KEY is". An answer
is right when the completion, stripped, starts with the value and the value is not followed
by a letter or digit (`is_exact`).

The templates, keys and values are our own and differ from every other task's (RULER's
"special magic numbers", the passkey, the retrieval probe): `tests/tasks/test_shared_context.py`
checks that no other task's needle or question occurs here.

Formats (`FORMATS`), searched on the original model by
`benchmarks/long_context/shared_context_prompts.py`: `plain` (instruction, text, then
"Question: ...\\nAnswer: ..." turns) and `chat` (the tokenizer's chat template: the instruction
and the text open the first user turn, each question is a user turn, each answer an
assistant turn).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from .ruler import Sources, largest_fitting

KINDS = ("number", "uuid", "word")
RELATIONS = {"number": "lock code", "uuid": "tracking ID", "word": "password"}
# [ours] A password is quoted: unquoted, "The password of the core pursuit is impressed." reads as
# a sentence of the text, not as a fact (docs/results/shared-context-prompts.md)
OPENS = {"number": " ", "uuid": ' "', "word": ' "'}
CLOSES = {"number": "", "uuid": '"', "word": '"'}
INSTRUCTION = ("Below is a long text. Here and there it states a lock code, a tracking ID or a password of "
               "something. Read it carefully: afterwards you will be asked about them.")
NEEDLE = "The {relation} of the {key} is{open}{value}{close}."
QUESTION = "What is the {relation} of the {key}?"
ANSWER_START = "The {relation} of the {key} is"
FORMATS = ("plain", "chat")


@dataclass(frozen=True)
class Needle:
    kind: str  # one of KINDS
    key: str  # two words, e.g. "silver orchard"
    value: str
    depth: float  # fraction of the text's sentences before it

    @property
    def statement(self) -> str:
        return NEEDLE.format(relation=RELATIONS[self.kind], key=self.key, value=self.value, open=OPENS[self.kind],
                             close=CLOSES[self.kind])

    @property
    def question(self) -> str:
        return QUESTION.format(relation=RELATIONS[self.kind], key=self.key)

    @property
    def answer_start(self) -> str:
        """Up to the value: "The lock code of the KEY is", or '... is "' for a quoted password."""
        return ANSWER_START.format(relation=RELATIONS[self.kind], key=self.key) + OPENS[self.kind].rstrip()

    @property
    def answer(self) -> str:
        """The gold completion of the answer's start: the value, after a space unless quoted."""
        return f"{' ' if OPENS[self.kind] == ' ' else ''}{self.value}"


@dataclass(frozen=True)
class Turns:
    """The text around the questions of one format: the context ends with the text; question
    `i` is `first` (i = 0) or `later` (after an answer) + the question + `close` + the answer's start."""

    opening: str  # before the instruction
    first: str
    later: str
    close: str

    def question(self, needle: Needle, turn: int) -> str:
        return f"{self.first if turn == 0 else self.later}{needle.question}{self.close}{needle.answer_start}"


@dataclass(frozen=True)
class SharedContext:
    context: str  # instruction + text with the needles: what a cache compression may compress
    needles: tuple[Needle, ...]  # in the text's order
    asked: tuple[int, ...]  # indices of `needles`, in the order asked
    questions: tuple[str, ...]  # question text of each asked needle as the first turn after the context
    later_questions: tuple[str, ...]  # the same as a turn after an earlier answer (multi-turn)
    tokens: int  # the context's target length

    @property
    def answers(self) -> tuple[str, ...]:
        """The gold completion of each question (`Needle.answer`)."""
        return tuple(self.needles[i].answer for i in self.asked)


def chat_turns(tokenizer) -> Turns:
    """`Turns` from the tokenizer's chat template (default system prompt included)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the chat format needs a tokenizer with a chat template")
    a, b, c = "\x00USER-A\x00", "\x00ASSISTANT\x00", "\x00USER-B\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": a}, {"role": "assistant", "content": b},
                                          {"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
    first = tokenizer.apply_chat_template([{"role": "user", "content": a}], tokenize=False, add_generation_prompt=True)
    return Turns(opening=first[:first.index(a)], first="\n\n", later=text[text.index(b) + len(b):text.index(c)],
                 close=first[first.index(a) + len(a):])


def turns_of(fmt: str, tokenizer) -> Turns:
    if fmt == "chat":
        return chat_turns(tokenizer)
    if fmt == "plain":
        return Turns(opening="", first="\n\nQuestion: ", later="\nQuestion: ", close="\nAnswer: ")
    raise ValueError(f"unknown shared-context format {fmt!r}; choose one of {', '.join(FORMATS)}")


def _value(kind: str, rng: random.Random, sources: Sources) -> str:
    if kind == "number":
        return str(rng.randrange(10**6, 10**7))
    if kind == "word":
        return rng.choice(sources.words)
    hexa = "".join(rng.choice("0123456789abcdef") for _ in range(32))
    return f"{hexa[:8]}-{hexa[8:12]}-4{hexa[13:16]}-{rng.choice('89ab')}{hexa[17:20]}-{hexa[20:]}"


def draw_needles(rng: random.Random, sources: Sources, count: int) -> tuple[Needle, ...]:
    """`count` needles, kinds in turn (a shuffled cycle), keys distinct, needle `i` at a random
    depth within the `i`-th of `count` equal slices of the text."""
    if len(sources.words) < 4:
        raise ValueError("the text has too few distinct words to make keys from")
    kinds = [KINDS[i % len(KINDS)] for i in range(count)]
    rng.shuffle(kinds)
    keys: list[str] = []
    while len(keys) < count:
        key = f"{rng.choice(sources.words)} {rng.choice(sources.words)}"
        keys += [key] if key not in keys and key.split()[0] != key.split()[1] else []
    return tuple(Needle(kind, key, _value(kind, rng, sources), (i + rng.random()) / count)
                 for i, (kind, key) in enumerate(zip(kinds, keys)))


def _text(sources: Sources, start: int, n: int, needles: tuple[Needle, ...]) -> str:
    """`n` sentences from `start` (wrapping around) with each needle before sentence `round(depth * n)`."""
    count = len(sources.sentences)
    units = [sources.sentences[(start + i) % count] for i in range(n)]
    out: list[str] = []
    for index, unit in enumerate(units + [None]):
        out += [needle.statement for needle in needles if round(needle.depth * n) == index]
        if unit is not None:
            out.append(unit)
    return " ".join(out)


def generate_shared_contexts(tokenizer, sources: Sources, contexts: int, tokens: int, needles: int, questions: int,
                             seed: int = 0, fmt: str = "plain") -> list[SharedContext]:
    """`contexts` contexts of at most `tokens` tokens (as many sentences as fit), each with
    `needles` needles of which `questions` are asked; context `i` is seeded by (seed, tokens,
    needles, i) only, so the first k of n contexts are the k of a set of k."""
    if not 1 <= questions <= needles:
        raise ValueError(f"questions must be between 1 and the number of needles ({needles}), got {questions}")
    if not sources.sentences or not sources.words:
        raise ValueError("the haystack text has no sentences or no words")
    turns = turns_of(fmt, tokenizer)
    out = []
    for index in range(contexts):
        rng = random.Random(f"shared-context-{seed}-{tokens}-{needles}-{index}")
        drawn = draw_needles(rng, sources, needles)
        start = rng.randrange(len(sources.sentences))

        def context(n: int) -> str:
            return f"{turns.opening}{INSTRUCTION}\n\n{_text(sources, start, n, drawn)}"

        size: Callable[[int], int] = lambda n: len(tokenizer.encode(context(n)))
        bare = size(0)
        if bare > tokens:
            raise ValueError(f"{needles} needles take {bare:,} tokens without any text: more than the "
                             f"{tokens:,}-token context; ask for fewer needles or a longer context")
        n = largest_fitting(size, tokens, len(sources.sentences))
        if n == len(sources.sentences):  # the text, not the budget, bounded the context
            raise ValueError(f"the haystack text is too short for a {tokens:,}-token context "
                             f"({len(sources.sentences):,} sentences)")
        if n < needles:
            raise ValueError(f"a {tokens:,}-token context holds {n} sentences, too few to spread {needles} needles "
                             "over; ask for fewer needles or a longer context")
        asked = tuple(rng.sample(range(needles), questions))
        out.append(SharedContext(
            context=context(n), needles=drawn, asked=asked, tokens=tokens,
            questions=tuple(turns.question(drawn[i], 0) for i in asked),
            later_questions=tuple(turns.question(drawn[i], 1) for i in asked)))
    return out


def is_exact(completion: str, value: str) -> bool:
    """The completion, stripped, starts with `value`, not followed by a letter or digit."""
    text = completion.strip()
    return text.startswith(value) and not re.match(r"[0-9A-Za-z]", text[len(value):len(value) + 1])
