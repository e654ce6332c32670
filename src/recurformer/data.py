"""Text loading, tokenization and packing into fixed-length sequences.

Files are plain text (`.txt`, any other suffix) or JSON lines with a `text` field
(`.jsonl`). A text file is split into documents at WikiText-style article headings
(` = Title = `) when it has them, else it is one document. Documents are tokenized,
joined with the EOS token between them, cut into sequences of `seq_len` tokens, and
shuffled with a seed: the same inputs and seed give the same sequences on every machine.

Files are read lazily (`Corpus`): memory holds what a command uses, not the files. Taking
`num_sequences` sequences of a large file costs one pass that counts tokens and a second
that tokenizes only the documents the chosen sequences come from; the first `limit`
tokens (`tokenize_documents`, `count_tokens`) read no further than they need.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
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


def corpora_folder() -> Path:
    """Where the shared corpora are: `$RECURFORMER_DATA`, else `../shared/data` (the
    project's offline corpora, seen from the repository root)."""
    return Path(os.environ.get(DATA_ENV, "../shared/data"))


def not_found(path: str | Path) -> DataError:
    """The error for a data file that is not there; for a shared corpus, where it was looked for."""
    message = f"data file not found: {path}"
    if Path(path).parent == corpora_folder():
        message += (f" (the shared corpora are read from ${DATA_ENV}, else ../shared/data; or pass the file, or a "
                    "Hugging Face dataset id such as Salesforce/wikitext:wikitext-2-raw-v1:test: docs/data.md)")
    return DataError(message)


# [ours] a longer document is tokenized in pieces (`_cut`): a fast tokenizer holds about 270
# bytes per token while it works, so a piece of 1 Mi characters costs about 250 MiB
PIECE_CHARS = 2**20
BATCH_CHARS = 2**16  # text per tokenizer call (many short documents at once)


def _cut_point(text: str, limit: int) -> int | None:
    """The last position up to `limit` just after a line end that sits between two
    non-space characters, or None. [ours] Byte-level BPE tokenizers (GPT-2 style
    pre-tokenization, as SmolLM2's) give the same tokens for the two sides as for the
    whole there; a tokenizer that adds a prefix space to each text (SentencePiece) may not."""
    end = min(limit, len(text) - 1)
    while (i := text.rfind("\n", 1, end)) > 0:
        if not text[i - 1].isspace() and not text[i + 1].isspace():
            return i + 1
        end = i
    return None


def _cut(text: str) -> Iterator[str]:
    """`text` in pieces of about PIECE_CHARS, cut where `_cut_point` finds a place (up to
    four times longer pieces where it finds none, then anywhere)."""
    while len(text) > PIECE_CHARS:
        cut = _cut_point(text, PIECE_CHARS) or _cut_point(text, 4 * PIECE_CHARS) or 4 * PIECE_CHARS
        if cut >= len(text):
            break
        yield text[:cut]
        text = text[cut:]
    yield text


class Documents:
    """Documents that can be read more than once, as pieces of text: a document is one piece,
    or several (`PIECE_CHARS`) when it is huge. `lengths(tokenizer)` counts each piece's
    tokens once (the last piece of a document with its EOS) and keeps the counts."""

    def __init__(self) -> None:
        self._lengths: dict[int, tuple[Any, list[int]]] = {}

    def pieces(self) -> Iterator[tuple[str, bool]]:
        """(text, whether it ends its document), in order."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[str]:
        parts: list[str] = []
        for text, last in self.pieces():
            parts.append(text)
            if last:
                yield "".join(parts)
                parts = []

    def lengths(self, tokenizer) -> list[int]:
        """Tokens of each piece (with the EOS closing a document), counted once per tokenizer."""
        if id(tokenizer) not in self._lengths:
            counts = [len(ids) for _, ids in _piece_tokens(tokenizer, self.pieces())]
            self._lengths[id(tokenizer)] = (tokenizer, counts)  # the reference keeps the id from being reused
        return self._lengths[id(tokenizer)][1]


class DocumentList(Documents):
    """Documents held in memory (a list of strings)."""

    def __init__(self, documents: Iterable[str]):
        super().__init__()
        self.documents = list(documents)

    def pieces(self) -> Iterator[tuple[str, bool]]:
        for document in self.documents:
            parts = list(_cut(document))
            for number, part in enumerate(parts, start=1):
                yield part, number == len(parts)


class Corpus(Documents):
    """The documents of text files, read from disk each time they are needed: memory holds
    one document (or one piece of a huge one) at a time, whatever the files' size. The
    files are checked when the corpus is made (present, not empty, JSON lines valid)."""

    def __init__(self, paths: Iterable[str | Path]):
        super().__init__()
        self.paths = [Path(p) for p in paths]
        if not self.paths:
            raise DataError("no data files given")
        for path in self.paths:
            try:
                present = path.is_file()
            except OSError as error:  # a name too long for a path
                raise DataError(f"data file {str(path)[:60]}...: {error.strerror}") from None
            if not present:
                raise not_found(path)
            if not self._has_text(path):
                raise DataError(f"data file is empty: {path}")

    def _has_text(self, path: Path) -> bool:
        """Whether `path` holds a document; a JSON-lines file is read through, so that a bad
        line is found now, not in the middle of the work."""
        found = False
        for text, _ in self._file_pieces(path):
            found = found or bool(text.strip())
            if found and path.suffix != ".jsonl":
                break
        return found

    def pieces(self) -> Iterator[tuple[str, bool]]:
        for path in self.paths:
            yield from self._file_pieces(path)

    def _file_pieces(self, path: Path) -> Iterator[tuple[str, bool]]:
        try:
            with open(path, encoding="utf-8", errors="replace") as file:
                if path.suffix == ".jsonl":  # a line is a JSON record: read whole
                    yield from _jsonl_pieces(path, file)
                else:  # a line without an end is read in parts
                    yield from _text_pieces(iter(lambda: file.readline(PIECE_CHARS), ""))
        except OSError as error:
            raise DataError(f"data file {path}: cannot be read ({error.strerror})") from None


def load_documents(paths: list[str | Path]) -> Corpus:
    """All documents of the given files, in file order, read lazily (`Corpus`)."""
    return Corpus(paths)


def _text_pieces(lines: Iterable[str]) -> Iterator[tuple[str, bool]]:
    """The pieces of a text file's documents: a new document starts at each article heading
    (a blank document is skipped)."""
    current: list[str] = []
    size, begun = 0, False  # begun: pieces of the current document were handed on already

    def ending() -> Iterator[tuple[str, bool]]:
        document = "".join(current)
        if begun or document.strip():
            parts = list(_cut(document))
            for number, part in enumerate(parts, start=1):
                yield part, number == len(parts)

    for read in lines:
        for line in read.splitlines(keepends=True):  # the line ends str.splitlines knows, as a whole read would
            if _ARTICLE_HEADING.match(line.rstrip("\n")) and current:
                yield from ending()
                current, size, begun = [], 0, False
            current.append(line)
            size += len(line)
            if size >= 2 * PIECE_CHARS:  # a huge document: hand on its pieces, keep the rest
                *pieces, rest = _cut("".join(current))
                yield from ((piece, False) for piece in pieces)
                current, size, begun = [rest], len(rest), begun or bool(pieces)
    yield from ending()


def _jsonl_pieces(path: Path, lines: Iterable[str]) -> Iterator[tuple[str, bool]]:
    """The pieces of a JSON-lines file's documents, one document per line's `text` field."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}:{number}: not valid JSON ({error.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f"{path}:{number}: expected an object with a string 'text' field")
        if record["text"].strip():
            parts = list(_cut(record["text"]))
            for index, part in enumerate(parts, start=1):
                yield part, index == len(parts)


def as_documents(documents: Documents | Iterable[str]) -> Documents:
    return documents if isinstance(documents, Documents) else DocumentList(documents)


def _piece_tokens(tokenizer, pieces: Iterable[tuple[str, bool]]) -> Iterator[tuple[str, np.ndarray]]:
    """(text, token ids `[n]` int32) of each piece, the EOS after a document's last piece;
    tokenized in batches of about BATCH_CHARS."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no EOS token to separate documents")
    batch: list[tuple[str, bool]] = []
    size = 0

    def encode() -> Iterator[tuple[str, np.ndarray]]:
        # Whole documents exceed the model's length on purpose (they are packed afterwards):
        # verbose=False silences the tokenizer's warning about it.
        encoded = tokenizer([text for text, _ in batch], add_special_tokens=False, verbose=False)["input_ids"]
        for (text, last), ids in zip(batch, encoded):
            yield text, np.asarray([*ids, eos] if last else ids, dtype=np.int32)

    for piece in pieces:
        batch.append(piece)
        size += len(piece[0])
        if size >= BATCH_CHARS or len(batch) >= 256:
            yield from encode()
            batch, size = [], 0
    if batch:
        yield from encode()


def tokenize_documents(tokenizer, documents: Documents | Iterable[str], limit: int | None = None) -> list[int]:
    """Token ids of all documents joined by EOS (no BOS/special tokens inside documents);
    only the first `limit` of them if given (the rest is not read)."""
    ids: list[int] = []
    for _, piece in _piece_tokens(tokenizer, as_documents(documents).pieces()):
        ids.extend(piece.tolist())
        if limit is not None and len(ids) >= limit:
            return ids[:limit]
    return ids


def count_tokens(tokenizer, documents: Documents | Iterable[str], limit: int | None = None) -> int:
    """The number of tokens `tokenize_documents` gives, without keeping them; with `limit`,
    counting stops there (the count is then at most `limit`)."""
    documents = as_documents(documents)
    if limit is None:
        return sum(documents.lengths(tokenizer))
    count = 0
    for _, piece in _piece_tokens(tokenizer, documents.pieces()):
        count += len(piece)
        if count >= limit:
            return limit
    return count


def pack(ids: list[int], seq_len: int) -> Tensor:
    """Cut a token stream into `[N, seq_len]` sequences; the incomplete tail is dropped."""
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")
    count = len(ids) // seq_len
    if count == 0:
        raise _fewer_than_one(len(ids), seq_len)
    return torch.tensor(ids[: count * seq_len], dtype=torch.long).view(count, seq_len)


def _fewer_than_one(total: int, seq_len: int) -> DataError:
    return DataError(f"the data has {total} tokens, fewer than one sequence of {seq_len}")


def _fewer_than_asked(num_sequences: int, seq_len: int, count: int) -> DataError:
    return DataError(f"asked for {num_sequences} sequences of {seq_len} tokens, the data has {count}")


def check_sequences(tokenizer, documents: Documents | Iterable[str], seq_len: int,
                    num_sequences: int | None = None) -> None:
    """Refuse, before any work, the data `token_sequences` would refuse (fewer tokens than one
    sequence of `seq_len`, or than `num_sequences` of them), counting no further than the
    tokens those sequences need."""
    needed = seq_len * (num_sequences or 1)
    total = count_tokens(tokenizer, documents, limit=needed)
    if total < seq_len:
        raise _fewer_than_one(total, seq_len)
    if total < needed:
        raise _fewer_than_asked(num_sequences, seq_len, total // seq_len)


def check_length(seq_len: int, config) -> None:
    """Refuse sequences longer than the model's position range."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        raise DataError(f"seq_len {seq_len} is longer than the model allows ({limit} positions)")


def token_sequences(
    tokenizer,
    documents: Documents | Iterable[str],
    seq_len: int,
    num_sequences: int | None = None,
    seed: int = 0,
) -> Tensor:
    """`[N, seq_len]` token sequences from the documents, shuffled with `seed`; the first
    `num_sequences` of them if given (an error if there are fewer).

    The same sequences as `pack(tokenize_documents(...))` shuffled, in bounded memory: one
    pass counts each piece's tokens (`Documents.lengths`), a second tokenizes only the pieces
    that the chosen sequences come from, and copies them out."""
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")
    documents = as_documents(documents)
    lengths = documents.lengths(tokenizer)
    total = sum(lengths)
    count = total // seq_len
    if count == 0:
        raise _fewer_than_one(total, seq_len)
    order = list(range(count))
    random.Random(seed).shuffle(order)
    if num_sequences is not None:
        if num_sequences > count:
            raise _fewer_than_asked(num_sequences, seq_len, count)
        order = order[:num_sequences]
    return torch.from_numpy(_gather(tokenizer, documents, lengths, seq_len, order)).long()


def _gather(tokenizer, documents: Documents, lengths: list[int], seq_len: int, order: list[int]) -> np.ndarray:
    """`[len(order), seq_len]`: row r holds the tokens of sequence `order[r]` (tokens
    `[order[r] * seq_len, (order[r] + 1) * seq_len)` of the stream); only the pieces
    holding them are tokenized."""
    rows = np.empty((len(order), seq_len), dtype=np.int32)
    row_of = {index: row for row, index in enumerate(order)}

    def wanted(start: int, stop: int) -> list[int]:
        """The chosen sequences that tokens [start, stop) of the stream fall into."""
        return [i for i in range(start // seq_len, (stop - 1) // seq_len + 1) if i in row_of] if stop > start else []

    spans: deque[tuple[int, int]] = deque()  # (first token, tokens) of each piece handed to the tokenizer

    def chosen_pieces() -> Iterator[tuple[str, bool]]:
        start = 0
        for piece, length in zip(documents.pieces(), lengths):
            if wanted(start, start + length):
                spans.append((start, length))
                yield piece
            start += length

    for _, ids in _piece_tokens(tokenizer, chosen_pieces()):
        start, expected = spans.popleft()
        if len(ids) != expected:
            raise DataError("a data file changed while it was being read; run the command again")
        for index in wanted(start, start + len(ids)):
            first, last = max(start, index * seq_len), min(start + len(ids), (index + 1) * seq_len)
            rows[row_of[index], first - index * seq_len:last - index * seq_len] = ids[first - start:last - start]
    return rows
