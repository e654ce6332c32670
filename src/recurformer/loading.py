"""Models and tokenizers from names, model directories and converted folders; and saving
them atomically. Below both the command layer and the pipeline, which share it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .config import ConfigError
from .files import atomic_directory, atomic_members
from .hub import local_directory, model_type_of, resolve_model, source_name
from .model_card import write_model_card
from .modeling import check_architecture
from .surgery import model_fingerprint

RECURFORMER_TYPE = "recurformer"


def load_model(name_or_path: str, progress: bool = True):
    """(model in fp32 eval mode, tokenizer, local directory) for a path, a known name or a
    hub id (`org/name`, `org/name@revision`)."""
    directory = resolve_model(name_or_path, progress=progress)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(directory), directory


def is_converted(path: str | Path) -> bool:
    """Whether `path` is a directory holding a converted RecurFormer model."""
    config = Path(path) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == RECURFORMER_TYPE


def load_converted(directory: str | Path):
    """(RecurFormer model in fp32, tokenizer) from a directory written by convert or train."""
    path = Path(directory)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{directory}: not a model directory (no config.json)")
    if not is_converted(path):
        raise ConfigError(f"{directory}: not a converted RecurFormer model (run 'recurformer convert' first)")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def load_any(name_or_path: str):
    """(model, tokenizer) for a converted directory, a model directory or a known name."""
    if is_converted(name_or_path):
        return load_converted(name_or_path)
    model, tokenizer, _ = load_model(name_or_path)
    return model, tokenizer


def load_teacher(student, teacher: str | None = None):
    """The original model `student` was converted from (`teacher` overrides the recorded
    name), checked by its weight fingerprint."""
    name = teacher or student.config.source_model
    if not name:
        raise ConfigError("the model does not record the model it was converted from; pass --teacher")
    model = load_model(name)[0]
    expected = student.config.source_fingerprint
    if expected and model_fingerprint(model) != expected:
        raise ConfigError(f"teacher {name} is not the model this one was converted from (fingerprint mismatch)")
    return model


def portable_name(model: str) -> str:
    """How a converted model records its source, so that `load_teacher` finds it again: a
    known name its canonical name, a directory its absolute path, a hub id
    `org/name@<commit>` of its snapshot (`hub.source_name`)."""
    return source_name(model)


def check_convertible(name_or_path: str) -> None:
    """Refuse, before any work, what `resolve_model` would refuse without the network, and a
    model at hand (a folder, a hub id in the cache, a fetched registry model) of an
    architecture `convert` does not support."""
    directory = local_directory(name_or_path)
    if directory is not None:
        check_architecture(model_type_of(directory, str(name_or_path)))


def save_model(model, tokenizer, out: str | Path) -> None:
    """Save model + tokenizer (and a converted model's card, `model_card.py`) as the
    directory `out`, replacing it whole and atomically."""
    with atomic_directory(out, replace=True) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if is_converted(staging):
            write_model_card(staging)


def save_model_files(model, tokenizer, out: str | Path) -> None:
    """Save model + tokenizer (and a converted model's card) into `out` beside the files
    already there (training logs), one atomic rename per file."""
    with atomic_members(out) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if is_converted(staging):
            write_model_card(staging)
