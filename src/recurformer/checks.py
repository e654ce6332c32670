"""What a command reads, checked before it is used: each damaged file is a one-line error
naming the file and what is wrong with it, never a library's traceback.

The libraries below us fail on damaged files in their own ways: safetensors raises
`SafetensorError`, `json` a `JSONDecodeError`, transformers a `ValueError` for an unknown
`model_type`, torch's weights-only unpickler an `UnpicklingError` whose text advises turning
the check off. Here each file is read the way those libraries would read it, and each
failure becomes a `DamagedFileError`: truncated, not the format its name says, an unknown
architecture, or a pickle that is not plain tensors (refused: loading it could run code).

`check_model_folder` checks a model directory before it loads (config, every JSON file,
every weights file); `check_finite_weights` checks a loaded model once, cheaply, for NaN or
infinite weights; `require_finite` refuses a result (an evaluation, a statistic) holding one.
"""

from __future__ import annotations

import json
import math
import pickle
import re
import struct
import warnings
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import CONFIG_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING

from .errors import RecurformerError

# bytes per element of each safetensors dtype (the packed sub-byte ones are left out: their
# sizes are not whole bytes, and only the offsets are checked for them)
SAFETENSORS_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
                      "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}


class DamagedFileError(RecurformerError, ValueError):
    """A file a command reads is missing, truncated, not in the format its name says, or
    holds something we refuse to load."""


class NotFiniteError(RecurformerError, ValueError):
    """A weight, a statistic or a result is NaN or infinite."""


