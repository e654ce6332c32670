"""The commands behind the CLI, as typed functions. Every input is checked before any long
work starts or any file is written; outputs are written atomically."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .config import ConfigError, MixerConfig
from .data import check_length, load_documents, token_sequences
from .files import write_json_atomic
from .hub import resolve_model
from .modeling import check_architecture
from .report import plot_head_heatmap
from .scoring import DEFAULT_WINDOWS, HeadScores, analyze, groups_to_replace, make_scorer, select_heads
from .surgery import INITS, convert, parameter_report


def load_model(name_or_path: str, progress: bool = True):
    """(model in fp32 eval mode, tokenizer, local directory) for a path or known name."""
    directory = resolve_model(name_or_path, progress=progress)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return model, tokenizer, directory


def model_fingerprint(model) -> str:
    """A short hash of the first layer's query weights: tells two same-shaped models apart."""
    weight = model.model.layers[0].self_attn.q_proj.weight.detach().float().contiguous()
    return hashlib.sha256(weight.numpy().tobytes()).hexdigest()[:16]


def check_beta(beta: float) -> None:
    groups_to_replace(1, beta)  # raises the one-line error for a bad beta


def analyze_command(
    model: str,
    data: list[str],
    out: str,
    plot: str | None = None,
    window: int = 16,
    sequences: int = 32,
    seq_len: int = 1024,
    batch_size: int = 1,
    beta: float = 0.5,
    scorer: str = "recency",
    seed: int = 0,
) -> HeadScores:
    """Score every head of `model` on `sequences` x `seq_len` tokens of `data`."""
    if window < 1:
        raise ConfigError(f"--window must be >= 1, got {window}")
    check_beta(beta)
    chosen_scorer = make_scorer(scorer, seed)
    documents = load_documents(data)
    net, tokenizer, _ = load_model(model)
    check_architecture(net.config)
    check_length(seq_len, net.config)
    tokens = token_sequences(tokenizer, documents, seq_len, sequences, seed)
    scores = analyze(net, tokens, window=window, windows=DEFAULT_WINDOWS, batch_size=batch_size,
                     model_name=str(model), data=[str(p) for p in data])
    scores.fingerprint = model_fingerprint(net)
    scores.save(out)
    if plot:
        plot_head_heatmap(scores, plot, select_heads(scores, beta, chosen_scorer))
    return scores


def convert_command(
    model: str,
    scores: str,
    beta: float,
    out: str,
    mixer: str = "mamba",
    scorer: str = "recency",
    init: str = "reuse",
    seed: int = 0,
    force: bool = False,
) -> dict:
    """Select the groups to replace, convert, and save the model + tokenizer into `out`."""
    check_beta(beta)
    if init not in INITS:
        raise ConfigError(f"--init: unknown {init!r}; choose one of {', '.join(INITS)}")
    mixer_config = MixerConfig(kind=mixer)
    chosen_scorer = make_scorer(scorer, seed)
    head_scores = HeadScores.load(scores)
    out_dir = Path(out)
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise ConfigError(f"output directory {out_dir} exists and is not empty (use --force to replace it)")
    net, tokenizer, _ = load_model(model)
    check_architecture(net.config)
    shape = (net.config.num_hidden_layers, net.config.num_attention_heads, net.config.num_key_value_heads)
    if shape != (head_scores.num_layers, head_scores.num_heads, head_scores.num_kv_heads):
        raise ConfigError(
            f"scores are for a model with layers x heads x kv_heads = {head_scores.num_layers} x "
            f"{head_scores.num_heads} x {head_scores.num_kv_heads}, this model has {shape[0]} x {shape[1]} x {shape[2]}"
        )
    fingerprint = model_fingerprint(net)
    if head_scores.fingerprint and head_scores.fingerprint != fingerprint:
        raise ConfigError(
            f"scores were computed on another model ({head_scores.model}, fingerprint {head_scores.fingerprint}), "
            f"not on {model} (fingerprint {fingerprint})"
        )
    spec = select_heads(head_scores, beta, chosen_scorer)
    converted = convert(net, spec, mixer_config, init=init, seed=seed)
    report = parameter_report(net, converted)
    save_model_atomic(converted, tokenizer, out_dir)
    return {"groups": len(spec.groups), "fraction": spec.fraction, **report}


def save_model_atomic(model, tokenizer, out_dir: Path) -> None:
    """Save model + tokenizer into a hidden sibling directory, then swap it into place."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.partial-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
            os.replace(staging, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
