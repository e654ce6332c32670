"""`--task agreement`: how closely a converted model follows its original, token by token.

On windows of `context` tokens of each text, the per-token KL(original || converted) of
the next-token distributions (mean over tokens, nats) and the top-1 agreement (the share of
positions where both models' most likely next token is the same). Both models score the
same windows; the logits are computed 512 positions at a time (`logits.py`). The default
texts are the held-out WikiText-2 test split and the out-of-domain Lee news corpus, so a
model trained on the training corpora shows whether it recovered the original everywhere
or only adapted to the training domain.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from ..config import ConfigError, option, require
from ..corpus_sources import shared_corpora, shown_corpora
from ..data import EVAL_CORPORA, OUT_OF_DOMAIN_CORPORA, DataError, count_tokens, load_documents, tokenize_documents
from ..device import to_model
from ..loading import RECURFORMER_TYPE, is_converted, load_teacher
from ..metrics import BASELINE, Metric, Row, per_model
from .logits import chunked_logits, last_hidden
from .registry import RunSettings, Task, register


_REFERENCE_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.no_grad()
def reference_hidden(reference, window: Tensor) -> Tensor:
    """`reference`'s last hidden states `[T, d]` on `window` `[T]`, computed once per reference
    model and window: `run` compares the final model and the window baseline with the same
    original on the same windows, and the original's forward passes are the same both times.
    Kept while `reference` lives (T x d floats a window: 2.4 MB at 1,024 x 576 in fp32); a
    reference whose weights change in place needs `drop_reference_states` first."""
    states = _REFERENCE_STATES.setdefault(reference, {})
    key = (tuple(window.shape), hashlib.sha256(window.cpu().numpy().tobytes()).hexdigest())
    if key not in states:
        states[key] = last_hidden(reference, *to_model(reference, window[None]))[0]
    return states[key]


def drop_reference_states() -> None:
    """Forget every reference's kept states (`reference_hidden`)."""
    _REFERENCE_STATES.clear()


@torch.no_grad()
def agreement(model, reference, windows: Tensor, progress: bool = True) -> dict:
    """Mean KL(reference || model) of the next-token distributions per position, and top-1
    agreement, over `windows` `[N, T]` (every position of every window, each window read
    from its start; each model reads them on its own device, compared on `model`'s; the
    reference's states are reused from an earlier call, `reference_hidden`)."""
    kl_sum, same, tokens = 0.0, 0, 0
    for window in tqdm(windows, desc="agreement", unit="window", disable=not progress):
        hidden = last_hidden(model, *to_model(model, window[None]))[0]
        reference_states = reference_hidden(reference, window)
        for (_, logits), (_, reference_logits) in zip(chunked_logits(model, hidden),
                                                          chunked_logits(reference, reference_states)):
            reference_logits = reference_logits.to(logits.device)
            log_p, log_q = F.log_softmax(reference_logits, -1), F.log_softmax(logits, -1)
            kl_sum += (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0).sum().item()  # >= 0 per position; rounding is not
            same += (logits.argmax(-1) == reference_logits.argmax(-1)).sum().item()
            tokens += len(logits)
    return {"tokens": tokens, "kl": kl_sum / tokens, "top1_agreement": same / tokens}


@dataclass(frozen=True)
class AgreementOptions:
    data: list[str] = option(help="text files (.txt or .jsonl), each reported on its own", metavar="FILE",
                             factory=lambda: shared_corpora(EVAL_CORPORA + OUT_OF_DOMAIN_CORPORA),
                             shown=shown_corpora(EVAL_CORPORA + OUT_OF_DOMAIN_CORPORA))
    context: int = option(1024, "tokens per window")
    max_tokens: int = option(8192, "tokens scored per file (the first N)")
    reference: str | None = option(None, "the original model (default: the one the converted model records)",
                                   flag="--original", aliases=("--reference",), metavar="MODEL")

    def __post_init__(self) -> None:
        require(bool(self.data), "--task agreement needs --data FILE (no shared corpora found)")
        require(self.context >= 2, f"--context must be >= 2, got {self.context}")
        require(self.max_tokens >= self.context, f"--max-tokens must be >= --context, got {self.max_tokens}")


