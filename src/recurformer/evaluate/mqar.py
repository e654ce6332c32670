"""`--task mqar`: multi-query associative recall in real tokens, teacher-forced (the
generator and scorer are in `tasks/mqar.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import ConfigError, option, require
from ..device import to_model
from ..metrics import Metric, Row, per_model
from ..tasks.mqar import mqar_tokens, score_mqar
from .logits import greedy_tokens
from .registry import RunSettings, Task, register


@torch.no_grad()
def mqar_accuracy(
    model, tokenizer, num_examples: int = 32, seq_len: int = 512, num_kv_pairs: int = 32, seed: int = 0,
    batch_size: int = 8,
) -> dict:
    """In-context associative recall with real tokens: MQAR sequences whose ids are mapped
    onto a fixed pool of the tokenizer's single-token words, scored on the queried values
    (teacher-forced, one forward pass per batch, the logits a chunk of positions at a time)."""
    pool, data = mqar_inputs(tokenizer, num_examples, seq_len, num_kv_pairs, seed)
    labels = torch.where(data["labels"] >= 0, pool[data["labels"].clamp_min(0)], data["labels"])
    ids, labels = to_model(model, pool[data["input_ids"]], labels)
    # the greedy guesses, not the logits: 32 sequences of 1,024 tokens have 6.4 GB of logits
    guesses = torch.cat([greedy_tokens(model, ids[i:i + batch_size]) for i in range(0, len(ids), batch_size)])
    predictions = torch.cat([torch.full_like(guesses[:, :1], -1), guesses[:, :-1]], dim=1)  # aligned with labels
    return {"task": "mqar", "seq_len": seq_len, "num_kv_pairs": num_kv_pairs, **score_mqar(predictions, labels)}


def mqar_inputs(tokenizer, num_examples: int, seq_len: int, num_kv_pairs: int, seed: int = 0) -> tuple[Tensor, dict]:
    """(the word pool, the MQAR sequences over it); sizes the tokenizer or the context cannot
    meet a one-line error."""
    try:
        pool = word_pool(tokenizer, 2 * num_kv_pairs * 8)
        return pool, mqar_tokens(num_examples, seq_len, num_kv_pairs, vocab_size=len(pool), seed=seed)
    except ValueError as error:  # sizes the tokenizer or the context cannot meet: one line, as passkey does
        raise ConfigError(f"--task mqar: {error}") from None


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


@dataclass(frozen=True)
class MQAROptions:
    problems: int = option(32, "number of sequences")
    context: int = option(1024, "tokens per sequence")
    kv_pairs: int = option(32, "key-value pairs per sequence")
    seed: int = option(0, "seeds the sequences")
    batch_size: int = option(4, "sequences per forward pass")

    def __post_init__(self) -> None:
        require(self.problems >= 1, f"--problems must be >= 1, got {self.problems}")
        require(self.kv_pairs >= 1, f"--kv-pairs must be >= 1, got {self.kv_pairs}")
        require(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")


def check(options: MQAROptions, config, tokenizer=None) -> None:
    """Before any work, with `tokenizer`: words for the pairs, pairs that fit the context (one
    sequence made)."""
    if tokenizer is not None:
        mqar_inputs(tokenizer(), 1, options.context, options.kv_pairs, options.seed)


def evaluate(model, tokenizer, options: MQAROptions) -> dict:
    return mqar_accuracy(model, tokenizer, num_examples=options.problems, seq_len=options.context,
                         num_kv_pairs=options.kv_pairs, seed=options.seed, batch_size=options.batch_size)


def run_options(settings: RunSettings) -> dict[str, MQAROptions]:
    if settings.quick:
        return {"mqar": MQAROptions(problems=2, context=64, kv_pairs=4, seed=settings.seed, batch_size=8)}
    return {"mqar": MQAROptions(problems=32, context=256, kv_pairs=16, seed=settings.seed, batch_size=8)}


register(Task(
    name="mqar", summary="multi-query associative recall over real word tokens, token accuracy (docs/tasks.md)",
    options=MQAROptions, evaluate=evaluate, check=check, report_order=20, run_options=run_options,
    metrics=(
        *per_model("mqar", "accuracy", "MQAR token accuracy", ("original", "final"), fmt="{:.0%}", better="higher"),
        Metric("mqar_problems", "MQAR sequences", lambda r: r.result("mqar", "original")["n"]),
        Metric("mqar_context", "MQAR tokens per sequence", lambda r: r.result("mqar", "original")["seq_len"],
               unit="tokens"),
        Metric("mqar_kv_pairs", "MQAR key-value pairs per sequence",
               lambda r: r.result("mqar", "original")["num_kv_pairs"]),
    ),
    rows=(Row("MQAR, token accuracy ({mqar_problems} sequences of {mqar_context} tokens, {mqar_kv_pairs} pairs)",
              "mqar_original", "mqar_final", None),),
))
