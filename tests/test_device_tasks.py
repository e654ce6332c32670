"""The evaluation tasks and the head analysis give on a GPU what they give on the CPU: each
runs on a tiny model on the CPU, then again with the model moved to the `device` fixture's
device (the `cuda` parameter is skipped without a GPU)."""

import pytest
import torch
from test_evaluate import TOY_TASK, TOY_TASKS
from test_ruler import ASCII, TEXT
from test_scoring import CALIBRATION
from test_scoring import TEXT as CALIBRATION_TEXT
from tiny_models import MIXERS, open_gates, spec_for, tiny_model, tiny_tokenizer

from recurformer import retrieval_probe
from recurformer.equal_cache import mixer_state_bytes
from recurformer.evaluate import TASKS, make_options, mqar
from recurformer.run.stages import analyze_heads
from recurformer.scoring import AnalysisConfig, HeadScores, SelectionConfig
from recurformer.surgery import convert
from recurformer.tasks import stream as stream_task

# Each task's options at tiny sizes (`data`, for the tasks that read text, is added).
OPTIONS = {
    "agreement": {"context": 64, "max_tokens": 128},
    "hashhop": {"problems": 2, "context": 300, "hops": 1},
    "mqar": {"problems": 4, "context": 48, "kv_pairs": 4, "batch_size": 2},
    "passkey": {"context": 500, "depths": (0.5,), "problems": 2},
    "ppl": {"context": 64, "max_tokens": 256, "batch_size": 2},
    "ppl-by-distance": {"context": 64, "sequences": 2},
    "ruler": {"context": 480, "tasks": "niah_single_1", "problems": 2},
    "shared-context": {"context": 400, "contexts": 1, "needles": 1},
    "stream": {"tokens": 500, "streams": 1, "chunk": 32, "kinds": "set,count", "gap": 20, "press": "tova",
               "budget": 0.5},
}


def assert_same(got, expected, where: str = "result") -> None:
    """`got` equals `expected`, floats within 1e-4 relative, through nested dicts and lists."""
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for key in expected:
            assert_same(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, f"{where}[{i}]")
    elif isinstance(expected, float):
        assert got == pytest.approx(expected, rel=1e-4), where
    else:
        assert got == expected, where


def assert_same_on(device: torch.device, models: list, measure) -> None:
    """`measure()` gives the same with `models` moved from the CPU to `device`."""
    expected = measure()
    for model in models:
        model.to(device)
    assert_same(measure(), expected)


def converted_pair():
    """(a tiny original, its conversion with half its groups windowed + Mamba-2, gates open)."""
    original = tiny_model("llama")
    converted = convert(original, spec_for(original, 0.5), MIXERS["window+mamba2"], init="random")
    return original, open_gates(converted).eval()


def test_every_task_is_checked():
    assert set(OPTIONS) | {"lm-eval"} == set(TASKS)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_each_task_gives_on_the_device_what_it_gives_on_the_cpu(name, device, tmp_path, monkeypatch):
    # MQAR's words: the tiny tokenizer has too few; a CPU tensor, as `word_pool` returns
    monkeypatch.setattr(mqar, "word_pool", lambda tokenizer, size: torch.arange(size) % 97)
    # the stream's words: the tiny tokenizer writes none as one token; several tokens each serve here
    monkeypatch.setattr(stream_task, "single_token_words", lambda tokenizer, words: words)
    task, (original, converted), tokenizer = TASKS[name], converted_pair(), tiny_tokenizer(alphabet=ASCII)
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    given = {**OPTIONS[name], **({"data": [str(data)]} if "data" in task.option_names() else {})}
    options = make_options(task, given)
    assert_same_on(device, [original, converted], lambda: task.measure(converted, tokenizer, options, original))


def test_lm_eval_gives_on_the_device_what_it_gives_on_the_cpu(device, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "toy.yaml").write_text(TOY_TASK.format(data=TOY_TASKS / "recurformer_toy.jsonl"))
    task, (_, converted), tokenizer = TASKS["lm-eval"], converted_pair(), tiny_tokenizer()
    options = make_options(task, {"tasks": "recurformer_toy", "lm_eval_include": str(tmp_path), "batch_size": 2})
    assert_same_on(device, [converted], lambda: task.measure(converted, tokenizer, options))


def timeless(scores: HeadScores) -> dict:
    """The scores' record without the seconds the ablation took."""
    record = scores.to_json()
    if "ablation" in record:
        record["ablation"] = {k: v for k, v in record["ablation"].items() if not k.endswith("seconds")}
    return record


@pytest.mark.parametrize("scorer", ["recency", "ablation", "ablation-greedy", "ablation-retrieval"])
def test_the_head_analysis_gives_on_the_device_what_it_gives_on_the_cpu(scorer, device, tmp_path, monkeypatch):
    monkeypatch.setattr(retrieval_probe, "NEEDLES", 2)  # two needles fit the tiny model's positions
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()

    def scores() -> dict:
        return timeless(analyze_heads(model, tokenizer, [CALIBRATION_TEXT], AnalysisConfig(sequences=1, seq_len=64),
                                      SelectionConfig(scorer=scorer), CALIBRATION, "tiny", [],
                                      tmp_path / "scores.json", tmp_path / "partial.json"))

    assert_same_on(device, [model], scores)


def test_the_state_bytes_of_a_converted_model_are_the_same_on_the_device(device):
    _, converted = converted_pair()
    assert_same_on(device, [converted], lambda: mixer_state_bytes(converted))
