"""Greedy completions of text prompts: batched with left padding (`greedy_completions`), or
one prompt at a time, its context prefilled first (`prefilled_answer`). A RecurFormer model
on a GPU decodes the batches with its steps replayed from a CUDA graph (`generate_tokens`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from ..cache import CACHE_ARGUMENT
from ..decode_graph import generate_tokens
from ..device import model_device, to_model


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 4,
                       desc: str = "generate", progress: bool = True) -> list[str]:
    """The greedy continuation of each prompt, at most `max_new_tokens` tokens, decoded
    without special tokens. Prompts run `batch_size` at a time, left-padded as generation needs."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    completions = []
    model.eval()
    for first in tqdm(range(0, len(prompts), batch_size), desc=desc, unit="batch", disable=not progress):
        encoded = [tokenizer.encode(prompt) for prompt in prompts[first:first + batch_size]]
        width = max(map(len, encoded))
        ids = torch.full((len(encoded), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, tokens in enumerate(encoded):
            ids[row, width - len(tokens):] = torch.tensor(tokens)
            mask[row, width - len(tokens):] = 1
        ids, mask = to_model(model, ids, mask)
        out = generate_tokens(model, ids, max_new_tokens, pad, attention_mask=mask)
        completions += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return completions


@torch.no_grad()
def prefilled_answer(model, context: list[int], question: list[int], max_new_tokens: int, eos: set[int],
                     cache=None, compress: Callable[[object, int], None] | None = None,
                     stop: Callable[[list[int]], bool] | None = None) -> list[int]:
    """Greedy answer ids after a prefill, as kvpress's pipeline answers (batch 1).

    Prefill `context` into `cache` (None: the one the model makes), call `compress(cache,
    len(context))` if given (a cache compression acts here, on the context only), feed
    `question` at its positions after the context, then greedy tokens, at positions that
    continue the context's whatever the cache now holds, until an `eos` id (not returned),
    `stop(ids)` or `max_new_tokens`."""
    model.eval()
    device = model_device(model)
    arguments = {} if cache is None else {CACHE_ARGUMENT: cache}
    out = model(input_ids=torch.tensor([context], device=device), use_cache=True, logits_to_keep=1, **arguments)
    cache = out[CACHE_ARGUMENT] if cache is None else cache
    if compress is not None:
        compress(cache, len(context))
    position, step, answer = len(context), torch.tensor([question], device=device), []
    while len(answer) < max_new_tokens:
        positions = torch.arange(position, position + step.shape[1], device=device)[None]
        logits = model(input_ids=step, **{CACHE_ARGUMENT: cache}, position_ids=positions, use_cache=True,
                       logits_to_keep=1).logits
        token = int(logits[0, -1].argmax())
        if token in eos:
            break
        answer.append(token)
        if stop is not None and stop(answer):
            break
        position += step.shape[1]
        step = torch.tensor([[token]], device=device)
    return answer
