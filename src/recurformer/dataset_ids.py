"""Text named by a Hugging Face dataset id, as a model is named by its hub id.

`--data`, `--eval-data` and `--ood-data` take a file or a dataset id
`org/name[:config[:split]]` (`Salesforce/wikitext:wikitext-2-raw-v1:test`). An id is resolved
with the `datasets` library and its cache, as transformers resolves a model: found in the cache
(offline too), else fetched where the hub is reachable, else a one-line error naming the id.
[ours] Its text column is written once into a text file of recurformer's cache
(`~/.cache/recurformer/datasets/`, one row a line), so that every command, and the record of a
run, reads files as it reads the shared corpora (docs/data.md).
"""

from __future__ import annotations

import re
from pathlib import Path

from .data import DataError
from .files import write_text_atomic
from .hub import cache_root

DATASET_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(?::[\w.-]+){0,2}")
TEXT_COLUMN = "text"


def is_dataset_id(spec: str) -> bool:
    """Whether `spec` names a dataset (`org/name[:config[:split]]`) rather than a file that exists."""
    return DATASET_ID.fullmatch(spec) is not None and not Path(spec).exists()


def dataset_file(spec: str) -> Path:
    """Where the text of dataset id `spec` is kept once resolved."""
    name, config, split = parse_dataset_id(spec)
    return cache_root() / "datasets" / f"{name.replace('/', '--')}--{config or 'default'}--{split}.txt"


def parse_dataset_id(spec: str) -> tuple[str, str | None, str]:
    """'org/name:config:split' -> ('org/name', 'config', 'split'); the split defaults to train."""
    name, config, split = (spec.split(":") + [None, None])[:3]
    return name, config or None, split or "train"


def text_file(spec: str) -> str:
    """`spec` itself if it is not a dataset id, else the path of a local text file with the
    dataset's text, written from the `datasets` cache on first use."""
    if not is_dataset_id(spec):
        return spec
    out = dataset_file(spec)
    if not out.is_file():
        rows = _dataset_rows(spec)
        write_text_atomic(out, "".join(row if row.endswith("\n") else row + "\n" for row in rows))
    return str(out)


def _dataset_rows(spec: str) -> list[str]:
    try:  # an optional dependency, and a slow import: only when an id is given
        import datasets
    except ImportError:
        raise DataError(f"{spec}: reading a dataset by id needs the datasets package: "
                        "pip install 'recurformer[datasets]'") from None
    name, config, split = parse_dataset_id(spec)
    datasets.disable_progress_bars()
    try:
        data = datasets.load_dataset(name, config, split=split)
    except Exception as error:  # noqa: BLE001 - datasets raises many kinds (connection, not found, bad config)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(f"{spec}: not in the datasets cache and not fetched ({reason}); pass a text file instead, "
                        "or fetch the dataset where the hub is reachable") from None
    if TEXT_COLUMN not in data.column_names:
        raise DataError(f"{spec}: has no {TEXT_COLUMN!r} column (columns: {', '.join(data.column_names)})")
    return list(data[TEXT_COLUMN])
