"""[ours] Training sequences with retrieval in them: real text with facts, asked about at its end.

Plain training text never asks for a fact read far back, so a converted model trained on it
is never taught to retrieve (issue 44). A *retrieval sequence* is a training sequence's own
text, shortened, with `k` facts put after sentence ends, fact `i` within the `i`-th of `k`
equal slices of the text (so a fact's distance to its question ranges up to the sequence's
length), then questions about half of them (rounded up), in a seeded order, each on its own
line and followed by its answer. A fact is of one of four kinds (`KINDS`):

- `number`: " Inventory note: crate 318 holds 604127 items." (6 digits), asked
  "Q: How many items does crate 318 hold? A: crate 318 holds 604127 items."
- `code`: " Filing note: parcel 42 is stored under reference KT-482B." (2 letters, 3 digits, a letter)
- `word`: " Naming note: drawer 907 is nicknamed Juniper." (a name of `NAMES`)
- `date`: " Calendar note: trunk 65 was opened on 12 March 1987."

A key is a noun of `NOUNS` and a number of 2 or 3 digits, distinct within a sequence. There
are at most one fact per `FACT_EVERY` tokens, and as many as fit while the text keeps at
least `MIN_TEXT` of the sequence (with SmolLM2's tokenizer, 1,024 tokens hold 8 facts and 4
questions, about a fifth of the tokens; 96 tokens, `run --quick`'s, one of each).
The answers are ordinary tokens: the loss stays the recipe's (the tail recipes': the KL to the
original on every position), so the converted model learns to answer as the original does;
`answers` marks the value tokens of the answers for a loss that wants them.

The templates, keys and values differ from every evaluation task's (RULER's special magic
numbers and UUIDs, the passkey, the shared-context task's lock codes, tracking IDs and
passwords, the retrieval probe): `tests/test_retrieval_mix.py` checks that no evaluation
prompt's template occurs in these sequences, nor theirs in the evaluation prompts.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .data import DataError

FACT_EVERY = 128  # at most one fact per this many tokens of a sequence
MIN_TEXT = 0.25  # the training text keeps at least this share of a sequence
NOUNS = ("crate", "parcel", "cabinet", "drawer", "satchel", "hamper", "trunk", "canister", "bundle", "carton",
         "barrel", "pouch")
NAMES = ("Falcon", "Heron", "Willow", "Cedar", "Cobalt", "Garnet", "Juniper", "Marble", "Otter", "Saffron",
         "Thistle", "Walrus", "Bramble", "Cinder", "Maple", "Pebble", "Quill", "Raven", "Sparrow", "Tundra", "Umber",
         "Vesper", "Wren", "Yarrow", "Zephyr", "Acorn", "Basil", "Clover", "Dune", "Ember", "Fern", "Hazel")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"


def _code(rng: random.Random) -> str:
    return (f"{rng.choice(LETTERS)}{rng.choice(LETTERS)}-{rng.randrange(100, 1000)}"
            f"{rng.choice(LETTERS)}")


def _date(rng: random.Random) -> str:
    return f"{rng.randrange(1, 29)} {rng.choice(MONTHS)} {rng.randrange(1900, 2030)}"


@dataclass(frozen=True)
class Kind:
    """How a fact of one kind is stated, asked and answered (templates with {key}, {value})."""

    statement: str
    question: str  # the question and the answer up to its value
    after: str  # what follows the value in the answer
    value: Callable[[random.Random], str]


KINDS: dict[str, Kind] = {
    "number": Kind(" Inventory note: {key} holds {value} items.", "\nQ: How many items does {key} hold? A: {key} holds",
                   " items.", lambda rng: str(rng.randrange(10**5, 10**6))),
    "code": Kind(" Filing note: {key} is stored under reference {value}.",
                 "\nQ: Under which reference is {key} stored? A: {key} is stored under reference", ".", _code),
    "word": Kind(" Naming note: {key} is nicknamed {value}.",
                 "\nQ: Which nickname does {key} have? A: {key} is nicknamed", ".", lambda rng: rng.choice(NAMES)),
    "date": Kind(" Calendar note: {key} was opened on {value}.",
                 "\nQ: On which date was {key} opened? A: {key} was opened on", ".", _date),
}


@dataclass(frozen=True)
class Fact:
    kind: str  # one of KINDS
    key: str  # e.g. "crate 318"
    value: str

    @property
    def statement(self) -> str:
        return KINDS[self.kind].statement.format(key=self.key, value=self.value)

    @property
    def question(self) -> str:
        return KINDS[self.kind].question.format(key=self.key)


def draw_facts(rng: random.Random, count: int) -> list[Fact]:
    """`count` facts, kinds in turn (a shuffled cycle), keys distinct."""
    kinds = [list(KINDS)[i % len(KINDS)] for i in range(count)]
    rng.shuffle(kinds)
    keys: list[str] = []
    while len(keys) < count:
        key = f"{rng.choice(NOUNS)} {rng.randrange(10, 1000)}"
        keys += [key] if key not in keys else []
    return [Fact(kind, key, KINDS[kind].value(rng)) for kind, key in zip(kinds, keys)]


@dataclass(frozen=True)
class RetrievalSequence:
    ids: list[int]  # [seq_len]
    answers: list[bool]  # [seq_len]: the value tokens of the answers
    facts: list[Fact]  # in the text's order
    fact_starts: list[int]  # the first token of each fact's statement
    asked: list[int]  # indices of `facts`, in the order asked
    question_starts: list[int]  # the first token of each question


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def retrieval_sequence(tokenizer, text: list[int], rng: random.Random) -> RetrievalSequence:
    """A retrieval sequence as long as the training tokens `text` `[seq_len]`, from their start."""
    seq_len = len(text)
    drawn = draw_facts(rng, max(1, seq_len // FACT_EVERY))
    statements = [_encode(tokenizer, fact.statement) for fact in drawn]
    asks = [(_encode(tokenizer, fact.question), _encode(tokenizer, f" {fact.value}"),
             _encode(tokenizer, KINDS[fact.kind].after)) for fact in drawn]  # (question, value, after)

    def overhead(k: int) -> int:
        """Tokens of the first `k` facts and of their longest half's questions and answers."""
        asked = sorted(sum(map(len, ask)) for ask in asks[:k])[-math.ceil(k / 2):]
        return sum(map(len, statements[:k])) + sum(asked)

    most = seq_len - math.ceil(MIN_TEXT * seq_len)
    k = max((k for k in range(1, len(drawn) + 1) if overhead(k) <= most), default=0)
    if k == 0:
        raise DataError(f"a {seq_len}-token training sequence has no room for a fact and its question "
                        f"({overhead(1)} tokens, at most {most}); use longer sequences or --retrieval-share 0")
    asked = rng.sample(range(k), math.ceil(k / 2))
    room = seq_len - sum(map(len, statements[:k])) - sum(sum(map(len, asks[i])) for i in asked)
    text = text[:room]
    ends = [i + 1 for i, piece in enumerate(tokenizer.batch_decode([[t] for t in text]))
            if piece.rstrip().endswith((".", "!", "?"))]
    cuts = []
    for i in range(k):
        low, high = i * room // k, (i + 1) * room // k
        cuts.append(rng.choice([end for end in ends if low <= end < high] or range(low, high)))
    ids, fact_starts, previous = [], [], 0
    for cut, statement in zip(cuts, statements):
        ids += text[previous:cut]
        fact_starts.append(len(ids))
        ids += statement
        previous = cut
    ids += text[previous:]
    marked, question_starts = [False] * len(ids), []
    for i in asked:
        question, value, after = asks[i]
        question_starts.append(len(ids))
        ids += question + value + after
        marked += [False] * len(question) + [True] * len(value) + [False] * len(after)
    return RetrievalSequence(ids, marked, drawn[:k], fact_starts, asked, question_starts)


def mix_retrieval(tokenizer, sequences: Tensor, share: float, seed: int) -> tuple[Tensor, Tensor]:
    """`sequences` `[N, T]` with `round(share * N)` of them, chosen with `seed`, replaced by
    retrieval sequences made from their own text: (tokens `[N, T]`, answer tokens `[N, T]` bool).
    Sequence `r` is seeded by (seed, r) alone."""
    count = round(share * len(sequences))
    if share > 0 and count == 0:
        raise DataError(f"--retrieval-share {share} of the {len(sequences)} training sequences is none; "
                        "give more training text, a larger share or --retrieval-share 0")
    tokens, answers = sequences.clone(), torch.zeros(sequences.shape, dtype=torch.bool)
    for row in sorted(random.Random(f"retrieval-mix-{seed}").sample(range(len(sequences)), count)):
        made = retrieval_sequence(tokenizer, sequences[row].tolist(), random.Random(f"retrieval-mix-{seed}-{row}"))
        tokens[row], answers[row] = torch.tensor(made.ids), torch.tensor(made.answers)
    return tokens, answers
