"""A Hugging Face hub cache laid out in a temporary directory, offline, in huggingface_hub's
own layout (https://huggingface.co/docs/huggingface_hub/guides/manage-cache):

    <cache>/models--<org>--<name>/
        blobs/<hash>                      file contents: sha256 for LFS files (weights), the git blob sha1 for others
        refs/<revision>                   the commit a branch or tag points at (no newline)
        snapshots/<commit>/<file>         relative symlinks to ../../blobs/<hash>

The hashes come from huggingface_hub's own functions; `check_layout` has huggingface_hub's
cache scanner read the result back.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from huggingface_hub import scan_cache_dir
from huggingface_hub.utils.sha import git_hash, sha_fileobj

LFS_SUFFIXES = (".safetensors", ".bin")


def blob_hash(path: Path) -> str:
    if path.suffix in LFS_SUFFIXES:
        with open(path, "rb") as handle:
            return sha_fileobj(handle).hex()
    return git_hash(path.read_bytes())


def cache_folder(cache: Path, repo_id: str, files: Path, revision: str = "main", skip: tuple[str, ...] = ()) -> Path:
    """Put the files of the folder `files` into `cache` as the commit of `repo_id` that
    `revision` (a branch name) points at; returns the snapshot directory. `skip`: file
    names left out (an incomplete download)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    kept = sorted(p for p in files.iterdir() if p.is_file() and p.name not in skip)
    hashes = {p.name: blob_hash(p) for p in kept}
    commit = hashlib.sha1("".join(f"{n}:{h}\n" for n, h in hashes.items()).encode() + repo_id.encode()).hexdigest()
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in kept:
        blob = repo / "blobs" / hashes[path.name]
        if not blob.exists():
            shutil.copyfile(path, blob)
        if not (snapshot / path.name).is_symlink():  # the same files make the same commit
            (snapshot / path.name).symlink_to(Path("..") / ".." / "blobs" / hashes[path.name])
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot


def check_layout(cache: Path) -> dict[str, set[str]]:
    """{repo id: its cached revisions' commits} as huggingface_hub's scanner reads `cache`;
    fails on any layout it reports as corrupted."""
    info = scan_cache_dir(cache)
    assert not info.warnings, info.warnings
    return {repo.repo_id: {r.commit_hash for r in repo.revisions} for repo in info.repos}
