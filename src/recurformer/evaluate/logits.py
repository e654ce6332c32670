"""The output head's logits, a chunk of positions at a time, from the last hidden states:
long-sequence tasks never hold `[T, vocab]` logits at once (8,192 tokens x 49,152 tokens
of vocabulary are 1.6 GB in fp32). Not a task: the tasks that score every position share it."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

CHUNK = 512  # positions whose logits are computed at once


@torch.no_grad()
def last_hidden(model, ids: Tensor) -> Tensor:
    """The final-norm hidden states `[B, T, d]` of the causal LM `model` on `ids` `[B, T]`
    (one forward pass, no cache, no logits)."""
    return model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state


@torch.no_grad()
def chunked_logits(model, hidden: Tensor, chunk: int = CHUNK) -> Iterator[tuple[slice, Tensor]]:
    """(positions, fp32 logits `[n, vocab]`) of the hidden states `hidden` `[T, d]`, `chunk`
    positions at a time, through `model`'s output head."""
    head = model.get_output_embeddings()
    for start in range(0, len(hidden), chunk):
        part = slice(start, min(start + chunk, len(hidden)))
        yield part, head(hidden[part]).float()
