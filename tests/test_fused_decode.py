"""The compiled decode steps inside a model (ops/window_step for the window kinds'
mixers, ops/attention_step for the kept heads): they run when they should, give the
PyTorch path's logits and states, and follow the weights they were built from.

decode == forward, left padding, beam search and buffer addresses are checked with the
compiled steps active by the invariant tests of test_model.py (and with
RECURFORMER_KERNELS=torch for the PyTorch path)."""

import copy

import pytest
import torch
from tiny_models import MIXERS, open_gates, spec_for, tiny_model

from recurformer.attention import left_padding_starts
from recurformer.cache import CACHE_ARGUMENT, HybridCache
from recurformer.ops import kernels
from recurformer.ops.attention_step import AttentionStepKernel
from recurformer.ops.window_step import WindowStepKernel
from recurformer.surgery import convert

WINDOW_KINDS = ["window", "window+mamba2", "window+mamba", "window+linear"]


@pytest.fixture
def calls(compiled, monkeypatch):
    """Counts of the compiled steps' calls: {"window": n, "attention": n}."""
    counts = {"window": 0, "attention": 0}
    for name, cls in (("window", WindowStepKernel), ("attention", AttentionStepKernel)):
        def counted(self, *args, _call=cls.__call__, _name=name):
            counts[_name] += 1
            return _call(self, *args)

        monkeypatch.setattr(cls, "__call__", counted)
    return counts


@pytest.fixture
def torch_path(monkeypatch):
    """A function that switches the process to the PyTorch path (RECURFORMER_KERNELS=torch)."""

    def switch():
        monkeypatch.setenv(kernels.ENV, "torch")
        kernels.reset()

    yield switch
    kernels.reset()  # monkeypatch restores the environment after this


def converted_model(arch, kind, beta=0.5, seed=0):
    model = tiny_model(arch)
    return open_gates(convert(model, spec_for(model, beta, seed), MIXERS[kind], init="random"))


def decode(model, ids, prompt, mask=None):
    """Logits of a prefill of `prompt` tokens and one-token steps `[B, T, V]`, and the cache."""
    cache = HybridCache(model.config.text_config.num_hidden_layers)
    with torch.no_grad():
        kwargs = {} if mask is None else {"attention_mask": mask[:, :prompt]}
        steps = [model(ids[:, :prompt], **{CACHE_ARGUMENT: cache}, **kwargs).logits]
        for t in range(prompt, ids.shape[1]):
            kwargs = {} if mask is None else {"attention_mask": mask[:, : t + 1]}
            steps.append(model(ids[:, t : t + 1], **{CACHE_ARGUMENT: cache}, **kwargs).logits)
    return torch.cat(steps, dim=1), cache


