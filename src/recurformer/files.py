"""Atomic writes: a reader (or a resumed run) never sees a half-written file or directory.

Every result goes through here: text and JSON (`write_text_atomic`, `write_json_atomic`),
anything a library writes to a path (plots, tensors: `atomic_file`), whole directories
(`atomic_directory`, `replace_directory`) and files added to an existing directory
(`atomic_members`). No other module renames a temporary file into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a new empty file beside `path`; when the block ends without error it replaces
    `path`, else it is removed. Permissions are those a plain `open()` would give."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix or ".tmp")
    os.close(fd)
    tmp = Path(name)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=1) + "\n")


def replace_directory(staging: str | Path, path: str | Path) -> None:
    """Move the finished directory `staging` to `path`, replacing what is there: at every
    moment `path` is either the old directory or the new one (an old one is moved aside
    first, then deleted)."""
    staging, path = Path(staging), Path(path)
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(staging, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, path)


@contextmanager
def atomic_directory(path: str | Path, replace: bool = False) -> Iterator[Path]:
    """Yield an empty staging directory beside `path`; when the block ends without error it
    becomes `path`, else it is removed. An existing `path` is an error unless `replace`."""
    path = Path(path)
    if path.exists() and not replace:
        raise FileExistsError(f"{path} exists already")
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.partial-"))
    os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes 0700 directories; a plain mkdir would not
    try:
        yield staging
        replace_directory(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def atomic_members(directory: str | Path) -> Iterator[Path]:
    """Yield a staging directory inside `directory`; when the block ends without error each
    file in it is renamed into `directory` (one atomic rename per file, other files of
    `directory`, such as logs, untouched), else it is removed."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=directory, prefix=".partial-"))
    try:
        yield staging
        for item in staging.iterdir():
            os.replace(item, directory / item.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