def read_json(path: str | Path, what: str = "") -> Any:
    """The parsed JSON of `path`; a one-line error if it is missing, truncated or not JSON
    (`what` names the file's role in the message: "config", "scores file", ...)."""
    path = Path(path)
    name = f"{what} {path}" if what else str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DamagedFileError(f"{name}: not found") from None
    except UnicodeDecodeError:
        raise DamagedFileError(f"{name}: not a JSON file (not UTF-8 text)") from None
    except OSError as error:
        raise DamagedFileError(f"{name}: cannot be read ({error.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        if not text.strip() or ends_open(text):
            raise DamagedFileError(f"{name}: truncated (its JSON stops after {len(text):,} characters, inside an "
                                   "unclosed object, list or string)") from None
        raise DamagedFileError(f"{name}: not valid JSON ({error.msg} at line {error.lineno}, column "
                               f"{error.colno})") from None


def ends_open(text: str) -> bool:
    """Whether `text` stops inside a JSON string, object or list: what a truncated file looks like."""
    depth, in_string, escaped = 0, False, False
    for char in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
    return in_string or depth > 0


def read_json_object(path: str | Path, what: str = "") -> dict:
    """`read_json` of a file that must hold a JSON object."""
    data = read_json(path, what)
    if not isinstance(data, dict):
        raise DamagedFileError(f"{f'{what} ' if what else ''}{path}: expected a JSON object, found {type(data).__name__}")
    return data


def check_safetensors(path: str | Path) -> dict[str, Any]:
    """The header of the safetensors file `path` (tensor name -> dtype, shape, offsets),
    checked to describe exactly the bytes the file has: a truncated file, a flipped header
    byte or another format is a one-line error."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            size = path.stat().st_size
            if size < 8:
                raise DamagedFileError(f"{path}: truncated ({size} bytes; a safetensors file starts with an 8-byte "
                                       "header length)")
            (length,) = struct.unpack("<Q", file.read(8))
            if length > size - 8:
                raise DamagedFileError(f"{path}: truncated or not a safetensors file (its header claims {length:,} "
                                       f"bytes, the file has {size:,})")
            raw = file.read(length)
    except FileNotFoundError:
        raise DamagedFileError(f"{path}: not found") from None
    except OSError as error:
        raise DamagedFileError(f"{path}: cannot be read ({error.strerror})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise DamagedFileError(f"{path}: not a safetensors file (its header is not JSON; damaged?)") from None
    if not isinstance(header, dict):
        raise DamagedFileError(f"{path}: not a safetensors file (its header is not a JSON object)")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not (isinstance(entry, dict) and isinstance(entry.get("shape"), list)
                and all(isinstance(n, int) and n >= 0 for n in entry["shape"])
                and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
                and all(isinstance(n, int) for n in entry["data_offsets"])
                and 0 <= entry["data_offsets"][0] <= entry["data_offsets"][1]):
            raise DamagedFileError(f"{path}: not a safetensors file (the header entry of {name!r} is malformed)")
        begin, stop = entry["data_offsets"]
        itemsize = SAFETENSORS_DTYPES.get(entry.get("dtype"))
        if itemsize is not None and stop - begin != math.prod(entry["shape"]) * itemsize:
            raise DamagedFileError(f"{path}: damaged (tensor {name!r} has {stop - begin:,} bytes for shape "
                                   f"{entry['shape']} of {entry.get('dtype')})")
        end = max(end, stop)
    data = size - 8 - length
    if end > data:
        raise DamagedFileError(f"{path}: truncated (its tensors need {end:,} bytes after the header, the file has "
                               f"{data:,})")
    if end < data:
        raise DamagedFileError(f"{path}: damaged ({data - end:,} bytes after the last tensor)")
    return header


def check_pickle(path: str | Path, safe_globals: Iterable[Any] = ()) -> None:
    """Check that the PyTorch file `path` loads with torch's weights-only unpickler (plain
    tensors and containers, plus `safe_globals`): a pickle that refers to anything else
    (a function it would call, a class it would build) is refused without running it."""
    path = Path(path)
    if not path.is_file():
        raise DamagedFileError(f"{path}: not found")
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(list(safe_globals)):
            warnings.simplefilter("ignore")  # torch warns about the pickle protocol of old files
            # mmap: the tensors' bytes are mapped, not read, so the check costs little
            torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL (\S+)", str(error))
        what = f" (it refers to {found.group(1)})" if found else ""
        raise DamagedFileError(f"{path}: holds a pickle that is not plain tensors{what}; refused, since loading it "
                               "could run code") from None
    except Exception as error:  # noqa: BLE001  torch's reader raises many kinds on damaged bytes
        reason = (str(error).splitlines() or [type(error).__name__])[0][:120]
        raise DamagedFileError(f"{path}: truncated or not a PyTorch file ({reason})") from None


def weight_files(directory: str | Path) -> list[Path]:
    """The weights files of a model directory: its safetensors files (through the index if
    sharded), else its PyTorch `.bin` files; a one-line error for a damaged index or a
    missing shard."""
    directory = Path(directory)
    for index, single in (("model.safetensors.index.json", "model.safetensors"),
                          ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if (directory / index).is_file():
            data = read_json_object(directory / index, "weights index")
            weight_map = data.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise DamagedFileError(f"weights index {directory / index}: has no weight_map")
            shards = [directory / name for name in sorted(set(map(str, weight_map.values())))]
            missing = [shard for shard in shards if not shard.is_file()]
            if missing:
                raise DamagedFileError(f"{missing[0]}: not found (listed in {directory / index})")
            return shards
        if (directory / single).is_file():
            return [directory / single]
    return []


def check_model_folder(directory: str | Path) -> dict:
    """The config (a dict) of the model directory `directory`, after checking what loading
    it will read: `config.json` (JSON, with the `model_type` of a causal language model that
    transformers or we know),
    every other JSON file at its top (tokenizer, generation config) and every weights file
    (the safetensors headers; `.bin` files through the weights-only unpickler)."""
    directory = Path(directory)
    config = read_json_object(directory / "config.json", "config")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise DamagedFileError(f"config {directory / 'config.json'}: has no model_type, so its architecture is unknown")
    if model_type not in CONFIG_MAPPING:
        raise DamagedFileError(f"config {directory / 'config.json'}: unknown architecture {model_type!r} (model_type); "
                               "not one this transformers knows")
    if CONFIG_MAPPING[model_type] not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise DamagedFileError(f"config {directory / 'config.json'}: a {model_type!r} model is not a causal language model")
    for path in sorted(directory.glob("*.json")):
        if path.name != "config.json":
            read_json(path)
    files = weight_files(directory)
    if not files:
        raise DamagedFileError(f"{directory}: no weights file (model.safetensors or pytorch_model.bin)")
    for path in files:
        if path.suffix == ".safetensors":
            check_safetensors(path)
        else:
            check_pickle(path)
    return config


def first_non_finite(tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, str] | None:
    """(name, "NaN" or "inf") of the first floating tensor holding a NaN or an infinity, or
    None. One sum per tensor (NaN and inf propagate through it); only a tensor whose sum is
    not finite is searched element by element (a sum can also overflow)."""
    for name, tensor in tensors:
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        if torch.isfinite(tensor.sum()):
            continue
        if torch.isnan(tensor).any():
            return name, "NaN"
        if torch.isinf(tensor).any():
            return name, "inf"
    return None


def check_finite_weights(model: torch.nn.Module, where: str | Path) -> None:
    """Refuse a loaded model with a NaN or infinite weight (it would generate garbage and
    report a NaN perplexity); `where` names its files in the message."""
    found = first_non_finite([*model.named_parameters(), *model.named_buffers()])
    if found is not None:
        raise NotFiniteError(f"{where}: weight {found[0]} holds {found[1]} values")


def non_finite_entry(value: Any, path: str = "") -> str | None:
    """The key path (`a.b[2]`) of the first NaN or infinite float in nested dicts and lists, or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else path or "the value"
    if isinstance(value, dict):
        items = ((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", item) for i, item in enumerate(value))
    else:
        return None
    return next((found for key, item in items if (found := non_finite_entry(item, key)) is not None), None)


def require_finite(value: Any, what: str) -> None:
    """Refuse a result holding NaN or inf (it would be written as a number into a JSON)."""
    found = non_finite_entry(value)
    if found is not None:
        raise NotFiniteError(f"{what}: {found} is not a finite number")
