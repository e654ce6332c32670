import functools
from pathlib import Path

import pytest
import torch
from tiny_models import MIXERS, open_gates, spec_for, tiny_model, tiny_tokenizer
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

from recurformer.config import ConfigError
from recurformer.evaluate import TASKS, RunSettings, lookup_task, make_options
from recurformer.evaluate.hashhop import hashhop_accuracy
from recurformer.evaluate.logits import greedy_tokens
from recurformer.evaluate.mqar import mqar_accuracy
from recurformer.evaluate.perplexity import perplexity, windows
from recurformer.metrics import BASELINE, MODELS
from recurformer.surgery import convert

TOY_TASKS = Path(__file__).parent / "data" / "lm_eval_toy"


class ZeroDecoder(torch.nn.Module):
    def forward(self, input_ids):
        return BaseModelOutput(last_hidden_state=torch.zeros(*input_ids.shape, 2))


class Uniform(torch.nn.Module):
    """Predicts the uniform distribution over `vocab` tokens at every position: zero hidden
    states through a zero head."""

    def __init__(self, vocab):
        super().__init__()
        self.decoder, self.head = ZeroDecoder(), torch.nn.Linear(2, vocab, bias=False)
        torch.nn.init.zeros_(self.head.weight)

    def get_decoder(self):
        return self.decoder

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask=None, use_cache=False, logits_to_keep=0):
        hidden = self.decoder(input_ids).last_hidden_state
        return CausalLMOutput(logits=self.head(hidden[:, -logits_to_keep:]))


@pytest.mark.parametrize("context, stride", [(64, 64), (64, 16), (1000, 1000)])
def test_uniform_model_has_perplexity_equal_to_the_vocabulary(context, stride):
    ids = torch.randint(0, 321, (500,))
    result = perplexity(Uniform(321), ids, context=context, stride=stride, progress=False)
    assert result.ppl == pytest.approx(321, rel=1e-6)


@pytest.mark.parametrize("length, context, stride", [(500, 64, 64), (500, 64, 16), (10, 4, 3), (64, 64, 64)])
def test_windows_score_each_token_at_most_once(length, context, stride):
    scored = [t for start, end, first in windows(length, context, stride) for t in range(first, end)]
    assert len(scored) == len(set(scored)) and max(scored) == length - 1
    for start, end, first in windows(length, context, stride):
        assert end - start <= context and first > start


def test_perplexity_matches_a_direct_computation():
    model = tiny_model("llama")
    ids = torch.randint(0, 97, (200,))
    with torch.no_grad():
        logits = model(ids[None]).logits[0]
    direct = torch.nn.functional.cross_entropy(logits[:-1], ids[1:]).item()
    assert perplexity(model, ids, context=200, progress=False).nll == pytest.approx(direct, rel=1e-5)


def full_logits_nll(model, ids: torch.Tensor, context: int, stride: int, batch_size: int) -> float:
    """Mean NLL as perplexity computed it before its logits were chunked: each batch's full
    `[b, T, vocab]` logits from the model's forward."""
    spans = windows(len(ids), context, stride)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for first in range(0, len(spans), batch_size):
            group = spans[first:first + batch_size]
            width = max(end - start for start, end, _ in group)
            batch, mask = torch.zeros(len(group), width, dtype=torch.long), torch.zeros(len(group), width, dtype=torch.long)
            for row, (start, end, _) in enumerate(group):
                batch[row, : end - start], mask[row, : end - start] = ids[start:end], 1
            logits = model(batch, attention_mask=mask, use_cache=False).logits
            for row, (start, end, scored) in enumerate(group):
                pred = logits[row, scored - start - 1 : end - start - 1]
                total += torch.nn.functional.cross_entropy(pred, ids[scored:end], reduction="sum").item()
                tokens += end - scored
    return total / tokens


@pytest.mark.parametrize("kind", [None, "window+mamba2"])
def test_chunked_perplexity_equals_the_full_logits(kind):
    """Logits a few positions at a time, over right-padded batches with a ragged last window,
    give the perplexity of the whole batch's logits at once."""
    model = tiny_model("llama")
    if kind is not None:
        model = open_gates(convert(model, spec_for(model, 0.5), MIXERS[kind], init="random")).eval()
    ids = torch.randint(0, 97, (263,), generator=torch.Generator().manual_seed(0))
    for context, stride, batch_size in [(64, 64, 3), (100, 37, 2), (263, 263, 1)]:
        chunked = perplexity(model, ids, context=context, stride=stride, batch_size=batch_size, progress=False, chunk=7)
        assert chunked.nll == pytest.approx(full_logits_nll(model, ids, context, stride, batch_size), rel=1e-6)


