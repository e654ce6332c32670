"""Passkey retrieval: a 5-digit number hidden in a haystack of real text, asked for at the end.

**[ours]** The task of Mohtashami & Jaggi (Landmark Attention, 2023) with real text around
the needle instead of the repeated filler sentence: a haystack that repeats itself lets a
model guess where the key is. A problem is the format's instruction, a window of the
haystack text with the needle line inserted at `depth` (the fraction of the haystack
before it), and the question; the prompt is sized to `context` tokens. The completion is
scored by its first run of digits, which must equal the key exactly.

Formats (`FORMATS`), searched on SmolLM2-135M-Instruct by `benchmarks/passkey_prompts.py`:
`landmark` states the key twice ("The pass key is K. Remember it. K is the pass key.");
`once` states it once; `oneshot` puts a short solved example before the instruction;
`chat` wraps instruction, haystack and question in the tokenizer's chat template and
starts the assistant's answer with "The pass key is".
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

INSTRUCTION = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
               "memorize it. I will quiz you about it.\n\n")
QUESTION = "What is the pass key?"
ANSWER_START = "The pass key is"
TWICE = "The pass key is {key}. Remember it. {key} is the pass key."
ONCE = "The pass key is {key}."
EXAMPLE = (INSTRUCTION + "The sun was low over the hills.\n" + TWICE.format(key="48213")
           + "\nThe river ran on through the night.\n\n" + QUESTION + " " + ANSWER_START + " 48213.\n\n")


@dataclass(frozen=True)
class PromptFormat:
    prefix: str  # before the haystack
    needle: str  # with {key}
    suffix: str  # after the haystack; the completion follows it
    chat: bool = False  # prefix + haystack + question form the user turn of the chat template


FORMATS = {
    "landmark": PromptFormat(INSTRUCTION, TWICE, f"\n\n{QUESTION} {ANSWER_START}"),
    "once": PromptFormat(INSTRUCTION, ONCE, f"\n\n{QUESTION} {ANSWER_START}"),
    "oneshot": PromptFormat(EXAMPLE, TWICE, f"\n\n{QUESTION} {ANSWER_START}"),
    "chat": PromptFormat(INSTRUCTION, TWICE, f"\n\n{QUESTION}", chat=True),
}


@dataclass(frozen=True)
class PasskeyProblem:
    prompt: str
    answer: str  # the 5-digit key
    context: int  # the prompt's target length in tokens
    depth: float  # fraction of the haystack before the needle
    needle_token: int  # index of the needle line's first token in the tokenized prompt


def render(fmt: PromptFormat, tokenizer, before: str, needle: str, after: str) -> tuple[str, str]:
    """(the prompt's text up to the needle, the whole prompt) of a haystack split around `needle`."""
    head = fmt.prefix + before + "\n"
    body = head + needle + "\n" + after + fmt.suffix
    if not fmt.chat:
        return head, body
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the chat format needs a tokenizer with a chat template")
    template = tokenizer.apply_chat_template([{"role": "user", "content": body}], tokenize=False,
                                             add_generation_prompt=True)
    start = template.index(body)
    return template[:start] + head, template + ANSWER_START


def generate_passkey(
    tokenizer, haystack: list[int], context: int, depths: tuple[float, ...], problems: int, seed: int = 0,
    fmt: str = "landmark",
) -> list[PasskeyProblem]:
    """`problems` problems per depth, each a prompt of about `context` tokens whose haystack is
    a window of the token stream `haystack` (a seeded random start) with a seeded random key."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown passkey format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if not all(0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths must be in [0, 1], got {depths}")
    style = FORMATS[fmt]
    overhead = len(tokenizer.encode(render(style, tokenizer, "", style.needle.format(key="00000"), "")[1]))
    length = context - overhead - 2  # margin: the cuts may retokenize a little longer
    if length < 16:
        raise ValueError(f"context {context} leaves no room for a haystack (the prompt alone is {overhead} tokens)")
    if len(haystack) < length:
        raise ValueError(f"the haystack text has {len(haystack):,} tokens, fewer than the {length:,} a "
                         f"{context}-token prompt needs")
    out = []
    for depth in depths:
        for index in range(problems):
            rng = random.Random(f"passkey-{seed}-{context}-{depth}-{index}")
            key = str(rng.randrange(10_000, 100_000))
            start = rng.randrange(len(haystack) - length + 1)
            window, cut = haystack[start:start + length], round(depth * length)
            head, prompt = render(style, tokenizer, tokenizer.decode(window[:cut]), style.needle.format(key=key),
                                  tokenizer.decode(window[cut:]))
            out.append(PasskeyProblem(prompt, key, context, depth, len(tokenizer.encode(head))))
    return out


def parse_key(completion: str) -> str | None:
    """The completion's first run of digits (None if it has none)."""
    found = re.search(r"\d+", completion)
    return found.group(0) if found else None


def score_passkey(completions: list[str], problems: list[PasskeyProblem]) -> dict:
    """Exact-match accuracy overall and per (context, depth) cell."""
    if len(completions) != len(problems) or not problems:
        raise ValueError(f"{len(completions)} completions for {len(problems)} problems")
    cells: dict[tuple[int, float], list[bool]] = {}
    for completion, problem in zip(completions, problems):
        cells.setdefault((problem.context, problem.depth), []).append(parse_key(completion) == problem.answer)
    correct = [hit for hits in cells.values() for hit in hits]
    return {"n": len(correct), "accuracy": sum(correct) / len(correct),
            "cells": [{"context": c, "depth": d, "n": len(hits), "accuracy": sum(hits) / len(hits)}
                      for (c, d), hits in cells.items()]}
