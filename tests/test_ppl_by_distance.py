import pytest
import torch
from tiny_models import tiny_model, tiny_tokenizer

from recurformer.config import ConfigError
from recurformer.data import DataError
from recurformer.evaluate import lookup_task, make_options
from recurformer.evaluate.ppl_by_distance import bucket_name, buckets, loss_by_distance

TEXT = " = A =\nThe quick brown fox jumps over the lazy dog, again and again.\n" * 40


def test_buckets_cover_the_context_and_stop_at_it():
    assert [bucket_name(*b) for b in buckets(8192)] == ["0-64", "64-256", "256-1K", "1K-2K", "2K-4K", "4K-8K"]
    assert buckets(300) == [(0, 64), (64, 256), (256, 300)]
    assert [bucket_name(*b) for b in buckets(16384)][-1] == "8K-16K"


def test_bucket_losses_weighted_by_tokens_sum_to_the_direct_loss():
    model = tiny_model("llama")
    sequences = torch.randint(0, 97, (2, 300))
    result = loss_by_distance(model, sequences, progress=False)
    with torch.no_grad():
        logits = model(sequences).logits
    direct = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), sequences[:, 1:].flatten()).item()
    assert sum(b["tokens"] for b in result["buckets"]) == result["tokens"] == 2 * 299
    weighted = sum(b["nll"] * b["tokens"] for b in result["buckets"]) / result["tokens"]
    assert weighted == pytest.approx(direct, rel=1e-5)
    assert result["nll"] == pytest.approx(direct, rel=1e-5)
    assert [b["bucket"] for b in result["buckets"]] == ["0-64", "64-256", "256-300"]


def test_evaluate_reads_consecutive_sequences_of_the_text(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    task, _ = lookup_task("ppl-by-distance")
    result = task.evaluate(tiny_model("llama"), tiny_tokenizer(), make_options(task, {"data": [str(data)], "context": 100,
                                                                                       "sequences": 2}))
    assert result["sequences"] == 2 and result["tokens"] == 2 * 99 and result["buckets"][-1]["bucket"] == "64-100"


def test_a_context_beyond_the_model_or_the_text_is_a_one_line_error(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    task, _ = lookup_task("ppl-by-distance")
    with pytest.raises(ConfigError, match="--context 1024 is longer than the model allows"):
        task.evaluate(tiny_model("llama"), tiny_tokenizer(), make_options(task, {"data": [str(data)], "context": 1024}))
    with pytest.raises(DataError, match="fewer than --sequences 50"):
        task.evaluate(tiny_model("llama"), tiny_tokenizer(), make_options(task, {"data": [str(data)], "context": 500,
                                                                                 "sequences": 50}))
