"""`--task ppl`: perplexity of a text, scored in windows of `context` tokens; the logits are
computed 512 positions at a time (`logits.py`): a batch of 4 windows of 2,048 tokens would
otherwise hold 1.6 GB of fp32 logits at once."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from ..config import option, require
from ..data import check_length, load_documents, tokenize_documents
from ..device import to_model
from ..metrics import BASELINE, MODELS, Metric, Row, per_model
from .logits import CHUNK, chunked_logits, last_hidden
from .registry import RunSettings, Task, register


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
    model, ids: Tensor, context: int = 1024, stride: int | None = None, batch_size: int = 4, progress: bool = True,
    chunk: int = CHUNK,
) -> Perplexity:
    """Perplexity of `model` on the token stream `ids` `[L]` (logits `chunk` positions at a time)."""
    stride = stride or context
    spans = windows(len(ids), context, stride)
    total_nll, total_tokens = 0.0, 0
    model.eval()
    ids, = to_model(model, ids)
    for first in tqdm(range(0, len(spans), batch_size), desc="perplexity", unit="batch", disable=not progress):
        group = spans[first:first + batch_size]
        width = max(end - start for start, end, _ in group)
        batch = torch.zeros(len(group), width, dtype=torch.long, device=ids.device)
        mask = torch.zeros(len(group), width, dtype=torch.long, device=ids.device)
        for row, (start, end, _) in enumerate(group):  # right padding: causal rows are unaffected
            batch[row, : end - start] = ids[start:end]
            mask[row, : end - start] = 1
        hidden = last_hidden(model, batch, mask)  # [b, width, d]
        for row, (start, end, scored) in enumerate(group):
            # position p predicts token p + 1; score tokens scored..end-1
            target = ids[scored:end]
            for part, logits in chunked_logits(model, hidden[row, scored - start - 1 : end - start - 1], chunk):
                total_nll += F.cross_entropy(logits, target[part], reduction="sum").item()
            total_tokens += len(target)
    nll = total_nll / total_tokens
    return Perplexity(total_tokens, nll, math.exp(nll), context, stride)


@dataclass(frozen=True)
class PerplexityOptions:
    data: list[str] = option([], "text files to score (.txt or .jsonl)", metavar="FILE")
    context: int = option(1024, "tokens per window")
    stride: int | None = option(None, "window step; not given: the context (no overlap)")
    max_tokens: int | None = option(None, "score only the first N tokens of the text")
    batch_size: int = option(4, "windows per forward pass")

    def __post_init__(self) -> None:
        require(bool(self.data), "--task ppl needs --data FILE")
        require(self.context >= 2, f"--context must be >= 2, got {self.context}")
        require(self.stride is None or 1 <= self.stride <= self.context, f"--stride must be in [1, --context], got {self.stride}")
        require(self.max_tokens is None or self.max_tokens >= 2, f"--max-tokens must be >= 2, got {self.max_tokens}")
        require(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")


def check(options: PerplexityOptions, config, tokenizer=None) -> None:
    """Before any work: windows the model's positions (`config`: its text config) hold."""
    check_length(options.context, config)


def evaluate(model, tokenizer, options: PerplexityOptions) -> dict:
    documents = load_documents(options.data)
    check(options, model.config.get_text_config())
    ids = torch.tensor(tokenize_documents(tokenizer, documents, limit=options.max_tokens))
    result = perplexity(model.eval(), ids, context=options.context, stride=options.stride, batch_size=options.batch_size)
    return {"data": [str(p) for p in options.data], **result.to_dict()}


def run_options(settings: RunSettings) -> dict[str, PerplexityOptions]:
    """Held-out (`ppl`) and out-of-domain (`ppl-ood`) text, the first 16,384 tokens of each
    in windows of 2,048."""
    sizes = dict(context=128, max_tokens=512) if settings.quick else dict(context=2048, max_tokens=16384)
    runs = {"ppl": PerplexityOptions(data=list(settings.eval_data), **sizes)}
    if settings.ood_data:
        runs["ppl-ood"] = PerplexityOptions(data=list(settings.ood_data), **sizes)
    return runs


