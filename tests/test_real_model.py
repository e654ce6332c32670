"""The real SmolLM2-135M end to end at small size: analyze, convert, load, generate, cache.

Marked `real_model`: fetched once through the offline route (see docs/models.md) and cached;
`make test` skips these, `make test-all` runs them.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import recurformer  # noqa: F401
from recurformer.cli import main
from recurformer.corpus_sources import shared_corpora
from recurformer.data import TRAIN_CORPORA

pytestmark = pytest.mark.real_model

DATA = shared_corpora(TRAIN_CORPORA)[0]  # found as `recurformer run` finds it


def test_analyze_convert_generate(tmp_path):
    assert main(["analyze", "smollm2-135m", "--data", DATA, "--out", str(tmp_path / "scores.json"),
                 "--sequences", "2", "--seq-len", "128", "--scorer", "recency", "--plot", str(tmp_path / "heads.png")]) == 0
    scores = json.loads((tmp_path / "scores.json").read_text())
    assert len(scores["groups"]) == 90
    assert main(["convert", "smollm2-135m", "--scores", str(tmp_path / "scores.json"), "--scorer", "recency", "--beta", "0.5",
                 "--out", str(tmp_path / "converted")]) == 0

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "converted").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "converted")
    assert len(model.spec.groups) == 45
    ids = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 8
    with torch.no_grad():
        cache = model(torch.randint(0, 1000, (1, 512)), use_cache=True).past_key_values
    # 45 of 90 groups keep their K/V: 30 layers x 3 groups x 64 x 4 bytes x 2 (K and V) per token, halved
    assert cache.nbytes()["kv"] == 512 * 30 * 3 * 64 * 4 * 2 // 2
