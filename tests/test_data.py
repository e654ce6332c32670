import json

import pytest
import torch

from recurformer.data import DataError, check_length, load_documents, pack, token_sequences


class WordTokenizer:
    """A tiny whitespace tokenizer with the HF call signature used by data.py."""

    eos_token_id = 0

    def __call__(self, texts, add_special_tokens=False, verbose=True):
        return {"input_ids": [[1 + len(word) for word in text.split()] for text in texts]}


def test_wikitext_headings_split_documents(tmp_path):
    path = tmp_path / "wiki.txt"
    path.write_text(" = First = \n\n one two \n = = Sub = = \n three \n = Second = \n four five six \n")
    docs = list(load_documents([path]))
    assert len(docs) == 2
    assert docs[0].startswith(" = First = ") and "Sub" in docs[0]


def test_jsonl_text_field(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "a b"}) + "\n\n" + json.dumps({"text": "c"}) + "\n")
    assert list(load_documents([path])) == ["a b", "c"]
    path.write_text('{"content": "x"}\n')
    with pytest.raises(DataError, match="d.jsonl:1: expected an object with a string 'text' field"):
        load_documents([path])


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="data file not found: .*nope.txt"):
        load_documents([tmp_path / "nope.txt"])
    (tmp_path / "empty.txt").write_text("\n  \n")
    with pytest.raises(DataError, match="data file is empty"):
        load_documents([tmp_path / "empty.txt"])


def test_pack_drops_the_tail_and_checks_size():
    assert pack(list(range(10)), 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(DataError, match="fewer than one sequence"):
        pack([1, 2], 4)


def test_sequences_are_deterministic_per_seed(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(" ".join("w" * (i % 7 + 1) for i in range(500)))
    a = token_sequences(WordTokenizer(), load_documents([path]), seq_len=16, seed=1)
    b = token_sequences(WordTokenizer(), load_documents([path]), seq_len=16, seed=1)
    c = token_sequences(WordTokenizer(), load_documents([path]), seq_len=16, seed=2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert sorted(map(tuple, a.tolist())) == sorted(map(tuple, c.tolist()))  # same sequences, other order
    with pytest.raises(DataError, match="asked for 999 sequences"):
        token_sequences(WordTokenizer(), load_documents([path]), seq_len=16, num_sequences=999)


def test_length_limit():
    class Config:
        max_position_embeddings = 128

    check_length(128, Config())
    with pytest.raises(DataError, match="seq_len 129 is longer than the model allows"):
        check_length(129, Config())
