"""Evaluation: perplexity over a text with a sliding window."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm


@dataclass
class Perplexity:
    tokens: int  # predicted tokens
    nll: float  # mean negative log-likelihood per token (nats)
    ppl: float
    context: int
    stride: int

    def to_dict(self) -> dict:
        return asdict(self)


def windows(length: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first_scored) spans; no token is scored twice.

    Windows hold up to `context` tokens and start every `stride` tokens; each scores the
    tokens the previous one did not, except its own first token, which it cannot predict
    (as in transformers' perplexity guide). With `stride < context` every scored token past
    the first window has at least `context - stride` tokens of left context; with
    `stride == context` the windows do not overlap and one token per window goes unscored.
    """
    if not 1 <= stride <= context:
        raise ValueError(f"need 1 <= stride <= context, got stride={stride}, context={context}")
    spans, scored_until, start = [], 1, 0
    while scored_until < length:
        end = min(start + context, length)
        spans.append((start, end, max(scored_until, start + 1)))
        scored_until = end
        start += stride
    return spans


@torch.no_grad()
def perplexity(
    model, ids: Tensor, context: int = 1024, stride: int | None = None, batch_size: int = 4, progress: bool = True
) -> Perplexity:
    """Perplexity of `model` on the token stream `ids` `[L]`."""
    stride = stride or context
    spans = windows(len(ids), context, stride)
    total_nll, total_tokens = 0.0, 0
    model.eval()
    for first in tqdm(range(0, len(spans), batch_size), desc="perplexity", unit="batch", disable=not progress):
        group = spans[first:first + batch_size]
        width = max(end - start for start, end, _ in group)
        batch = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, (start, end, _) in enumerate(group):  # right padding: causal rows are unaffected
            batch[row, : end - start] = ids[start:end]
            mask[row, : end - start] = 1
        logits = model(batch, attention_mask=mask, use_cache=False).logits.float()
        for row, (start, end, scored) in enumerate(group):
            # position p predicts token p + 1; score tokens scored..end-1
            pred = logits[row, scored - start - 1 : end - start - 1]
            target = ids[scored:end]
            total_nll += F.cross_entropy(pred, target, reduction="sum").item()
            total_tokens += len(target)
    nll = total_nll / total_tokens
    return Perplexity(total_tokens, nll, math.exp(nll), context, stride)
