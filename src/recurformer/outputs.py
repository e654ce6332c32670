"""Where a command writes: checked before the work, marked as the command's, and held while
the command writes it.

- `check_output`: before any long work, `--out` is not an input nor inside one (nor, when
  it will be replaced, holding one), the folder it goes into exists or can be made, can be
  written, and has room for what the command will write.
- A folder a command makes carries a marker, `.recurformer-output.json`, naming the command
  (`mark`, `made_by`). `--force` removes only a folder whose marker names the same command.
- `claim_folder`: a folder that a command writes into over a long time (`run`, `train`) is
  locked (`.recurformer.lock`, `filelock`, not waiting: a second command is refused with one
  line), its stale staging entries are swept (`files.sweep_staging`), and it is marked.
  The claim is released when the command ends; a folder it made and left empty goes too.

The lock belongs to the process: a second claim of the same folder by the same process
(a test, a notebook re-running a pipeline) shares it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from filelock import FileLock, Timeout

from .checks import DamagedFileError, read_json_object
from .files import OutputError, staging_prefix, sweep_staging, write_json_atomic

MARKER = ".recurformer-output.json"
LOCK = ".recurformer.lock"

_HELD: dict[Path, list] = {}  # folder -> [FileLock, claims of this process]


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def shown(path: str | Path) -> str:
    """`path` for a one-line message: a very long one is cut."""
    text = str(path)
    return text if len(text) <= 80 else f"{text[:60]}...({len(text)} characters)"


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"


def check_output(out: str | Path, inputs: Iterable[str | Path] = (), need_bytes: int = 0, folder: bool = True,
                 replaced: bool = False, beside: bool = False, flag: str = "--out") -> None:
    """Refuse, before any work, an output `out` (a folder, or a file if not `folder`) that
    is one of `inputs` or inside one, that holds one while it is to be `replaced`, that is
    a file where a folder is due (or the reverse), or whose folder cannot be written or has
    less than `need_bytes` free. A folder is written inside when it exists, unless it is
    staged `beside` it and renamed into place (then its parent is written)."""
    out = Path(out)
    name = shown(out)
    try:
        target = out.resolve()
        if target.exists() and target.is_dir() != folder:
            raise OutputError(f"{flag} {name} is {'a file' if folder else 'a directory'}; expected "
                              f"{'a directory' if folder else 'a file'}")
        for given in inputs:
            source = Path(given).resolve()
            if target == source or source in target.parents:
                where = "is" if target == source else "is inside"
                raise OutputError(f"{flag} {name} {where} the input {given}; writing there would change the input, "
                                  "so choose another place")
            if replaced and target in source.parents:
                raise OutputError(f"{flag} {name} holds the input {given}; replacing it would delete the input")
        # a folder that exists is written inside; otherwise the nearest existing folder above gets it
        where = target if folder and target.is_dir() and not beside else _nearest_existing(target.parent)
        if not where.is_dir():
            raise OutputError(f"{flag} {name}: {where} is not a directory")
        fd, probe = tempfile.mkstemp(dir=where, prefix=staging_prefix("probe"))
        os.close(fd)
        os.unlink(probe)
        free = shutil.disk_usage(where).free
    except OSError as error:
        if isinstance(error, OutputError):
            raise
        raise OutputError(f"{flag} {name}: cannot write there ({error.strerror or error})") from None
    if free < need_bytes:
        raise OutputError(f"{flag} {name}: not enough room in {where}: the command writes about {_gib(need_bytes)}, "
                          f"{_gib(free)} are free")


def size_of(folder: str | Path) -> int:
    """Bytes of the files under `folder` (0 if there is none): what a resumed command has
    written already, and need not find room for again."""
    folder = Path(folder)
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def made_by(folder: str | Path) -> str | None:
    """The command named by the marker of `folder`, or None (no marker, or a damaged one)."""
    marker = Path(folder) / MARKER
    if not marker.is_file():
        return None
    try:
        command = read_json_object(marker).get("command")
    except DamagedFileError:
        return None
    return command if isinstance(command, str) else None


def mark(folder: str | Path, command: str) -> None:
    """Mark `folder` as made by `command`."""
    write_json_atomic(Path(folder) / MARKER, {"command": command})


def _contents(folder: Path) -> list[Path]:
    """What `folder` holds besides our marker and lock."""
    return [p for p in folder.iterdir() if p.name not in (MARKER, LOCK)]


def check_replaceable(out: str | Path, command: str, force: bool, hint: str = "use --force to replace it") -> None:
    """Refuse to replace the non-empty folder `out` unless `force` is given and its marker
    says `command` made it: `--force` never removes anything else."""
    out = Path(out)
    if not out.is_dir() or not _contents(out):
        return
    if not force:
        raise OutputError(f"output directory {out} exists and is not empty ({hint})")
    if made_by(out) != command:
        raise OutputError(f"not removing {out} with --force: it was not made by recurformer {command} (it has no "
                          f"{MARKER} naming {command}); use another --out, or empty it yourself")


class Claim:
    """An output folder held by this process: locked against other commands, marked as its
    command's. `release()` (or the end of a `with` block) lets it go; after a failure, a
    folder that the claim made and that holds nothing but what claiming wrote (`written`:
    names of files, such as a run's settings) is removed: a command that failed in its
    checks leaves nothing behind."""

    def __init__(self, folder: Path, created: bool):
        self.folder, self.created, self.released = folder, created, False
        self.written: set[str] = set()  # files the claimant wrote as part of claiming (run.json)

    def release(self, failed: bool = False) -> None:
        if self.released:
            return
        self.released = True
        held = _HELD.get(self.folder)
        if held is not None:
            held[1] -= 1
            if held[1] == 0:
                held[0].release()
                del _HELD[self.folder]
        if failed and self.created and self.folder.is_dir() and {p.name for p in _contents(self.folder)} <= self.written:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "Claim":
        return self

    def __exit__(self, kind, error, trace) -> None:
        self.release(failed=kind is not None)


def _lock(folder: Path) -> None:
    key = folder.resolve()
    if key in _HELD:
        _HELD[key][1] += 1
        return
    lock = FileLock(folder / LOCK)
    try:
        lock.acquire(blocking=False)
    except Timeout:
        raise OutputError(f"{folder} is being written by another recurformer command (it holds {folder / LOCK}); "
                          "wait for it to finish, or use another --out") from None
    except OSError as error:
        raise OutputError(f"cannot lock {folder / LOCK} ({error.strerror or error})") from None
    _HELD[key] = [lock, 1]


def _refusal(out: Path, command: str, keep: bool, replace: bool, ours: bool, hint: str) -> str | None:
    """Why `claim_folder` must refuse `out`, or None."""
    if not out.is_dir() or not _contents(out):
        return None
    if made_by(out) != command and not ours:
        if replace:
            return (f"not removing {out} with --force: it was not made by recurformer {command} (it has no {MARKER} "
                    f"naming {command}); use another --out, or empty it yourself")
        return f"output directory {out} exists and is not a {command} directory; use another --out"
    if not keep and not replace:
        return f"output directory {out} exists and is not empty ({hint})"
    return None


def check_claim(out: str | Path, command: str, *, keep: bool = False, replace: bool = False, ours: bool = False,
                hint: str = "use --force to start over") -> None:
    """Refuse, without touching it, a folder `claim_folder` would refuse (same arguments)."""
    refusal = _refusal(Path(out), command, keep, replace, ours, hint)
    if refusal:
        raise OutputError(refusal)


def claim_folder(out: str | Path, command: str, *, keep: bool = False, replace: bool = False, ours: bool = False,
                 hint: str = "use --force to start over") -> Claim:
    """Hold the folder `out` for `command`: make it if needed, lock it (a second command is
    refused), sweep its stale staging entries, and mark it. A non-empty folder is continued
    (`keep`) or emptied (`replace`, i.e. `--force`) only if its marker names `command` (or
    `ours`: the caller recognizes it as `command`'s, e.g. from before markers existed);
    else it is refused and left untouched (no lock file is put into it)."""
    out = Path(out)
    check_claim(out, command, keep=keep, replace=replace, ours=ours, hint=hint)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputError(f"cannot make {out} ({error.strerror or error})") from None
    _lock(out)
    claim = Claim(out.resolve(), created)
    try:
        sweep_staging(out, owned=True, recursive=True)
        refusal = _refusal(out, command, keep, replace, ours, hint)  # again, now that no other command can write
        if refusal:
            raise OutputError(refusal)
        if replace:
            for entry in _contents(out):
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        if made_by(out) != command:
            mark(out, command)
    except BaseException:
        claim.release(failed=True)
        raise
    return claim
