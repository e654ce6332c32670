"""`--task ppl-by-distance`: per-token loss on long sequences of held-out text, by how far
into the sequence the token is.

A token at position p has p tokens of context. A sliding-window mixer of w tokens sees all
of them while p < w and only the last w after; a recurrent mixer keeps a summary of all.
The buckets of positions (0-64, 64-256, 256-1K, 1K-2K, 2K-4K, 4K-8K, and doublings beyond)
show where a converted model starts losing against the original. Sequences are
consecutive articles of the text (joined by EOS, as `data.tokenize_documents` does), cut
into `context`-token pieces, each scored in one forward pass (`use_cache=False`) from its
first token; the logits are computed 512 positions at a time (`logits.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from ..config import option, require
from ..corpus_sources import shared_corpora, shown_corpora
from ..data import EVAL_CORPORA, DataError, count_tokens, load_documents, tokenize_documents
from ..device import to_model
from ..metrics import BASELINE, Metric, Row
from .logits import chunked_logits, last_hidden
from .registry import RunSettings, Task, register

EDGES = (0, 64, 256, 1024, 2048, 4096, 8192)  # bucket boundaries; doubled past the last


def buckets(context: int) -> list[tuple[int, int]]:
    """The `[start, end)` position buckets that hold predicted positions of a `context`-token
    sequence: position p (p >= 1) is the token predicted from the p tokens before it.
    Buckets that start at or beyond the context are omitted; the last one is cut at it."""
    edges = list(EDGES)
    while edges[-1] < context:
        edges.append(2 * edges[-1])
    return [(lo, min(hi, context)) for lo, hi in pairwise(edges) if lo < context]


def bucket_name(lo: int, hi: int) -> str:
    """'0-64', '256-1K', '4K-8K': the bucket's bounds, K = 1,024."""
    def short(n: int) -> str:
        return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)
    return f"{short(lo)}-{short(hi)}"


@torch.no_grad()
def position_nll(model, sequence: Tensor) -> Tensor:
    """NLL (nats) `[T - 1]` of each token 1..T-1 of `sequence` `[T]` given the tokens before it;
    entry i belongs to position i + 1 (on the model's device)."""
    sequence, = to_model(model, sequence)
    hidden = last_hidden(model, sequence[None])[0, :-1]
    nll = torch.empty(len(hidden), device=hidden.device)
    for part, logits in chunked_logits(model, hidden):
        nll[part] = F.cross_entropy(logits, sequence[1:][part], reduction="none")
    return nll


@torch.no_grad()
def loss_by_distance(model, sequences: Tensor, progress: bool = True) -> dict:
    """Mean NLL, perplexity and token count per position bucket over `sequences` `[N, T]`,
    and the same over all predicted tokens (`nll`, `ppl`, `tokens`)."""
    context = sequences.shape[1]
    sums = torch.zeros(context, dtype=torch.float64)  # summed NLL per position (0 is never predicted)
    for sequence in tqdm(sequences, desc="ppl-by-distance", unit="seq", disable=not progress):
        sums[1:] += position_nll(model, sequence).double().cpu()
    per_bucket = []
    for lo, hi in buckets(context):
        first = max(lo, 1)
        tokens = (hi - first) * len(sequences)
        nll = sums[first:hi].sum().item() / tokens
        per_bucket.append({"bucket": bucket_name(lo, hi), "start": lo, "end": hi, "tokens": tokens,
                           "nll": nll, "ppl": math.exp(nll)})
    tokens = (context - 1) * len(sequences)
    nll = sums.sum().item() / tokens
    return {"sequences": len(sequences), "context": context, "tokens": tokens, "nll": nll, "ppl": math.exp(nll),
            "buckets": per_bucket}


@dataclass(frozen=True)
class PplByDistanceOptions:
    data: list[str] = option(help="held-out text (.txt or .jsonl), consecutive documents", metavar="FILE",
                             factory=lambda: shared_corpora(EVAL_CORPORA),
                             shown=shown_corpora(EVAL_CORPORA))
    context: int = option(8192, "tokens per sequence")
    sequences: int = option(2, "sequences scored (the first N of the text)")

    def __post_init__(self) -> None:
        require(bool(self.data), "--task ppl-by-distance needs --data FILE (no shared corpora found)")
        require(self.context >= 2, f"--context must be >= 2, got {self.context}")
        require(self.sequences >= 1, f"--sequences must be >= 1, got {self.sequences}")


def _too_short(tokens: int, options: PplByDistanceOptions) -> DataError:
    return DataError(f"--data has {tokens:,} tokens, fewer than --sequences {options.sequences} x --context "
                     f"{options.context}")