def assert_same_caches(cache, reference):
    for layer, other in zip(cache.layers, reference.layers):
        if other.keys is not None and other.keys.dim() == 4:
            torch.testing.assert_close(layer.keys, other.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(layer.values, other.values, atol=1e-5, rtol=1e-5)
        for name, t in (other.mixer_state or {}).items():
            torch.testing.assert_close(layer.mixer_state[name], t, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("kind", WINDOW_KINDS)
def test_compiled_decode_gives_the_torch_paths_logits_and_states(arch, kind, calls, torch_path):
    """Beta 0.75: layers with kept heads and replaced ones, and layers without kept heads;
    21 tokens decoded after 9, past the 16-token window, so the ring wraps."""
    model = converted_model(arch, kind, beta=0.75)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(0))
    logits, cache = decode(model, ids, prompt=9)
    steps = ids.shape[1] - 9
    layers = model.hybrid_attentions()
    assert calls["window"] == steps * sum(a.mixer is not None for a in layers)
    assert calls["attention"] == steps * sum(a.has_attention for a in layers)
    torch_path()
    expected, expected_cache = decode(reference, ids, prompt=9)
    assert calls["window"] == steps * sum(a.mixer is not None for a in layers)  # no more calls
    assert (logits - expected).abs().max() <= 1e-4
    assert_same_caches(cache, expected_cache)


@pytest.mark.parametrize("kind", ["window", "window+mamba2"])
def test_left_padded_rows_decode_at_their_own_positions(kind, calls, torch_path):
    """With left padding both steps stay compiled: the kept heads attend from each row's
    first token, the mixer steps each row at its own ring position."""
    model = converted_model("llama", kind)
    reference = copy.deepcopy(model)
    ids = torch.randint(1, 97, (3, 30), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :7], mask[1, :18] = 0, 0
    logits, _ = decode(model, ids, prompt=20, mask=mask)
    steps, layers = ids.shape[1] - 20, model.hybrid_attentions()
    assert calls["window"] == steps * sum(a.mixer is not None for a in layers)
    assert calls["attention"] == steps * sum(a.has_attention for a in layers)
    torch_path()
    expected, _ = decode(reference, ids, prompt=20, mask=mask)
    real = mask.bool()[:, :, None].expand_as(logits)
    assert (logits - expected)[real].abs().max() <= 1e-4


def test_a_mask_that_is_not_left_padding_takes_the_torch_path(calls, torch_path):
    """A hole after a row's first token is no left padding: the kept heads' step runs in
    PyTorch with the mask, and the logits are the PyTorch path's."""
    model = converted_model("llama", "window")
    reference = copy.deepcopy(model)
    ids = torch.randint(1, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :4], mask[1, 9] = 0, 0
    logits, _ = decode(model, ids, prompt=20, mask=mask)
    assert calls["attention"] == 0 and calls["window"] > 0
    torch_path()
    expected, _ = decode(reference, ids, prompt=20, mask=mask)
    real = mask.bool()[:, :, None].expand_as(logits)
    assert (logits - expected)[real].abs().max() <= 1e-4


def test_left_padding_starts_reads_bool_and_additive_masks():
    seen = torch.tensor([[False, False, True, True], [True, True, True, True]])
    assert left_padding_starts(seen[:, None, None], 4).tolist() == [2, 0]
    additive = torch.zeros(2, 1, 1, 4).masked_fill(~seen[:, None, None], torch.finfo(torch.float32).min)
    assert left_padding_starts(additive, 4).tolist() == [2, 0]
    holed = seen.clone()
    holed[1, 2] = False
    assert left_padding_starts(holed[:, None, None], 4) is None
    assert left_padding_starts(seen[:, None, None], 5) is None  # the mask is not over the cache's tokens
    assert left_padding_starts(torch.zeros(2, 1, 1, 4, dtype=torch.bool), 4) is None  # a row that sees nothing


def test_recording_gradients_takes_the_torch_path(calls):
    model = converted_model("llama", "window+mamba2")
    cache = HybridCache(2)
    ids = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        model(ids[:, :10], **{CACHE_ARGUMENT: cache})
    out = model(ids[:, 10:11], **{CACHE_ARGUMENT: cache}).logits
    assert out.requires_grad and calls == {"window": 0, "attention": 0}
    with torch.no_grad():
        model(ids[:, 11:12], **{CACHE_ARGUMENT: cache})
    assert calls["window"] > 0 and calls["attention"] > 0


def test_the_compiled_steps_follow_the_weights(calls, torch_path):
    """Weights updated in place are read as they are; a replaced parameter and a model moved
    to another dtype get new kernels."""
    model = converted_model("llama", "window+mamba2")
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(2))
    first, _ = decode(model, ids, prompt=20)
    attention = next(a for a in model.hybrid_attentions() if a.mixer is not None and a.has_attention)
    with torch.no_grad():
        attention.mixer.gate.mul_(-2.0)
        attention.k_proj.weight.add_(0.5)
    attention.mixer.recurrent.out_proj.weight = torch.nn.Parameter(attention.mixer.recurrent.out_proj.weight * 0.5)
    changed, _ = decode(model, ids, prompt=20)
    assert (changed - first).abs().max() > 1e-2
    model_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    half, _ = decode(model_bf16, ids, prompt=20)
    torch_path()
    expected, _ = decode(copy.deepcopy(model), ids, prompt=20)
    assert (changed - expected).abs().max() <= 1e-4
    assert half.dtype == torch.bfloat16 and (half.float() - expected).abs().max() <= 0.5
