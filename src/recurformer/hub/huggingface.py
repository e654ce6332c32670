"""Hugging Face hub ids (`org/name`, `org/name@revision`), found in the hub's own cache or
fetched into it, as transformers resolves them.

The cache is huggingface_hub's: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
`~/.cache/huggingface/hub` (`models--org--name/{blobs,refs,snapshots}`), read from the
environment at each call so that a change after import counts. `HF_HUB_OFFLINE=1` (or
`TRANSFORMERS_OFFLINE=1`) forbids the network; `HF_TOKEN` reaches gated or private models.
A resolved id is the snapshot directory `.../snapshots/<commit>/`, which loads with
`from_pretrained` like any model directory.

[ours] A model whose snapshot is complete in the cache is used as it is, without asking the
hub whether its branch moved: one name gives the same weights in every stage of a project
(training's teacher is the model that was converted). `hf download org/name` updates it.
A model not in the cache is fetched (unless offline) with `snapshot_download`, restricted
to the files `from_pretrained` reads (`MODEL_FILES`): safetensors weights only.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id
from transformers import CONFIG_MAPPING

from ..config import SUPPORTED_ARCHITECTURES
from .pypi import say
from .registry import ModelResolutionError

REVISION_MARK = "@"  # `org/name@revision`: repo names cannot hold an `@`, revisions may hold a `/`
COMMIT = re.compile(r"[0-9a-f]{40}")
# What `from_pretrained` reads from a repository's top level; a pattern without a leading
# `*` never matches a file in a subfolder (onnx/, original/, gguf/ copies are not fetched).
MODEL_FILES = [
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
    "model-*-of-*.safetensors", "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "chat_template.*", "README.md",
]  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # either one makes a loadable tokenizer
TRUE_VALUES = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's reading of a boolean variable


@dataclass(frozen=True)
class HubModel:
    """A model on the Hugging Face hub: `repo_id` (`org/name`) at `revision` (a branch, a
    tag or a commit; None: `main`)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"{REVISION_MARK}{self.revision}" if self.revision else "")

    def fetch_hint(self) -> str:
        """The command that puts this model into the cache."""
        revision = f" --revision {self.revision}" if self.revision else ""
        return f"`hf download {self.repo_id}{revision}`"


def hub_cache() -> Path:
    """The hub cache huggingface_hub and transformers use, from the environment now
    (`HUGGINGFACE_HUB_CACHE`: huggingface_hub's older name of `HF_HUB_CACHE`)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """Whether the network is forbidden (`HF_HUB_OFFLINE` or `TRANSFORMERS_OFFLINE`)."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in TRUE_VALUES


def looks_like_hub_id(text: str) -> bool:
    """Whether `text` is written as a hub id (`org/name...`) rather than as a path: it holds
    a `/` but does not start like a path (`/`, `.`, `~`, a drive)."""
    return "/" in text and not text.startswith(("/", ".", "~", "\\")) and not Path(text).is_absolute()


def parse_hub_id(text: str) -> HubModel:
    """The `HubModel` written as `org/name` or `org/name@revision`; `ModelResolutionError`
    naming what is wrong for anything else."""
    repo_id, mark, revision = text.partition(REVISION_MARK)
    problem = None
    if repo_id.count("/") != 1:
        problem = "a Hugging Face id is org/name"
    else:
        try:
            validate_repo_id(repo_id)
        except HFValidationError as error:
            problem = str(error).splitlines()[0].rstrip(".")
    if problem is None and mark and not revision:
        problem = "empty revision after '@'"
    if problem is None and (".." in revision or revision.startswith("/") or any(c.isspace() for c in revision)):
        problem = f"bad revision {revision!r}"
    if problem:
        raise ModelResolutionError(f"{text}: no such model directory, and not a Hugging Face model id ({problem})")
    return HubModel(repo_id, revision or None)


def with_revision(model: str | os.PathLike | None, revision: str | None) -> str | None:
    """`model` at `revision` (`--revision`), written `org/name@revision`; `model` unchanged
    when no revision is given. Only a hub id takes a revision."""
    if revision is None:
        return None if model is None else os.fspath(model)
    if model is None:
        raise ModelResolutionError(f"--revision {revision}: no model id to apply it to")
    text = os.fspath(model)
    if Path(text).expanduser().exists() or not looks_like_hub_id(text):
        raise ModelResolutionError(f"--revision applies to Hugging Face ids (org/name), not to {text}")
    if REVISION_MARK in text:
        raise ModelResolutionError(f"{text} names a revision already; drop --revision {revision}")
    return f"{text}{REVISION_MARK}{revision}"


def _repo_folder(model: HubModel, cache: Path) -> Path:
    return cache / ("models--" + model.repo_id.replace("/", "--"))


def _cached_revisions(folder: Path) -> list[str]:
    refs = folder / "refs"
    return sorted(p.relative_to(refs).as_posix() for p in refs.rglob("*") if p.is_file()) if refs.is_dir() else []


