import pytest
import torch
from tiny_models import spec_for, tiny_model, tiny_tokenizer

from recurformer import loading
from recurformer.config import ConfigError, ReplacementSpec
from recurformer.evaluate import lookup_task, make_options
from recurformer.evaluate.agreement import agreement
from recurformer.loading import save_model
from recurformer.surgery import convert

TEXT = " = A =\nThe quick brown fox jumps over the lazy dog, again and again.\n" * 40


@pytest.fixture
def setup(tmp_path):
    """(original saved to a folder, the folder, a text file, the task)."""
    original, tokenizer = tiny_model("llama"), tiny_tokenizer()
    save_model(original, tokenizer, tmp_path / "original")
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    return original, tokenizer, tmp_path / "original", data, lookup_task("agreement")[0]


def test_a_conversion_without_replaced_groups_agrees_exactly_with_its_original(setup):
    original, tokenizer, folder, data, task = setup
    empty = ReplacementSpec(original.config.num_hidden_layers, original.config.num_key_value_heads, [])
    same = convert(original, empty, source_model=str(folder))
    result = task.evaluate(same, tokenizer, make_options(task, {"data": [str(data), str(data)], "context": 64,
                                                                "max_tokens": 200}))
    assert 0.0 <= result["kl"] <= 1e-6 and result["top1_agreement"] == 1.0  # a KL is never negative, rounding aside
    assert result["tokens"] == 2 * 3 * 64 and len(result["files"]) == 2


def test_a_replaced_half_disagrees_with_its_original(setup):
    original = setup[0]
    windows = torch.randint(0, 97, (2, 64))
    changed = convert(original, spec_for(original, 0.5), init="random")
    result = agreement(changed, original, windows, progress=False)
    assert result["kl"] > 1e-3 and result["top1_agreement"] < 1.0 and result["tokens"] == 128


def test_the_model_must_be_converted_and_the_reference_original(setup, tmp_path):
    original, tokenizer, folder, data, task = setup
    options = make_options(task, {"data": [str(data)], "context": 64})
    with pytest.raises(ConfigError, match="not converted"):
        task.evaluate(original, tokenizer, options)
    converted = convert(original, spec_for(original, 0.5), init="random", source_model=str(folder))
    save_model(converted, tokenizer, tmp_path / "converted")
    with pytest.raises(ConfigError, match="is a converted model"):
        task.evaluate(converted, tokenizer, make_options(task, {"data": [str(data)], "context": 64,
                                                                "reference": str(tmp_path / "converted")}))


def test_a_given_original_is_not_loaded_again(setup, monkeypatch):
    original, tokenizer, folder, data, task = setup
    converted = convert(original, spec_for(original, 0.5), source_model=str(folder))
    options = make_options(task, {"data": [str(data)], "context": 64, "max_tokens": 128})
    alone = task.measure(converted, tokenizer, options)  # loads the original it records

    def never(*args, **kwargs):
        raise AssertionError("the original was loaded a second time")

    monkeypatch.setattr(loading, "load_model", never)
    given = task.measure(converted, tokenizer, options, original=original)
    assert given["kl"] == pytest.approx(alone["kl"], rel=1e-6) and given["top1_agreement"] == alone["top1_agreement"]
    with pytest.raises(AssertionError, match="second time"):  # without it, it loads the original
        task.measure(converted, tokenizer, options)


def test_the_reference_reads_each_window_once_and_gives_the_same_numbers(setup):
    """A second model compared with the same reference on the same windows (the final model,
    then the window baseline, in `run`) reuses the reference's states: same numbers exactly."""
    original = setup[0]
    windows = torch.randint(0, 97, (3, 64))
    first, second = (convert(original, spec_for(original, 0.5), init="random", seed=seed) for seed in (0, 1))

    def copy():  # the same weights in another module: nothing to reuse
        reference = tiny_model("llama")
        reference.load_state_dict(original.state_dict())
        return reference

    fresh = [agreement(model, copy(), windows, progress=False) for model in (first, second)]
    reference, reads = copy(), []
    hook = reference.get_decoder().register_forward_hook(lambda *args: reads.append(1))
    try:
        reused = [agreement(first, reference, windows, progress=False)]
        assert len(reads) == 3
        reused.append(agreement(second, reference, windows, progress=False))
        assert len(reads) == 3  # the reference's states were kept from the first call
        agreement(first, reference, (windows[:1] + 1) % 97, progress=False)
        assert len(reads) == 4  # a window it has not read is read
    finally:
        hook.remove()
    assert reused == fresh
