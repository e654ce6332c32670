"""Models and tokenizers from names, model directories and converted folders; and saving
them atomically. Below both the command layer and the pipeline, which share it."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .checks import DamagedFileError, check_finite_weights, check_model_folder, read_json_object, weight_files
from .config import ConfigError
from .device import Placement
from .files import atomic_directory, atomic_members
from .hub import local_directory, model_path, model_type_of, resolve_model, source_name
from .model_card import write_model_card
from .modeling import check_architecture
from .outputs import mark
from .surgery import model_fingerprint

RECURFORMER_TYPE = "recurformer"
CPU = Placement("cpu", "float32")  # what the library loads in unless told otherwise


def load_checked(directory: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
    """(model in `dtype` (fp32) eval mode on `device`, tokenizer) of a model directory, its files
    checked first (`checks.check_model_folder`) and its weights after loading (no NaN or inf)."""
    directory = Path(directory)
    check_model_folder(directory)
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    except SafetensorError as error:  # a header that passed our check but not the library's (overlapping tensors)
        raise DamagedFileError(f"{directory}: its weights cannot be read ({str(error).splitlines()[0]})") from None
    files = weight_files(directory)
    check_finite_weights(model, files[0] if len(files) == 1 else directory)
    return model.to(device), load_tokenizer(directory, model.config)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(directory: Path, config):
    """The tokenizer saved in `directory`, else (a converted model saved by `save_pretrained`
    alone) the one of the model it was converted from (`config`: the model's config); a
    one-line error if neither."""
    if any((directory / name).is_file() for name in TOKENIZER_FILES):
        return AutoTokenizer.from_pretrained(directory)
    source = getattr(config, "source_model", None)
    if source:
        return AutoTokenizer.from_pretrained(resolve_model(source, progress=False))
    raise ConfigError(f"{directory}: no tokenizer files, and no recorded source model to take them from; save the "
                      f"model's tokenizer beside it: tokenizer.save_pretrained('{directory}')")


def model_config(name_or_path: str | Path):
    """The config of a model (a path, a known name, a hub id; a converted folder's
    `RecurFormerConfig`), its folder checked (`checks.check_model_folder`) but no weight
    loaded: what the commands check their arguments against before any work."""
    directory = resolve_model(name_or_path)
    check_model_folder(directory)
    return AutoConfig.from_pretrained(directory)


def model_tokenizer(name_or_path: str | Path, config):
    """The tokenizer `load_model` / `load_converted` give with the model whose config
    (`model_config`) is `config`, without loading its weights."""
    return load_tokenizer(resolve_model(name_or_path), config)


def load_model(name_or_path: str, progress: bool = True, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu"):
    """(model in `dtype` (fp32) eval mode on `device`, tokenizer, local directory) for a path, a
    known name or a hub id (`org/name`, `org/name@revision`)."""
    directory = resolve_model(name_or_path, progress=progress)
    model, tokenizer = load_checked(directory, dtype, device)
    return model, tokenizer, directory


def is_converted(path: str | Path) -> bool:
    """Whether `path` is a directory holding a converted RecurFormer model (a damaged
    `config.json` is an error naming it)."""
    config = Path(path) / "config.json"
    try:
        present = config.is_file()
    except OSError:  # a name too long to be a path is not a directory (the resolver says so)
        return False
    return present and read_json_object(config, "config").get("model_type") == RECURFORMER_TYPE


def load_converted(directory: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
    """(RecurFormer model in `dtype` (fp32) on `device`, tokenizer) from a directory written by
    convert or train."""
    check_converted(directory)
    return load_checked(Path(directory), dtype, device)


def check_converted(directory: str | Path) -> None:
    """Refuse a directory that does not hold a converted RecurFormer model."""
    path = Path(directory)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{directory}: not a model directory (no config.json)")
    if not is_converted(path):
        raise ConfigError(f"{directory}: not a converted RecurFormer model (run 'recurformer convert' first)")


def load_any(name_or_path: str, placement: Placement = CPU):
    """(model, tokenizer) for a converted directory, a model directory or a known name, in
    `placement`'s dtype on its device (default: fp32 on the CPU)."""
    dtype, device = placement.torch_dtype, placement.torch_device
    if is_converted(name_or_path):
        return load_converted(name_or_path, dtype, device)
    model, tokenizer, _ = load_model(name_or_path, dtype=dtype, device=device)
    return model, tokenizer


def load_teacher(student, teacher: str | None = None, dtype: torch.dtype = torch.float32):
    """The original model `student` was converted from (`teacher` overrides the recorded
    name), checked by its weight fingerprint, in `dtype` (fp32), on `student`'s device."""
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
    return model.to(student.device)


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


def model_bytes(name_or_path: str | Path) -> int:
    """The size of a model's weights files (0 for a model not at hand yet): what commands
    scale their disk-room estimates by."""
    directory = model_path(name_or_path)
    return sum(path.stat().st_size for path in weight_files(directory)) if (directory / "config.json").is_file() else 0


def save_model(model, tokenizer, out: str | Path, command: str | None = None) -> None:
    """Save model + tokenizer (and a converted model's card, `model_card.py`) as the
    directory `out`, replacing it whole and atomically (marked as made by `command`, if
    given: `outputs.mark`)."""
    with atomic_directory(out, replace=True) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if is_converted(staging):
            write_model_card(staging)
        if command:
            mark(staging, command)


def save_model_files(model, tokenizer, out: str | Path) -> None:
    """Save model + tokenizer (and a converted model's card) into `out` beside the files
    already there (training logs), one atomic rename per file."""
    with atomic_members(out) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if is_converted(staging):
            write_model_card(staging)
