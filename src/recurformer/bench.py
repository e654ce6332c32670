"""Inference cost against the original model: cache bytes, prefill time, decode speed, memory.

For each context length the models are measured one after the other in the same process
(original, converted, original, ...), on the same random prompt; with `rounds` > 1 the
whole sequence is repeated and each ratio is the median over rounds (with its range), every
round's ratio taken between measurements of that round. Decode speed is the median over
`decode_steps` single-token steps after `warmup` untimed steps. Cache bytes come from the
cache objects themselves at exactly `context` tokens. Peak memory is the highest resident
set size sampled during prefill and decode, above the level before it, after freed heap
memory has been handed back to the OS (glibc), so that it counts what this measurement
allocates rather than what an earlier one left resident.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
from transformers import DynamicCache, StaticCache

from .cache import CACHE_ARGUMENT, HybridCache
from .config import ConfigError, option, require
from .memory import PeakMemory


def parse_contexts(text: str) -> tuple[int, ...]:
    """`--context 512,2048,8192` -> (512, 2048, 8192)."""
    try:
        contexts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"--context: expected comma-separated integers, got {text!r}") from None
    require(bool(contexts) and min(contexts) >= 1, f"--context: expected positive integers, got {text!r}")
    return contexts


@dataclass(frozen=True)
class BenchConfig:
    """What `bench` measures: the contexts, the decode steps timed, the rounds."""

    contexts: tuple[int, ...] = option((512, 2048, 8192), "comma-separated context lengths", flag="--context",
                                       parse=parse_contexts)
    decode_steps: int = option(32, "timed decode steps (the median is reported)")
    rounds: int = option(1, "repeat every measurement; ratios are medians over rounds")
    budget_gib: float = option(1.0, "cache budget (GiB) for the longest-context column")

    def __post_init__(self) -> None:
        require(bool(self.contexts) and min(self.contexts) >= 1, f"--context: expected positive integers, got {self.contexts}")
        require(self.decode_steps >= 1, f"--decode-steps must be >= 1, got {self.decode_steps}")
        require(self.rounds >= 1, f"--rounds must be >= 1, got {self.rounds}")
        require(self.budget_gib > 0, f"--budget-gib must be > 0, got {self.budget_gib}")


@dataclass
class Measurement:
    model: str
    round: int
    context: int
    prefill_s: float
    decode_tokens_per_s: float
    kv_bytes: int
    kv_reserved_bytes: int
    state_bytes: int
    cache_bytes: int
    peak_memory_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def cache_bytes(cache) -> tuple[int, int, int]:
    """(K/V bytes held, K/V bytes reserved, recurrent-state bytes) of a transformers cache.

    Held: the keys and values of the tokens seen. Reserved: the memory their tensors occupy
    (each storage once): a `StaticCache` reserves its full length, a `HybridCache` its
    buffers (up to one block more than held), a `DynamicCache` about what it holds."""
    if isinstance(cache, HybridCache):
        sizes = cache.nbytes()
        return sizes["kv"], sizes["kv_reserved"], sizes["mixer_state"]
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values) if t is not None]
    seen = int(cache.get_seq_length())  # [B, H, T, D] tensors; a static cache's T is its full length
    held = sum(t.numel() * t.element_size() // t.shape[-2] * min(seen, t.shape[-2]) for t in tensors)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return held, sum(storages.values()), 0


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
    model, name: str, context: int, cache: str, decode_steps: int = 32, warmup: int = 4, seed: int = 0, round: int = 0
) -> Measurement:
    """Prefill a random prompt of `context` tokens, then decode greedily."""
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(seed))
    with PeakMemory(interval=0.002, settle=True) as memory:
        cache = new_cache(model, cache, context + warmup + decode_steps + 1)
        start = time.perf_counter()
        out = model(prompt, use_cache=True, logits_to_keep=1, **{CACHE_ARGUMENT: cache})
        prefill = time.perf_counter() - start
        kv, reserved, state = cache_bytes(cache)
        token = out.logits[:, -1:].argmax(-1)
        times = []
        for step in range(warmup + decode_steps):
            start = time.perf_counter()
            out = model(token, use_cache=True, **{CACHE_ARGUMENT: cache})
            if step >= warmup:
                times.append(time.perf_counter() - start)
            token = out.logits[:, -1:].argmax(-1)
    del cache, out
    return Measurement(name, round, context, prefill, 1.0 / statistics.median(times), kv, reserved, state, kv + state,
                       memory.growth)


def max_context(kv_bytes: int, state_bytes: int, context: int, budget_bytes: int) -> int:
    """Largest context whose cache fits `budget_bytes`: K/V grow linearly, the state is fixed."""
    per_token = kv_bytes / context
    if per_token == 0:
        return -1  # no K/V at all: any length fits once the state does
    return max(0, int((budget_bytes - state_bytes) // per_token))


def compare(
    contenders: dict[str, tuple[torch.nn.Module, str]], baselines: list[str], contexts: list[int],
    decode_steps: int = 32, budget_bytes: int = 1 << 30, rounds: int = 1, progress=None,
) -> dict:
    """Measure every `name -> (model, cache kind)` at every context, alternating, `rounds`
    times, and the ratios of every other contender to each of `baselines` (median over rounds)."""
    for model, cache in contenders.values():  # untimed: first calls pay one-time start-up costs
        measure(model, "warm-up", min(contexts), cache, decode_steps=2, warmup=1)
    rows: list[Measurement] = []
    for round in range(rounds):
        for context in contexts:
            for name, (model, cache) in contenders.items():
                if progress:
                    progress(f"{name} @ {context}" + (f" (round {round + 1}/{rounds})" if rounds > 1 else ""))
                rows.append(measure(model, name, context, cache, decode_steps, round=round))
    ratios = []
    for baseline in baselines:
        for context in contexts:
            for name in contenders:
                if name in baselines:
                    continue
                ratios.append({"model": name, "baseline": baseline, "context": context,
                               **_ratios_over_rounds(rows, name, baseline, context, rounds)})
    largest = max(contexts)
    budgets = [
        {"model": r.model, "budget_bytes": budget_bytes, "max_context": max_context(r.kv_bytes, r.state_bytes, r.context, budget_bytes)}
        for r in rows if r.context == largest and r.round == 0
    ]
    return {
        "baselines": baselines, "contexts": contexts, "decode_steps": decode_steps, "rounds": rounds,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "measurements": [r.to_dict() for r in rows], "ratios": ratios, "cache_budget": budgets,
    }


RATIOS = {  # ratio name -> the measurement field divided: contender / baseline
    "cache_bytes_ratio": "cache_bytes",
    "decode_speedup": "decode_tokens_per_s",
    "prefill_time_ratio": "prefill_s",
    "peak_memory_ratio": "peak_memory_bytes",
}


def _ratios_over_rounds(rows: list[Measurement], name: str, baseline: str, context: int, rounds: int) -> dict:
    """Each ratio's median over rounds, and its range (`<ratio>_min`, `<ratio>_max`)."""
    pick = {(r.model, r.round): r for r in rows if r.context == context}
    out = {}
    for key, field in RATIOS.items():
        values = [getattr(pick[(name, i)], field) / max(getattr(pick[(baseline, i)], field), 1e-12) for i in range(rounds)]
        out[key] = statistics.median(values)
        if rounds > 1:
            out[f"{key}_min"], out[f"{key}_max"] = min(values), max(values)
    return out


