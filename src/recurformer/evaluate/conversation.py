"""Questions about one prefilled context: each from a copy of its cache, or one after another.

The answering core of the shared-context task (`evaluate/shared_context.py`), batch 1. It
imports nothing but torch, so that the peers' environment (kvpress needs an older
transformers than recurformer; `benchmarks/peers/kvpress_eval.py`) loads this file by path
and answers exactly as our rows do. The caller prefills the context (a press compresses it
then) and hands over the cache and the context's length; every later token goes at the
positions that continue the context, whatever the cache holds.

For each question both modes give the greedy answer ids (until an EOS id, not kept, `stop`,
or `len(gold) + EXTRA_TOKENS` tokens) and, under teacher forcing from the same cache state,
each gold token's log-probability and whether it is the greedy token at its place.
- `multi-request`: every question from a fresh copy of the prefilled cache;
- `multi-turn`: the questions and the model's own answers appended to one cache, in turn
  (the teacher-forced pass reads a copy of the conversation so far).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

MODES = ("multi-request", "multi-turn")
EXTRA_TOKENS = 3  # greedy tokens beyond the gold's length: room for what follows a right answer


def _logits(model, ids: list[int], cache, position: int, cache_key: str, keep: int) -> torch.Tensor:
    """Logits `[keep, V]` (fp32) of the last `keep` of `ids` fed at `position...` into `cache`, on
    the model's device (transformers' `model.device`: this file imports nothing but torch)."""
    device = model.device
    positions = torch.arange(position, position + len(ids), device=device)[None]
    out = model(input_ids=torch.tensor([ids], device=device), position_ids=positions, use_cache=True,
                logits_to_keep=keep, **{cache_key: cache})
    return out.logits[0].float()


def teacher_forced(model, cache, position: int, prompt: list[int], gold: list[int], cache_key: str) -> dict:
    """Feed `prompt + gold` into `cache` (which it changes): each gold token's log-probability,
    whether each is the greedy token at its place, and the greedy token after the whole gold."""
    logits = _logits(model, prompt + gold, cache, position, cache_key, len(gold) + 1)
    gold_ids = torch.tensor(gold, device=logits.device)
    logprobs = torch.log_softmax(logits[:-1], dim=-1)[torch.arange(len(gold), device=logits.device), gold_ids]
    greedy_ids = logits.argmax(dim=-1)
    return {"logprobs": logprobs.tolist(), "argmax": (greedy_ids[:-1] == gold_ids).tolist(),
            "next": int(greedy_ids[-1])}


def greedy(model, cache, position: int, prompt: list[int], most: int, eos: set[int], cache_key: str,
           stop: Callable[[list[int]], bool] | None = None, answer: list[int] | None = None,
           token: int | None = None) -> tuple[list[int], list[int]]:
    """Feed `prompt` into `cache` (which it changes), then greedy tokens: (answer ids, ids not yet
    fed). The last answer token is not fed (nothing needed its logits); an EOS id is dropped.
    `answer` and `token`: a start already fed (`prompt` then empty) and the greedy token after it."""
    answer = list(answer or [])
    step = prompt
    while True:
        if token is None:
            token = int(_logits(model, step, cache, position, cache_key, 1)[-1].argmax())
            position += len(step)
        if token in eos:
            return answer, []
        answer.append(token)
        if len(answer) >= most or (stop is not None and stop(answer)):
            return answer, [token]
        step, token = [token], None


@torch.no_grad()
def ask(model, prefilled, context_length: int, questions: list[list[int]], later: list[list[int]],
        golds: list[list[int]], eos: set[int], stop: Callable[[list[int]], bool] | None = None,
        modes: tuple[str, ...] = MODES, cache_key: str = "past_key_values") -> dict[str, list[dict]]:
    """Every question in each of `modes`: `{mode: [{"answer": ids, "logprobs", "argmax"}, ...]}`.

    `prefilled`: the cache after the context (`context_length` positions), used up by the last
    mode; `questions[i]`: question `i`'s ids as the first turn after the context; `later[i]`: as a
    turn after an answer; `golds[i]`: its gold answer's ids.

    [ours] The teacher-forced pass decides the greedy answer where it follows the gold: while each
    gold token is the greedy one, greedy decoding writes exactly the gold, so when all are, the
    answer is the gold and greedy tokens after it (from the pass's last logits, until `stop`);
    only an answer that leaves the gold is decoded token by token from the question on. The two
    are the same tokens (`tests/test_shared_context.py` checks it against plain greedy decoding)."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}")
    model.eval()
    out: dict[str, list[dict]] = {}
    for number, mode in enumerate(modes):
        turns = list(zip(questions, golds)) if mode == "multi-request" else \
            [(questions[0] if i == 0 else later[i], g) for i, g in enumerate(golds)]
        cache = prefilled if number == len(modes) - 1 else copy.deepcopy(prefilled)
        position, pending, records = context_length, [], []
        for question, gold in turns:
            prompt = pending + question
            forced = copy.deepcopy(cache)
            record = teacher_forced(model, forced, position, prompt, gold, cache_key)
            most = len(gold) + EXTRA_TOKENS
            if all(record["argmax"]):
                answer, left = greedy(model, forced, position + len(prompt) + len(gold), [], most, eos, cache_key,
                                      stop, answer=gold, token=record["next"])
                fed = forced
            else:
                fed = cache if mode == "multi-turn" else copy.deepcopy(cache)
                answer, left = greedy(model, fed, position, prompt, most, eos, cache_key, stop)
            record["answer"] = answer
            records.append(record)
            if mode == "multi-turn":
                cache, pending = fed, left
                position += len(prompt) + len(answer) - len(left)
        out[mode] = records
    return out
