"""Text loading, tokenization and packing into fixed-length sequences.

Files are plain text (`.txt`, any other suffix) or JSON lines with a `text` field
(`.jsonl`). A text file is split into documents at WikiText-style article headings
(` = Title = `) when it has them, else it is one document. Documents are tokenized,
joined with the EOS token between them, cut into sequences of `seq_len` tokens, and
shuffled with a seed: the same inputs and seed give the same sequences on every machine.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import torch
from torch import Tensor

from .errors import RecurformerError

_ARTICLE_HEADING = re.compile(r"^ = [^=].* = $")

TRAIN_CORPORA = ("wikitext-2-valid.txt", "tinyshakespeare.txt")
EVAL_CORPORA = ("wikitext-2-raw-test.txt",)
OUT_OF_DOMAIN_CORPORA = ("lee-background-news.txt",)  # evaluation only, another domain than training
DATA_ENV = "RECURFORMER_DATA"


class DataError(RecurformerError, ValueError):
    """A data file is missing, empty or malformed, or a length does not fit the model."""


def shared_corpora(names: tuple[str, ...]) -> list[str]:
    """The files `names` found in `$RECURFORMER_DATA`, else in `../shared/data` (the
    project's offline corpora, seen from the repository root)."""
    folder = Path(os.environ.get(DATA_ENV, "../shared/data"))
    return [str(folder / name) for name in names if (folder / name).is_file()]


def load_documents(paths: list[str | Path]) -> list[str]:
    """All documents of the given files, in file order."""
    if not paths:
        raise DataError("no data files given")
    documents: list[str] = []
    for path in map(Path, paths):
        if not path.is_file():
            raise DataError(f"data file not found: {path}")
        text = path.read_text(encoding="utf-8", errors="replace")
        docs = _jsonl_documents(path, text) if path.suffix == ".jsonl" else _text_documents(text)
        docs = [d for d in docs if d.strip()]
        if not docs:
            raise DataError(f"data file is empty: {path}")
        documents.extend(docs)
    return documents


def _text_documents(text: str) -> list[str]:
    docs, current = [], []
    for line in text.splitlines(keepends=True):
        if _ARTICLE_HEADING.match(line.rstrip("\n")) and current:
            docs.append("".join(current))
            current = []
        current.append(line)
    docs.append("".join(current))
    return docs


def _jsonl_documents(path: Path, text: str) -> list[str]:
    docs = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}:{number}: not valid JSON ({error.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f"{path}:{number}: expected an object with a string 'text' field")
        docs.append(record["text"])
    return docs


def tokenize_documents(tokenizer, documents: list[str]) -> list[int]:
    """Token ids of all documents joined by EOS (no BOS/special tokens inside documents)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no EOS token to separate documents")
    ids: list[int] = []
    # Whole documents exceed the model's length on purpose (they are packed afterwards):
    # verbose=False silences the tokenizer's warning about it.
    for encoded in tokenizer(documents, add_special_tokens=False, verbose=False)["input_ids"]:
        ids.extend(encoded)
        ids.append(eos)
    return ids


def pack(ids: list[int], seq_len: int) -> Tensor:
    """Cut a token stream into `[N, seq_len]` sequences; the incomplete tail is dropped."""
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")
    count = len(ids) // seq_len
    if count == 0:
        raise DataError(f"the data has {len(ids)} tokens, fewer than one sequence of {seq_len}")
    return torch.tensor(ids[: count * seq_len], dtype=torch.long).view(count, seq_len)


def check_length(seq_len: int, config) -> None:
    """Refuse sequences longer than the model's position range."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        raise DataError(f"seq_len {seq_len} is longer than the model allows ({limit} positions)")


def token_sequences(
    tokenizer,
    documents: list[str],
    seq_len: int,
    num_sequences: int | None = None,
    seed: int = 0,
) -> Tensor:
    """`[N, seq_len]` token sequences from the documents, shuffled with `seed`; the first
    `num_sequences` of them if given (an error if there are fewer)."""
    sequences = pack(tokenize_documents(tokenizer, documents), seq_len)
    order = list(range(len(sequences)))
    random.Random(seed).shuffle(order)
    if num_sequences is not None:
        if num_sequences > len(order):
            raise DataError(f"asked for {num_sequences} sequences of {seq_len} tokens, the data has {len(order)}")
        order = order[:num_sequences]
    return sequences[order]