def check(options: PplByDistanceOptions, config, tokenizer=None) -> None:
    """Before any work: sequences the model's positions (`config`: its text config) hold and,
    with `tokenizer`, text for all of them."""
    limit = config.max_position_embeddings
    require(options.context <= limit, f"--context {options.context} is longer than the model allows ({limit} positions)")
    if tokenizer is not None:
        needed = options.sequences * options.context
        tokens = count_tokens(tokenizer(), load_documents(options.data), limit=needed)
        if tokens < needed:
            raise _too_short(tokens, options)


def evaluate(model, tokenizer, options: PplByDistanceOptions) -> dict:
    check(options, model.config.get_text_config())
    needed = options.sequences * options.context
    ids = tokenize_documents(tokenizer, load_documents(options.data), limit=needed)
    if len(ids) < needed:
        raise _too_short(len(ids), options)
    sequences = torch.tensor(ids[:needed]).view(options.sequences, options.context)
    result = loss_by_distance(model.eval(), sequences)
    return {"data": [str(p) for p in options.data], **result}


def run_options(settings: RunSettings) -> dict[str, PplByDistanceOptions]:
    if settings.quick:
        return {"ppl-by-distance": PplByDistanceOptions(data=settings.eval_data, context=128, sequences=1)}
    return {"ppl-by-distance": PplByDistanceOptions(data=settings.eval_data, context=4096, sequences=2)}


FAR = 1024  # `run` reports the tokens with at least this many tokens before them


def far_buckets(r, model: str) -> list[dict]:
    """The buckets at positions >= FAR of the task's result on `model` (the last bucket if
    the sequences are shorter: a quick run)."""
    buckets = r.result("ppl-by-distance", model)["buckets"]
    return [b for b in buckets if b["start"] >= FAR] or buckets[-1:]


def far_ppl(r, model: str) -> float:
    far = far_buckets(r, model)
    return math.exp(sum(b["nll"] * b["tokens"] for b in far) / sum(b["tokens"] for b in far))


RUN_MODELS = ("original", "final", BASELINE)


def distance_section(m: dict, evaluation: dict) -> tuple[str, list[str]]:
    """The run report's perplexity per position bucket of each model, and its ratio to the original."""
    by_distance = evaluation["ppl-by-distance"]
    others = [name for name in by_distance if name != "original"]
    lines = ["Perplexity by position in the held-out sequences (a token at position p has p tokens before it); "
             f"`{BASELINE}` is the window at equal cache bytes.", "",
             "| positions | tokens | original | " + " | ".join(f"{name} | {name} / original" for name in others) + " |",
             "|---|---|---|" + "---|---|" * len(others)]
    for i, bucket in enumerate(by_distance["original"]["buckets"]):
        cells = [bucket["bucket"], f"{bucket['tokens']:,}", f"{bucket['ppl']:.2f}"]
        for name in others:
            ppl = by_distance[name]["buckets"][i]["ppl"]
            cells += [f"{ppl:.2f}", f"{ppl / bucket['ppl']:.3f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "What is lost at a distance", lines


register(Task(
    name="ppl-by-distance", summary="loss by token position on long held-out sequences (docs/tasks.md)",
    options=PplByDistanceOptions, evaluate=evaluate, check=check, report_order=5, run_options=run_options,
    run_models=RUN_MODELS,
    report_section=distance_section,
    metrics=(
        Metric("ppl_far_from", "first position of the far buckets", lambda r: far_buckets(r, "original")[0]["start"],
               "{:,}"),
        *(Metric(f"ppl_far_{m}", f"held-out perplexity at the far positions: {m}", (lambda r, m=m: far_ppl(r, m)),
                 "{:.2f}", "lower") for m in RUN_MODELS),
        *(Metric(f"ppl_far_{m}_ratio", f"held-out perplexity at the far positions, {m} / original",
                 (lambda r, m=m: far_ppl(r, m) / far_ppl(r, "original")), "{:.3f}x", "lower", "x")
          for m in ("final", BASELINE)),
        Metric("ppl_far_context", "tokens per ppl-by-distance sequence",
               lambda r: r.result("ppl-by-distance", "original")["context"], "{:,}", unit="tokens"),
        Metric("ppl_far_sequences", "ppl-by-distance sequences",
               lambda r: r.result("ppl-by-distance", "original")["sequences"]),
    ),
    rows=(Row("perplexity at positions >= {ppl_far_from} of {ppl_far_sequences} held-out sequences of {ppl_far_context} "
              "tokens", "ppl_far_original", "ppl_far_final", "ppl_far_final_ratio", baseline="ppl_far_baseline",
              baseline_ratio="ppl_far_baseline_ratio"),),
))
