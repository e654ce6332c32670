"""Where a model runs and in which dtype: `--device` and `--precision`, resolved once.

`auto` picks a CUDA GPU when one is present, else the CPU; `--precision auto` picks
bfloat16 on a GPU that has it, else float32 (the CPU's results stay what they were).
Recurrent states stay fp32 whatever the model's dtype (`MixerConfig.state_dtype`,
docs/precision.md). A device or precision that cannot be had is a one-line error before any
model loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import ConfigError, option, require

DEVICE_HELP = "auto (a CUDA GPU when present, else the CPU) | cpu | cuda | cuda:N"
PRECISIONS = ("auto", "float32", "bfloat16", "float16")


def resolve_device(choice: str) -> torch.device:
    """`auto`, `cpu`, `cuda` or `cuda:N` -> the torch device; ConfigError (one line) for an
    unknown name or a GPU that is not there."""
    require(isinstance(choice, str) and (choice in ("auto", "cpu") or re.fullmatch(r"cuda(:\d+)?", choice) is not None),
            f"--device: unknown {choice!r}; choose {DEVICE_HELP}")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cpu":
        return torch.device("cpu")
    require(torch.cuda.is_available(), f"--device {choice}: no CUDA GPU is available here (torch "
            f"{torch.__version__} sees none); use --device cpu")
    device = torch.device(choice)
    require(device.index is None or device.index < torch.cuda.device_count(),
            f"--device {choice}: there are {torch.cuda.device_count()} CUDA GPU(s), numbered from 0")
    return device


def resolve_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype weights and activations run in on `device`: `auto` is bfloat16 on a GPU
    that supports it, else float32; bfloat16 asked for on a GPU without it is an error."""
    require(precision in PRECISIONS, f"--precision: unknown {precision!r}; choose one of {', '.join(PRECISIONS)}")
    on_gpu = device.type == "cuda"
    bf16 = on_gpu and torch.cuda.is_bf16_supported()
    if precision == "auto":
        return torch.bfloat16 if bf16 else torch.float32
    if precision == "bfloat16" and on_gpu and not bf16:
        raise ConfigError(f"--precision bfloat16: the GPU {torch.cuda.get_device_name(device)} has no bfloat16; use "
                          "float16 or float32")
    return getattr(torch, precision)


@dataclass(frozen=True)
class Placement:
    """The `--device` and `--precision` of a command that runs a model."""

    device: str = option("auto", DEVICE_HELP)
    precision: str = option("auto", "dtype of the weights and activations: auto (bfloat16 on a GPU that has it, "
                            "else float32) | " + " | ".join(PRECISIONS[1:]))

    def __post_init__(self) -> None:
        resolve_dtype(self.precision, resolve_device(self.device))  # both checked before any work

    @property
    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.precision, self.torch_device)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of `model`'s first parameter (where its inputs must be)."""
    return next(model.parameters()).device


def to_model(model: torch.nn.Module, *tensors: Tensor) -> tuple[Tensor, ...]:
    """`tensors` moved to `model`'s device."""
    device = model_device(model)
    return tuple(t.to(device) for t in tensors)


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on `device` (a GPU runs asynchronously; the CPU needs nothing)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def describe(device: torch.device | str) -> str:
    """`cpu`, or the GPU's name (`cuda: NVIDIA H100 80GB HBM3`): what a result was measured on."""
    device = torch.device(device)
    return f"cuda: {torch.cuda.get_device_name(device)}" if device.type == "cuda" else device.type
