"""Models and tokenizers from names, model directories and converted folders; and saving
them atomically. Below both the command layer and the pipeline, which share it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .config import ConfigError
from .files import atomic_directory, atomic_members
from .hub import resolve_model
from .surgery import model_fingerprint

RECURFORMER_TYPE = "recurformer"


def load_model(name_or_path: str, progress: bool = True, dtype: torch.dtype = torch.float32):
    """(model in `dtype` (fp32) eval mode, tokenizer, local directory) for a path or a known name."""
    directory = resolve_model(name_or_path, progress=progress)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(directory), directory


def is_converted(path: str | Path) -> bool:
    """Whether `path` is a directory holding a converted RecurFormer model."""
    config = Path(path) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == RECURFORMER_TYPE


def load_converted(directory: str | Path, dtype: torch.dtype = torch.float32):
    """(RecurFormer model in `dtype` (fp32), tokenizer) from a directory written by convert or train."""
    path = Path(directory)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{directory}: not a model directory (no config.json)")
    if not is_converted(path):
        raise ConfigError(f"{directory}: not a converted RecurFormer model (run 'recurformer convert' first)")
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype), AutoTokenizer.from_pretrained(path)


def load_any(name_or_path: str):
    """(model, tokenizer) for a converted directory, a model directory or a known name."""
    if is_converted(name_or_path):
        return load_converted(name_or_path)
    model, tokenizer, _ = load_model(name_or_path)
    return model, tokenizer


def load_teacher(student, teacher: str | None = None, dtype: torch.dtype = torch.float32):
    """The original model `student` was converted from (`teacher` overrides the recorded
    name), checked by its weight fingerprint, in `dtype` (fp32)."""
    name = teacher or student.config.source_model
    if not name:
        raise ConfigError("the model does not record the model it was converted from; pass --teacher")
    model = load_model(name)[0]
    expected = student.config.source_fingerprint
    if expected and model_fingerprint(model) != expected:
        raise ConfigError(f"teacher {name} is not the model this one was converted from (fingerprint mismatch)")
    if dtype != torch.float32:
        # The fingerprint is of the fp32 weights; loading in `dtype` (rather than casting the
        # fp32 model) keeps what transformers keeps in fp32, such as the rotary frequencies.
        del model
        model = load_model(name, progress=False, dtype=dtype)[0]
    return model


def portable_name(model: str) -> str:
    """How a converted model records its source: a known name stays a name, a directory
    becomes its absolute path."""
    path = Path(model).expanduser()
    return str(path.resolve()) if (path / "config.json").is_file() else str(model)


def save_model(model, tokenizer, out: str | Path) -> None:
    """Save model + tokenizer as the directory `out`, replacing it whole and atomically."""
    with atomic_directory(out, replace=True) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)


def save_model_files(model, tokenizer, out: str | Path) -> None:
    """Save model + tokenizer into `out` beside the files already there (training logs),
    one atomic rename per file."""
    with atomic_members(out) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
