"""[ours] A key-value retrieval probe: calibration text with needles, asked at its end.

What the `ablation-retrieval` scorer measures a group's cost on (`ablation.py`), after
*Retrieval-Aware Distillation* (Bick et al., 2026, arXiv 2602.11374), which ranks heads by
ablating them on a synthetic key-value retrieval task: a group that retrieval needs is one
whose windowing raises the loss of the answers, wherever the needles stand.

Each sequence of `T` tokens is a stretch of the calibration text (`token_sequences`) with
`NEEDLES` sentences "The special magic number for KEY is: VALUE." put after sentence ends
at seeded depths in it, followed by one question per needle in a shuffled order,
"What is the special magic number for KEY? The special magic number for KEY is: VALUE.".
Keys are two words of the text's own vocabulary joined by a hyphen, values 7-digit
numbers (as RULER's `niah_multikey_1`, `tasks/ruler.py`). Only the value tokens of the
answers count (`counted`); the text is cut so that the whole is `T` tokens.
"""

from __future__ import annotations

import random
import re

import torch
from torch import Tensor

from .data import DataError

NEEDLES = 4
NEEDLE = " The special magic number for {key} is: {value}."
QUESTION = " What is the special magic number for {key}? The special magic number for {key} is:"
ANSWER = " {value}."


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def probe_sequence(tokenizer, text_ids: list[int], rng: random.Random, words: list[str], length: int) -> tuple[list[int], list[bool]]:
    """One probe of `length` tokens from calibration tokens `text_ids` (at least `length`),
    and which of its tokens are answer values."""
    keys = [f"{rng.choice(words)}-{rng.choice(words)}" for _ in range(NEEDLES)]
    values = [str(rng.randrange(10**6, 10**7)) for _ in range(NEEDLES)]
    needles = [_encode(tokenizer, NEEDLE.format(key=k, value=v)) for k, v in zip(keys, values)]
    tail_ids, tail_counted = [], []
    for i in rng.sample(range(NEEDLES), NEEDLES):
        question, answer = _encode(tokenizer, QUESTION.format(key=keys[i])), _encode(tokenizer, ANSWER.format(value=values[i]))
        value = len(_encode(tokenizer, f" {values[i]}"))
        tail_ids += question + answer
        tail_counted += [False] * len(question) + [True] * value + [False] * (len(answer) - value)
    room = length - len(tail_ids) - sum(map(len, needles))
    if room < NEEDLES:
        raise DataError(f"ablation-retrieval: {length} tokens leave no room for text around {NEEDLES} needles and their "
                        "questions; use a longer --ablation-seq-len")
    text = text_ids[:room]
    ends = [i + 1 for i, token in enumerate(text[:-1]) if tokenizer.decode([token]).rstrip().endswith(".")] or list(range(1, room))
    cuts = sorted(rng.sample(ends, NEEDLES) if len(ends) >= NEEDLES else [rng.randrange(1, room) for _ in range(NEEDLES)])
    ids, previous = [], 0
    for cut, needle in zip(cuts, rng.sample(needles, NEEDLES)):
        ids += text[previous:cut] + needle
        previous = cut
    ids += text[previous:]
    counted = [False] * len(ids) + tail_counted
    return ids + tail_ids, counted


def probe_sequences(tokenizer, text: Tensor, vocabulary: str, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Probes from calibration tokens `text` `[N, T]`: tokens `[N, T]` and the answer values
    they count `[N, T]` (bool). `vocabulary`: text whose lowercase words of 4-10 letters make the keys."""
    words = sorted(set(re.findall(r"(?<!\w)[a-z]{4,10}(?!\w)", vocabulary)))
    if len(words) < 2:
        raise DataError("ablation-retrieval: the calibration text has too few words to make keys from")
    rng = random.Random(seed)
    rows = [probe_sequence(tokenizer, row.tolist(), rng, words, text.shape[1]) for row in text]
    return torch.tensor([ids for ids, _ in rows]), torch.tensor([counted for _, counted in rows])
