"""Atomic file writes: a reader never sees a half-written file."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def temporary_sibling(path: Path) -> Path:
    """A new empty file beside `path` with the permissions a plain `open()` would give."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix or ".tmp")
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600 files
    return Path(tmp)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it into place."""
    path = Path(path)
    tmp = temporary_sibling(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=1) + "\n")


@contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield an empty staging directory beside `path`; on success rename it to `path`.

    A reader (or a resumed run) sees either no `path` or a complete one. On an exception
    the staging directory is removed; `path` must not exist yet.
    """
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists already")
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.partial-"))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes 0700 directories; a plain mkdir would not
    try:
        yield staging
        os.replace(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