def check_model(options: AgreementOptions, config) -> None:
    """A converted model (`config`: its config), and a reference that is not one."""
    if config.model_type != RECURFORMER_TYPE:
        raise ConfigError("--task agreement compares a converted model with its original; this model is not converted")
    reference_name = options.reference or config.source_model
    if reference_name and is_converted(reference_name):
        raise ConfigError(f"the reference {reference_name} is a converted model; give the original with --reference")


def _too_short(path: str, tokens: int, options: AgreementOptions) -> DataError:
    return DataError(f"{path} has {tokens:,} tokens, fewer than one window of --context {options.context}")


def check(options: AgreementOptions, config, tokenizer=None) -> None:
    """Before any work: windows the model's positions (`config`: its text config) hold and,
    with `tokenizer`, a window's text in every file."""
    limit = config.max_position_embeddings
    require(options.context <= limit, f"--context {options.context} is longer than the model allows ({limit} positions)")
    if tokenizer is not None:
        for path in options.data:
            tokens = count_tokens(tokenizer(), load_documents([path]), limit=options.context)
            if tokens < options.context:
                raise _too_short(path, tokens, options)


def evaluate(model, tokenizer, options: AgreementOptions, original=None) -> dict:
    """KL and top-1 agreement of `model` against `original` (None: the model `--reference`
    names, else the one `model` records, loaded and checked by its fingerprint)."""
    check_model(options, model.config)
    reference_name = options.reference or model.config.source_model
    check(options, model.config.get_text_config())
    windows = []
    for path in options.data:
        ids = tokenize_documents(tokenizer, load_documents([path]), limit=options.max_tokens)
        if len(ids) < options.context:
            raise _too_short(path, len(ids), options)
        usable = len(ids) // options.context * options.context
        windows.append((str(path), torch.tensor(ids[:usable]).view(-1, options.context)))
    reference = (original if original is not None else load_teacher(model, options.reference)).eval()
    files = [{"data": path, **agreement(model.eval(), reference, w)} for path, w in windows]
    tokens = sum(f["tokens"] for f in files)
    return {"reference": reference_name, "context": options.context, "tokens": tokens,
            "kl": sum(f["kl"] * f["tokens"] for f in files) / tokens,
            "top1_agreement": sum(f["top1_agreement"] * f["tokens"] for f in files) / tokens, "files": files}


def run_options(settings: RunSettings) -> dict[str, AgreementOptions]:
    """On held-out and out-of-domain text, 4,096 tokens of each in windows of 1,024."""
    sizes = dict(context=128, max_tokens=256) if settings.quick else dict(context=1024, max_tokens=4096)
    return {"agreement": AgreementOptions(data=[*settings.eval_data, *settings.ood_data], **sizes)}


RUN_MODELS = ("final", BASELINE)

register(Task(
    name="agreement", summary="KL to and top-1 agreement with the original model (docs/tasks.md)",
    options=AgreementOptions, evaluate=evaluate, report_order=30, run_options=run_options, run_models=RUN_MODELS,
    needs_original=True, check=check, check_model=check_model,
    metrics=(
        *per_model("agreement", "top1_agreement", "top-1 agreement with the original", RUN_MODELS, fmt="{:.1%}",
                   better="higher", key="agreement_top1"),
        *per_model("agreement", "kl", "KL(original || model) per token, nats", RUN_MODELS, fmt="{:.4f}",
                   better="lower", key="agreement_kl"),
        Metric("agreement_tokens", "tokens compared with the original",
               lambda r: r.result("agreement", "final")["tokens"], "{:,}", unit="tokens"),
    ),
    rows=(Row("top-1 agreement with the original ({agreement_tokens} tokens, held-out + out-of-domain)", None,
              "agreement_top1_final", None, baseline="agreement_top1_baseline"),
          Row("KL(original || model) per token, nats", None, "agreement_kl_final", None,
              baseline="agreement_kl_baseline")),
))