def median_measurements(result: dict) -> list[dict]:
    """One row per (model, context): each field's median over the rounds of `compare`'s result."""
    groups: dict[tuple, list[dict]] = {}
    for row in result["measurements"]:
        groups.setdefault((row["model"], row["context"]), []).append(row)
    out = []
    for (model, context), members in groups.items():
        row = {"model": model, "context": context, "rounds": len(members)}
        for field in ("prefill_s", "decode_tokens_per_s", "kv_bytes", "kv_reserved_bytes", "state_bytes", "cache_bytes", "peak_memory_bytes"):
            row[field] = statistics.median(m[field] for m in members)
        out.append(row)
    return out


def against_original(converted: dict[str, Any], original, config: BenchConfig, progress: Callable[[str], None] | None = None) -> dict:
    """`compare` the converted models (`name -> model`) with their original, which runs
    with transformers' dynamic cache (`original`) and with a static cache
    (`original+static-cache`); both are baselines."""
    limit = original.config.max_position_embeddings
    if max(config.contexts) + config.decode_steps + 8 > limit:
        raise ConfigError(f"--context {max(config.contexts)} plus decoding exceeds the model's {limit} positions")
    contenders = {"original": (original.eval(), "dynamic"), "original+static-cache": (original, "static")}
    contenders.update({name: (model.eval(), "hybrid") for name, model in converted.items()})
    return compare(contenders, ["original", "original+static-cache"], list(config.contexts), config.decode_steps,
                   budget_bytes=int(config.budget_gib * (1 << 30)), rounds=config.rounds, progress=progress)