def ratio(task: str, model: str, reference: str = "original"):
    """The metric function: perplexity of `model` / of `reference` on the text of `task`."""
    return lambda r: r.result(task, model)["ppl"] / r.result(task, reference)["ppl"]


def recovery_section(m: dict, evaluation: dict) -> tuple[str, list[str]]:
    """The run report's section on perplexity through the stages (`m`: the run's metrics)."""
    lines = ["Held-out perplexity after each stage; out-of-domain perplexity of the original and the final model.",
             "", "| model | held-out perplexity | x original | out-of-domain perplexity | x original |",
             "|---|---|---|---|---|"]
    for key, label in (("original", "original"), ("converted", "converted, untrained"),
                       ("transfer", f"after transfer ({m['transfer_steps']} steps, {m['transfer_tokens']:,} tokens, "
                                    f"{m['transfer_minutes']:.1f} min)"),
                       ("final", f"after lm ({m['lm_steps']} steps, {m['lm_tokens']:,} tokens, {m['lm_minutes']:.1f} min)")):
        ood = m.get(f"ppl_ood_{key}")
        ood_cells = "| | |" if ood is None else f"| {ood:.2f} | {ood / m['ppl_ood_original']:.3f} |"
        lines.append(f"| {label} | {m[f'ppl_{key}']:.2f} | {m[f'ppl_{key}'] / m['ppl_original']:.3f} {ood_cells}")
    return "Recovery by continual training", lines


register(Task(
    name="ppl", summary="perplexity of a text (--data), in windows of --context tokens",
    options=PerplexityOptions, evaluate=evaluate, check=check, report_order=0,
    report_section=recovery_section,
    run_options=run_options, run_models={"ppl": (*MODELS, BASELINE), "ppl-ood": ("original", "final", BASELINE)},
    metrics=(
        *per_model("ppl", "ppl", "held-out perplexity", (*MODELS, BASELINE), fmt="{:.2f}", better="lower"),
        Metric("ppl_tokens", "held-out tokens predicted", lambda r: r.result("ppl", "original")["tokens"], "{:,}",
               unit="tokens"),
        Metric("ppl_context", "tokens per perplexity window", lambda r: r.result("ppl", "original")["context"], "{:,}",
               unit="tokens"),
        Metric("ppl_ratio", "held-out perplexity, converted / original", ratio("ppl", "final"), "{:.3f}x", "lower", "x"),
        Metric("ppl_baseline_ratio", "held-out perplexity, window at equal cache / original", ratio("ppl", BASELINE),
               "{:.3f}x", "lower", "x"),
        *per_model("ppl-ood", "ppl", "out-of-domain perplexity", ("original", "final", BASELINE), fmt="{:.2f}",
                   better="lower", key="ppl_ood"),
        Metric("ppl_ood_tokens", "out-of-domain tokens predicted", lambda r: r.result("ppl-ood", "original")["tokens"],
               "{:,}", unit="tokens"),
        Metric("ppl_ood_ratio", "out-of-domain perplexity, converted / original", ratio("ppl-ood", "final"), "{:.3f}x",
               "lower", "x"),
        Metric("ppl_ood_baseline_ratio", "out-of-domain perplexity, window at equal cache / original",
               ratio("ppl-ood", BASELINE), "{:.3f}x", "lower", "x"),
    ),
    rows=(Row("perplexity, held-out text ({ppl_tokens} tokens, windows of {ppl_context})", "ppl_original", "ppl_final",
              "ppl_ratio", baseline="ppl_baseline", baseline_ratio="ppl_baseline_ratio"),
          Row("perplexity, out-of-domain text ({ppl_ood_tokens} tokens, never trained on)", "ppl_ood_original",
              "ppl_ood_final", "ppl_ood_ratio", baseline="ppl_ood_baseline", baseline_ratio="ppl_ood_baseline_ratio")),
))