def test_hashhop_and_mqar_run_on_a_converted_model():
    model = tiny_model("llama")
    converted = convert(model, spec_for(model, 0.5), init="random")
    tokenizer = tiny_tokenizer()
    result = hashhop_accuracy(converted, tokenizer, num_problems=2, hops=1, target_tokens=300, progress=False)
    assert result["n"] == 2 and 0.0 <= result["exact_match"] <= 1.0


def test_greedy_tokens_are_the_argmax_of_the_full_logits():
    model = tiny_model("llama")
    model = open_gates(convert(model, spec_for(model, 0.5), MIXERS["window+mamba2"], init="random")).eval()
    ids = torch.randint(0, 97, (3, 41), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits.argmax(-1)
    assert torch.equal(greedy_tokens(model, ids, chunk=5), expected)


def test_mqar_scores_as_the_full_logits_do(monkeypatch):
    """The greedy guesses, computed a few positions at a time, score as the whole batch's logits."""
    from recurformer.evaluate import mqar
    from recurformer.tasks.mqar import mqar_tokens, score_mqar

    monkeypatch.setattr(mqar, "word_pool", lambda tokenizer, size: torch.arange(size) % 97)
    monkeypatch.setattr(mqar, "greedy_tokens", functools.partial(greedy_tokens, chunk=5))
    model = tiny_model("llama")
    result = mqar.mqar_accuracy(model, tiny_tokenizer(), num_examples=60, seq_len=48, num_kv_pairs=4, batch_size=7)
    data = mqar_tokens(60, 48, 4, vocab_size=64, seed=0)
    ids = data["input_ids"] % 97
    labels = torch.where(data["labels"] >= 0, data["labels"].clamp_min(0) % 97, data["labels"])
    with torch.no_grad():
        expected = score_mqar(model(ids, use_cache=False).logits, labels)
    assert {k: result[k] for k in expected} == expected and 0 < expected["accuracy"] < 1


def test_mqar_word_pool_is_reported_clearly():
    with pytest.raises(ValueError, match="plain word tokens"):
        mqar_accuracy(tiny_model("llama"), tiny_tokenizer(), num_examples=2, seq_len=64, num_kv_pairs=8)


TOY_TASK = """
task: recurformer_toy
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def test_lm_eval_adapter_runs_a_local_task(tmp_path, monkeypatch):
    """A two-choice task defined in local files: lm-eval runs without the hub."""
    pytest.importorskip("lm_eval")
    from recurformer.evaluate.lm_eval import run_lm_eval

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "toy.yaml").write_text(TOY_TASK.format(data=TOY_TASKS / "recurformer_toy.jsonl"))
    model = tiny_model("llama")
    converted = convert(model, spec_for(model, 0.5), init="random")
    result = run_lm_eval(converted, tiny_tokenizer(), "recurformer_toy", include_path=str(tmp_path), batch_size=2)
    assert 0.0 <= result["recurformer_toy/acc,none"] <= 1.0
    assert result["task"] == "lm-eval:recurformer_toy"


def test_every_task_module_registers_itself():
    assert {"ppl", "hashhop", "mqar", "lm-eval", "ppl-by-distance", "agreement", "passkey"} <= set(TASKS)
    for task in TASKS.values():
        assert task.summary and task.option_names()
        if task.run_options is not None:  # `run` uses it: its options for a full and a quick run are valid
            for quick in (False, True):
                runs = task.run_options(RunSettings(quick, ["held-out.txt"], 0, ("other.txt",)))
                assert runs and all(isinstance(options, task.options) for options in runs.values())
                for key in runs:  # each evaluation runs on models that a run has
                    assert task.models_for(key) and set(task.models_for(key)) <= {*MODELS, BASELINE}


@pytest.mark.parametrize("spec, message", [
    ("perplexity", "--task: unknown 'perplexity'; choose one of"),
    ("ppl:extra", "--task: unknown 'ppl:extra'"),
    ("lm-eval", "--task: unknown 'lm-eval'"),
])
def test_unknown_task_names_list_the_known_ones(spec, message):
    with pytest.raises(ConfigError, match=message) as error:
        lookup_task(spec)
    assert "lm-eval:<tasks>" in str(error.value) and "\n" not in str(error.value)


def test_an_option_of_another_task_is_refused():
    task, argument = lookup_task("hashhop")
    assert argument == {}
    with pytest.raises(ConfigError, match="--kv-pairs does not apply to --task hashhop"):
        make_options(task, {"kv_pairs": 4})
    assert make_options(task, {"problems": 3, "stride": None}).problems == 3  # None: not given


def test_the_argument_after_the_colon_sets_the_tasks_option():
    task, argument = lookup_task("lm-eval:hellaswag,piqa")
    assert task.name == "lm-eval" and make_options(task, argument).tasks == "hellaswag,piqa"


def test_ppl_needs_text():
    with pytest.raises(ConfigError, match="--task ppl needs --data FILE"):
        make_options(TASKS["ppl"], {})
