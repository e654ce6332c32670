"""Evaluation: perplexity over a text with a sliding window, HashHop by generation, MQAR
as in-context recall over real tokens."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from .tasks.hashhop import generate_hashhop, score_hashhop
from .tasks.mqar import mqar_tokens, score_mqar


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


@torch.no_grad()
def hashhop_accuracy(
    model, tokenizer, num_problems: int = 20, hops: int = 2, target_tokens: int = 512, cot: bool = False,
    shots: int = 1, seed: int = 0, batch_size: int = 4, progress: bool = True,
) -> dict:
    """Greedy completions of HashHop prompts sized to `target_tokens`, scored by exact match."""
    problems = generate_hashhop(num_problems, hops=hops, target_tokens=target_tokens, tokenizer=tokenizer,
                                cot=cot, seed=seed, shots=shots)
    answer_tokens = max(len(tokenizer.encode(" " + p.answer, add_special_tokens=False)) for p in problems)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    predictions = []
    model.eval()
    for first in tqdm(range(0, len(problems), batch_size), desc="hashhop", unit="batch", disable=not progress):
        prompts = [p.prompt for p in problems[first:first + batch_size]]
        encoded = [tokenizer.encode(text) for text in prompts]
        width = max(map(len, encoded))
        ids = torch.full((len(encoded), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, tokens in enumerate(encoded):  # left padding, as generation needs
            ids[row, width - len(tokens):] = torch.tensor(tokens)
            mask[row, width - len(tokens):] = 1
        out = model.generate(ids, attention_mask=mask, max_new_tokens=answer_tokens + 2, do_sample=False, pad_token_id=pad)
        predictions += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    scores = score_hashhop(predictions, problems)
    return {"task": "hashhop", "hops": hops, "target_tokens": target_tokens, "cot": cot, "shots": shots,
            "n_chains_mean": sum(p.n_chains for p in problems) / len(problems), **scores}


@torch.no_grad()
def mqar_accuracy(
    model, tokenizer, num_examples: int = 32, seq_len: int = 512, num_kv_pairs: int = 32, seed: int = 0,
    batch_size: int = 8,
) -> dict:
    """In-context associative recall with real tokens: MQAR sequences whose ids are mapped
    onto a fixed pool of the tokenizer's single-token words, scored on the queried values
    (teacher-forced, one forward pass per batch)."""
    pool = word_pool(tokenizer, 2 * num_kv_pairs * 8)
    data = mqar_tokens(num_examples, seq_len, num_kv_pairs, vocab_size=len(pool), seed=seed)
    ids = pool[data["input_ids"]]
    labels = torch.where(data["labels"] >= 0, pool[data["labels"].clamp_min(0)], data["labels"])
    logits = torch.cat([model(ids[i:i + batch_size], use_cache=False).logits for i in range(0, len(ids), batch_size)])
    return {"task": "mqar", "seq_len": seq_len, "num_kv_pairs": num_kv_pairs, **score_mqar(logits, labels)}


def word_pool(tokenizer, size: int) -> Tensor:
    """`size` distinct token ids of lowercase words with a leading space (e.g. ' house'),
    the ids a model reads as ordinary words; deterministic for a tokenizer."""
    pool = []
    for token, index in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        word = tokenizer.convert_tokens_to_string([token])
        if word.startswith(" ") and word[1:].isalpha() and word[1:].islower() and len(word) > 3:
            pool.append(index)
            if len(pool) == size:
                return torch.tensor(pool)
    raise ValueError(f"the tokenizer has only {len(pool)} plain word tokens, {size} needed")
