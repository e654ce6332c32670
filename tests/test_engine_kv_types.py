"""The engine's quantized KV caches (`-ctk`/`-ctv` q8_0 and q4_0, flash attention on: a quantized
V needs it) against PyTorch's emulation of the same caches (`recurformer.kv_quant`: the blocks,
the Hadamard rotation, llama.cpp's key order), on tiny Llama models whose head size (64) the
formats block: the unconverted original (the control, through llama.cpp's own `llama`
architecture) and conversions with and without a tail, both caches quantized.

The emulation is of the cache, not of the kernels: llama.cpp's CPU flash attention also turns
the query into q8_0 blocks for its dot products with a quantized key and accumulates in F16,
which no cache format says. So the engine sits near its emulation, not on it: each model's
logits are closer to the emulation than to the unquantized model, the conversions no farther
from their emulation than 1.5 times the original is from its own, and the top token agrees at
nine positions in ten or more. Measured (max relative error over 600 positions, engine against
emulation / unquantized): q8_0 original 2.4e-2 / 3.2e-2, window+mamba2 1.1e-2 / 1.8e-2, window
2.5e-2 / 3.4e-2; q4_0 original 5.9e-2 / 0.40, window+mamba2 3.5e-2 / 0.22, window 5.7e-2 /
0.38."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_engine import LOGITS_TOOL, engine_run, relative_error
from tiny_models import MIXERS, mixed_layout, open_gates, tiny_model, tiny_tokenizer

from benchmarks.gguf_converter_shim import unknown_tokenizer_converter
from recurformer.cache import CACHE_ARGUMENT
from recurformer.export import export_command
from recurformer.stored_kv import StoredKVCache, store_kv_as
from recurformer.surgery import convert

pytestmark = pytest.mark.skipif(not LOGITS_TOOL.exists(), reason="the engine is not built (make engine)")

MODELS = ("original", "window+mamba2", "window")
PROMPT = 600  # the window cache of 256 cells (ubatches of 32) wraps twice


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """name -> (the PyTorch model, its F32 GGUF): the original and its conversions, head size 64."""
    original = tiny_model("llama", num_hidden_layers=3, hidden_size=256, intermediate_size=384, max_position_embeddings=8192)
    made = {}
    for name in MODELS:
        model = original if name == "original" else open_gates(convert(original, mixed_layout(original), MIXERS[name])).eval()
        folder = tmp_path_factory.mktemp(name.replace("+", "-"))
        model.save_pretrained(folder / "model")
        tiny_tokenizer().save_pretrained(folder / "model")
        with unknown_tokenizer_converter():
            export_command(str(folder / "model"), str(folder / "model.gguf"), "f32")
        made[name] = model, folder / "model.gguf"
    return made


def emulated(name: str, model, tokens: torch.Tensor, cache_type: str | None) -> np.ndarray:
    """PyTorch's logits `[T, V]` with the KV cache stored as `cache_type` (None: as computed)."""
    with torch.no_grad():
        if name == "original":
            cache = {CACHE_ARGUMENT: StoredKVCache(cache_type, "llama")} if cache_type else {}
            return model(tokens, **cache).logits[0].numpy()
        try:
            return store_kv_as(model, cache_type)(tokens).logits[0].numpy()
        finally:
            store_kv_as(model, None)


@pytest.mark.parametrize("cache_type", ["q8_0", "q4_0"])
def test_quantized_caches_in_the_engine_sit_by_pytorchs_emulation_as_the_originals_do(wide, cache_type, tmp_path):
    tokens = torch.randint(0, 97, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    errors = {}
    for name in MODELS:
        model, gguf = wide[name]
        engine, _, _ = engine_run(gguf, tokens[0].tolist(), 1, 32, tmp_path, "--cache-type", cache_type, "--flash")
        emulation = emulated(name, model, tokens, cache_type)
        errors[name] = relative_error(engine, emulation)
        assert errors[name] < relative_error(engine, emulated(name, model, tokens, None)), name
        assert np.mean(engine.argmax(1) == emulation.argmax(1)) >= 0.9, name
    for name in MODELS[1:]:
        assert errors[name] <= 1.5 * errors["original"], errors
