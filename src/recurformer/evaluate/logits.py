"""The output head's logits, a chunk of positions at a time, from the last hidden states:
long-sequence tasks never hold `[T, vocab]` logits at once (8,192 tokens x 49,152 tokens
of vocabulary are 1.6 GB in fp32). Not a task: the tasks that score every position share it."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

CHUNK = 512  # positions whose logits are computed at once


@torch.no_grad()
def last_hidden(model, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """The final-norm hidden states `[B, T, d]` of the causal LM `model` on `ids` `[B, T]`
    (`attention_mask` `[B, T]`, 1 = token): one forward pass of the whole model, no cache,
    the logits of the last position only. The states are taken from its decoder's output,
    so that the decoder receives what the model's own forward gives it (a converted model
    also passes the 2-D mask to its mixers)."""
    kept = []
    hook = model.get_decoder().register_forward_hook(lambda module, args, output: kept.append(output.last_hidden_state))
    try:
        model(input_ids=ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1)
    finally:
        hook.remove()
    return kept[0]


@torch.no_grad()
def chunked_logits(model, hidden: Tensor, chunk: int = CHUNK) -> Iterator[tuple[slice, Tensor]]:
    """(positions, fp32 logits `[n, vocab]`) of the hidden states `hidden` `[T, d]`, `chunk`
    positions at a time, through `model`'s output head."""
    head = model.get_output_embeddings()
    for start in range(0, len(hidden), chunk):
        part = slice(start, min(start + chunk, len(hidden)))
        yield part, head(hidden[part]).float()


@torch.no_grad()
def greedy_tokens(model, ids: Tensor, chunk: int = CHUNK) -> Tensor:
    """The most likely next token `[B, T]` after every position of `ids` `[B, T]` (on the model's
    device): the argmax of the logits, computed `chunk` positions at a time."""
    hidden = last_hidden(model, ids)
    tokens = torch.empty(ids.shape, dtype=torch.long, device=hidden.device)
    for row in range(len(ids)):
        for part, logits in chunked_logits(model, hidden[row], chunk):
            tokens[row, part] = logits.argmax(-1)
    return tokens
