"""Inference cost against the original model: cache bytes, prefill time, decode speed, memory.

For each context length the models are measured one after the other in the same process
(original, converted, original, ...), on the same random prompt. Decode speed is the
median over `decode_steps` single-token steps after `warmup` untimed steps. Cache bytes
come from the cache objects themselves at exactly `context` tokens. Peak memory is the
highest resident set size sampled during prefill and decode, above the level before it.
"""

from __future__ import annotations

import gc
import statistics
import threading
import time
from dataclasses import asdict, dataclass

import psutil
import torch
from transformers import DynamicCache, StaticCache

from .cache import HybridCache


@dataclass
class Measurement:
    model: str
    context: int
    prefill_s: float
    decode_tokens_per_s: float
    kv_bytes: int
    state_bytes: int
    cache_bytes: int
    peak_memory_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


class PeakMemory:
    """Samples the process RSS in a background thread; `peak` is the maximum above the start."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.process = interval, psutil.Process()
        self.start = self.peak = 0
        self._stop = threading.Event()

    def __enter__(self) -> "PeakMemory":
        self.start = self.process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss - self.start)
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss - self.start)


def cache_bytes(cache) -> tuple[int, int]:
    """(K/V bytes, recurrent-state bytes) held by a transformers cache."""
    if isinstance(cache, HybridCache):
        sizes = cache.nbytes()
        return sizes["kv"], sizes["mixer_state"]
    kv = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)
    return kv, 0


CACHES = ("hybrid", "dynamic", "static")


def new_cache(model, kind: str, length: int):
    """`hybrid` for RecurFormer models; `dynamic` (transformers' default, grows by
    concatenation) or `static` (preallocated for `length` tokens) for original models."""
    if kind == "hybrid":
        return HybridCache(model.config.text_config.num_hidden_layers)
    if kind == "static":
        return StaticCache(config=model.config, max_cache_len=length)
    return DynamicCache(config=model.config)


@torch.no_grad()
def measure(
    model, name: str, context: int, cache: str, decode_steps: int = 32, warmup: int = 4, seed: int = 0
) -> Measurement:
    """Prefill a random prompt of `context` tokens, then decode greedily."""
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(seed))
    gc.collect()
    with PeakMemory() as memory:
        cache = new_cache(model, cache, context + warmup + decode_steps + 1)
        start = time.perf_counter()
        out = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - start
        kv, state = cache_bytes(cache)
        token = out.logits[:, -1:].argmax(-1)
        times = []
        for step in range(warmup + decode_steps):
            start = time.perf_counter()
            out = model(token, past_key_values=cache, use_cache=True)
            if step >= warmup:
                times.append(time.perf_counter() - start)
            token = out.logits[:, -1:].argmax(-1)
    del cache, out
    return Measurement(name, context, prefill, 1.0 / statistics.median(times), kv, state, kv + state, memory.peak)


def max_context(kv_bytes: int, state_bytes: int, context: int, budget_bytes: int) -> int:
    """Largest context whose cache fits `budget_bytes`: K/V grow linearly, the state is fixed."""
    per_token = kv_bytes / context
    if per_token == 0:
        return -1  # no K/V at all: any length fits once the state does
    return max(0, int((budget_bytes - state_bytes) // per_token))


def compare(
    contenders: dict[str, tuple[torch.nn.Module, str]], baselines: list[str], contexts: list[int],
    decode_steps: int = 32, budget_bytes: int = 1 << 30, progress=None,
) -> dict:
    """Measure every `name -> (model, cache kind)` at every context, alternating, and the
    ratios of every other contender to each of `baselines`."""
    for model, cache in contenders.values():  # untimed: first calls pay one-time start-up costs
        measure(model, "warm-up", min(contexts), cache, decode_steps=2, warmup=1)
    rows: list[Measurement] = []
    for context in contexts:
        for name, (model, cache) in contenders.items():
            if progress:
                progress(f"{name} @ {context}")
            rows.append(measure(model, name, context, cache, decode_steps))
    ratios = []
    for baseline in baselines:
        for context in contexts:
            base = next(r for r in rows if r.model == baseline and r.context == context)
            for row in rows:
                if row.context != context or row.model in baselines:
                    continue
                ratios.append({
                    "model": row.model, "baseline": baseline, "context": context,
                    "cache_bytes_ratio": row.cache_bytes / base.cache_bytes,
                    "decode_speedup": row.decode_tokens_per_s / base.decode_tokens_per_s,
                    "prefill_time_ratio": row.prefill_s / base.prefill_s,
                    "peak_memory_ratio": row.peak_memory_bytes / max(base.peak_memory_bytes, 1),
                })
    largest = max(contexts)
    budgets = [
        {"model": r.model, "budget_bytes": budget_bytes, "max_context": max_context(r.kv_bytes, r.state_bytes, r.context, budget_bytes)}
        for r in rows if r.context == largest
    ]
    return {
        "baselines": baselines, "contexts": contexts, "decode_steps": decode_steps,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "measurements": [r.to_dict() for r in rows], "ratios": ratios, "cache_budget": budgets,
    }