def missing_files(snapshot: Path) -> list[str]:
    """What a snapshot lacks for `from_pretrained`: config, safetensors weights (every shard
    of an index), a tokenizer."""
    missing = [] if (snapshot / "config.json").is_file() else ["config.json"]
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, or not an index
            return [*missing, "a readable model.safetensors.index.json"]
        missing += [shard for shard in shards if not (snapshot / shard).is_file()]
    elif not (snapshot / "model.safetensors").is_file():
        missing.append("model.safetensors")
    if not any((snapshot / name).is_file() for name in TOKENIZER_FILES):
        missing.append(" or ".join(TOKENIZER_FILES))
    return missing


def cached_snapshot(model: HubModel) -> Path | None:
    """The snapshot directory of `model` in the hub cache, complete or not; None when the
    cache has no snapshot of that revision."""
    folder, revision = _repo_folder(model, hub_cache()), model.revision or "main"
    if COMMIT.fullmatch(revision):
        commit = revision
    elif (folder / "refs" / revision).is_file():
        commit = (folder / "refs" / revision).read_text().strip()
    else:
        return None
    snapshot = folder / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def in_cache(model: HubModel) -> bool:
    """Whether the cache holds a complete snapshot of `model` (usable offline)."""
    snapshot = cached_snapshot(model)
    return snapshot is not None and not missing_files(snapshot)


def not_cached_error(model: HubModel, why: str) -> ModelResolutionError:
    """The one-line error for a model that is not (completely) in the cache: what is missing,
    and how to get it there."""
    folder = _repo_folder(model, hub_cache())
    snapshot = cached_snapshot(model)
    if snapshot is not None:
        state = f"its snapshot in the Hugging Face cache lacks {', '.join(missing_files(snapshot))}"
    elif folder.is_dir():
        cached = ", ".join(_cached_revisions(folder)) or "none by name"
        state = f"revision {model.revision or 'main'!r} is not in the Hugging Face cache (cached: {cached})"
    else:
        state = f"not in the Hugging Face cache ({hub_cache()})"
    return ModelResolutionError(f"{model}: no such model directory, and {state}; {why}: fetch it with "
                                f"{model.fetch_hint()} where the hub is reachable, or pass a local model folder")


def check_offline(model: HubModel) -> None:
    """Refuse now, without fetching, a model that resolving would refuse: one that is not in
    the cache while the network is forbidden."""
    if hub_offline() and not in_cache(model):
        raise not_cached_error(model, "HF_HUB_OFFLINE is set")


def model_type_of(directory: Path, name: str) -> str | None:
    """`model_type` of the config.json in `directory`; a one-line error naming `name` if the
    file is not a JSON object."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelResolutionError(f"{name}: cannot read its config.json ({error})") from None
    if not isinstance(config, dict):
        raise ModelResolutionError(f"{name}: its config.json is not a JSON object")
    return config.get("model_type")


def _check_model_type(model: HubModel, snapshot: Path) -> Path:
    model_type = model_type_of(snapshot, str(model))
    if model_type not in CONFIG_MAPPING:
        # [ours] a model type transformers does not know would need the repository's own
        # code (trust_remote_code), which recurformer never runs
        raise ModelResolutionError(f"{model}: model type {model_type!r} is not one transformers knows, so it cannot "
                                   f"be loaded (recurformer converts {', '.join(SUPPORTED_ARCHITECTURES)} models)")
    return snapshot


def _download(model: HubModel, progress: bool) -> Path:
    say(progress, f"downloading {model} from the Hugging Face hub into {hub_cache()}")
    try:
        return Path(snapshot_download(model.repo_id, revision=model.revision, cache_dir=hub_cache(),
                                      allow_patterns=MODEL_FILES))
    except RevisionNotFoundError:
        raise ModelResolutionError(f"{model}: the hub has no revision {model.revision!r} of {model.repo_id}") from None
    except GatedRepoError:
        raise ModelResolutionError(f"{model}: the model is gated; accept its conditions on huggingface.co and set "
                                   "HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ModelResolutionError(f"{model}: no such model directory, and no such model on the Hugging Face hub "
                                   "(or it is private: set HF_TOKEN)") from None
    except LocalEntryNotFoundError:  # the hub did not answer and the cache has no snapshot
        raise not_cached_error(model, "the hub is unreachable") from None
    except HfHubHTTPError as error:
        raise not_cached_error(model, f"the hub answered {error.response.status_code}") from None
    except Exception as error:  # the network stack's own errors (proxy, TLS, timeouts): not a bug here
        raise not_cached_error(model, f"the download failed ({type(error).__name__})") from None


def resolve_hub_model(model: HubModel, progress: bool = True) -> Path:
    """The snapshot directory of `model`: the cached one if complete, else fetched into the
    cache (unless offline). Raises `ModelResolutionError` in one line."""
    snapshot = cached_snapshot(model)
    if snapshot is None or missing_files(snapshot):
        check_offline(model)
        snapshot = _download(model, progress)
        if missing_files(snapshot):
            raise ModelResolutionError(f"{model}: the hub's repository lacks {', '.join(missing_files(snapshot))} "
                                       "(recurformer reads config.json, safetensors weights and a tokenizer)")
    return _check_model_type(model, snapshot)


def pinned(model: HubModel) -> HubModel:
    """`model` at the commit its cached snapshot holds (itself when not cached): the name a
    converted model records, so that its teacher is found again whatever the branch does."""
    snapshot = cached_snapshot(model)
    return model if snapshot is None else HubModel(model.repo_id, snapshot.name)
