"""Atomic writes: a reader (or a resumed run) never sees a half-written file or directory.

Every result goes through here: text and JSON (`write_text_atomic`, `write_json_atomic`),
anything a library writes to a path (plots, tensors: `atomic_file`), whole directories
(`atomic_directory`, `replace_directory`) and files added to an existing directory
(`atomic_members`). No other module renames a temporary file into place.

Staging files and directories are hidden and named `.<name>.partial-<pid>-<random>` (the
pid of the process writing them), so that one killed before it could clean up (SIGKILL, a
power cut) is found and removed later by `sweep_staging`. A write that fails for lack of
room or permission is an `OutputError`, one line, and leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from .config import ConfigError

# `.<name>.partial-<pid>-...` or `.partial-<pid>-...`; older versions wrote `.<name>.partial-<8 random>`,
# `.<name>.old-<pid>` and the training loop `.checkpoint.partial` (so that their leftovers are swept too)
_STAGING = re.compile(r"^\.(?:.+\.)?partial-(?:(?P<pid>\d+)-.*|[a-z0-9_]{8})$|^\..+\.old-\d+$|^\.checkpoint\.partial$")


class OutputError(ConfigError):
    """An output cannot be written where it was asked for (no room, no permission, not a
    directory, in use by another command, or it would overwrite an input)."""


def staging_prefix(name: str) -> str:
    """The hidden prefix of a staging file or directory for `name`, carrying this process's id."""
    return f".{name}.partial-{os.getpid()}-" if name else f".partial-{os.getpid()}-"


def _writing(path: Path, error: OSError) -> OutputError:
    return OutputError(f"cannot write {path}: {error.strerror or error}")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a new empty file beside `path`; when the block ends without error it replaces
    `path`, else it is removed. Permissions are those a plain `open()` would give."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=staging_prefix(path.stem), suffix=path.suffix or ".tmp")
        os.close(fd)
    except OSError as error:
        raise _writing(path, error) from None
    tmp = Path(name)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files
        yield tmp
        os.replace(tmp, path)
    except OSError as error:
        raise _writing(path, error) from None
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
        old = path.with_name(staging_prefix(path.name) + "old")
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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=staging_prefix(path.name)))
    except OSError as error:
        raise _writing(path, error) from None
    try:
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes 0700 directories; a plain mkdir would not
        yield staging
        replace_directory(staging, path)
    except OSError as error:
        raise _writing(path, error) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def atomic_members(directory: str | Path) -> Iterator[Path]:
    """Yield a staging directory inside `directory`; when the block ends without error each
    file in it is renamed into `directory` (one atomic rename per file, other files of
    `directory`, such as logs, untouched), else it is removed."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=directory, prefix=staging_prefix("")))
    except OSError as error:
        raise _writing(directory, error) from None
    try:
        yield staging
        for item in staging.iterdir():
            os.replace(item, directory / item.name)
    except OSError as error:
        raise _writing(directory, error) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def stale_staging(entry: Path, owned: bool = False) -> bool:
    """Whether `entry` is a staging file or directory that no live writer will finish: its
    writer's process is gone, or (`owned`: the caller holds the folder's lock, so nobody else
    writes there) any staging entry."""
    match = _STAGING.match(entry.name)
    if match is None:
        return False
    pid = match.group("pid")
    return owned or pid is None or (int(pid) != os.getpid() and not psutil.pid_exists(int(pid)))


def sweep_staging(directory: str | Path, owned: bool = False, recursive: bool = False) -> list[Path]:
    """Remove the stale staging entries in `directory` (and its subdirectories, with
    `recursive`); returns what was removed. Staging entries of live processes stay, unless
    `owned` (see `stale_staging`)."""
    directory, removed = Path(directory), []
    if not directory.is_dir():
        return removed
    for entry in sorted(directory.iterdir()):
        if stale_staging(entry, owned):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
        elif recursive and entry.is_dir() and not entry.is_symlink():
            removed += sweep_staging(entry, owned, recursive)
    return removed
