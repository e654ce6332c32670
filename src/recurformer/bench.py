"""Inference cost against the original model: cache bytes, prefill time, decode speed, memory.

For each context length and batch size the models are measured one after the other in the
same process (original, converted, original, ...), on the same random prompts; with
`rounds` > 1 the whole sequence is repeated and each ratio is the median over rounds (with
its range), every round's ratio taken between measurements of that round. Decode speed is
the median over `decode_steps` steps after `warmup` untimed steps, per sequence and in
total (the batch's tokens per second). Cache bytes come from the cache objects themselves
at exactly `context` tokens. Peak memory is the highest resident set size sampled during
prefill and decode, above the level before it, after freed heap memory has been handed
back to the OS (glibc), so that it counts what this measurement allocates rather than what
an earlier one left resident.

[ours] A batch of B > 1 prompts is left-padded, rows of different lengths, as requests
batched together are: row i holds `context - i * context // (2 B)` tokens, from the full
context down to a little over half of it. Every step's inputs are prepared as `generate`
prepares them (`prepare_inputs_for_generation`: position ids from the padding mask, and for
a static cache the 4-D mask of its full length, built outside the model so that a compiled
forward sees the same shapes at every step), inside the timed step.

The original's static-cache decode step can also run compiled (`BenchConfig.compile`), as
transformers' `generate` compiles it: `get_compiled_call` with the default `CompileConfig`
(torch.compile, inductor, mode `reduce-overhead`), prefill eager. The first step at a new
shape compiles; what it takes beyond an ordinary step is reported as `compile_s`, apart
from the speed, which counts only the timed steps.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor
from transformers import CompileConfig, DynamicCache, StaticCache

from .cache import CACHE_ARGUMENT, HybridCache
from .config import ConfigError, option, require
from .device import DEVICE_HELP, describe, resolve_device, resolve_dtype, synchronize
from .memory import peak_memory
from .mixers import STATE_DTYPES


def _positive_integers(flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    require(bool(values) and min(values) >= 1, f"{flag}: expected positive integers, got {text!r}")
    return values


def parse_contexts(text: str) -> tuple[int, ...]:
    """`--contexts 512,2048,8192` -> (512, 2048, 8192)."""
    return _positive_integers("--contexts", text)


def parse_batches(text: str) -> tuple[int, ...]:
    """`--batch 1,4,16` -> (1, 4, 16)."""
    return _positive_integers("--batch", text)


DTYPES = STATE_DTYPES  # the dtypes a model can be benchmarked in: float32, bfloat16, float16


def parse_dtype(text: str) -> str:
    require(text in DTYPES, f"--dtype: expected one of {', '.join(DTYPES)}, got {text!r}")
    return text


@dataclass(frozen=True)
class BenchConfig:
    """What `bench` measures: the contexts and batch sizes, the decode steps timed, the
    rounds, the dtype, and whether the original's static-cache decode also runs compiled."""

    contexts: tuple[int, ...] = option((512, 2048, 8192), "comma-separated context lengths", flag="--contexts",
                                       aliases=("--context",), metavar="C,C,...",
                                       parse=parse_contexts)
    batches: tuple[int, ...] = option((1,), "comma-separated batch sizes: sequences decoded together, left-padded "
                                      "rows of different lengths (docs/benchmarks.md)", flag="--batch", parse=parse_batches)
    decode_steps: int = option(32, "timed decode steps (the median is reported)")
    rounds: int = option(1, "repeat every measurement; ratios are medians over rounds")
    budget_gib: float = option(1.0, "cache budget (GiB): the longest context (one sequence) and the largest batch "
                               "(at the longest context) whose cache fits it")
    dtype: str = option("float32", f"dtype both models are loaded in ({', '.join(DTYPES)})", parse=parse_dtype)
    device: str = option("auto", DEVICE_HELP)
    compile: bool = option(False, "also time the original's static-cache decode under torch.compile, as generate "
                           "compiles it (compile time reported apart)")
    prefill_once: bool = option(False, "prefill each model once per context and batch and decode every round from a "
                                "copy of that cache (large batches: the prefill takes minutes; peak memory not "
                                "measured)")

    def __post_init__(self) -> None:
        require(bool(self.contexts) and min(self.contexts) >= 1, f"--contexts: expected positive integers, got {self.contexts}")
        require(bool(self.batches) and min(self.batches) >= 1, f"--batch: expected positive integers, got {self.batches}")
        require(self.decode_steps >= 1, f"--decode-steps must be >= 1, got {self.decode_steps}")
        require(self.rounds >= 1, f"--rounds must be >= 1, got {self.rounds}")
        require(self.budget_gib > 0, f"--budget-gib must be > 0, got {self.budget_gib}")
        parse_dtype(self.dtype)
        resolve_dtype(self.dtype, resolve_device(self.device))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def torch_device(self) -> torch.device:
        return resolve_device(self.device)


@dataclass
class Measurement:
    model: str
    round: int
    context: int
    batch: int
    prefill_s: float
    decode_tokens_per_s: float  # per sequence: 1 / the median step
    decode_total_tokens_per_s: float  # the batch's: batch / the median step
    compile_s: float | None  # compiled contenders: the first step's time beyond an ordinary step; else None
    kv_bytes: int
    kv_reserved_bytes: int
    state_bytes: int
    cache_bytes: int
    peak_memory_bytes: int | None  # None: not measured (a shared prefill, `measure`)

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


class Contender(NamedTuple):
    """A model as benchmarked: its cache kind (`CACHES`) and whether its decode steps run
    compiled (`get_compiled_call`, as `generate` runs them)."""

    model: torch.nn.Module
    cache: str
    compiled: bool = False


def padded_prompts(vocab: int, batch: int, context: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Random token ids `[B, context]` and their mask `[B, context]` (1 = token): row i holds
    `context - i * context // (2 B)` tokens, left-padded with id 0 (see the module docstring)."""
    ids = torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(seed))
    lengths = context - torch.arange(batch) * context // (2 * batch)
    mask = (torch.arange(context)[None, :] >= context - lengths[:, None]).long()
    return ids * mask, mask


def generation_inputs(model, ids: Tensor, cache, mask: Tensor, positions: Tensor, first: bool) -> dict:
    """The keyword arguments `generate` gives the model for `ids` `[B, T]`."""
    return model.prepare_inputs_for_generation(ids, attention_mask=mask, position_ids=positions, use_cache=True,
                                               is_first_iteration=first, **{CACHE_ARGUMENT: cache})


@torch.no_grad()
def measure(
    model, name: str, context: int, cache: str, decode_steps: int = 32, warmup: int = 4, seed: int = 0, round: int = 0,
    batch: int = 1, compiled: bool = False, repeats: int = 1,
) -> list[Measurement]:
    """Prefill `batch` random prompts of `context` tokens (left-padded, see `padded_prompts`),
    then decode greedily; `compiled`: the decode steps through `get_compiled_call`.

    `repeats` > 1 prefills once and decodes `repeats` times, each time from a copy of the
    prefilled cache (rounds `round`, `round + 1`, ...): every repeat shares the one prefill
    time, and peak memory is not measured (the copy would count in it; `None`)."""
    require(not compiled or warmup >= 1, "a compiled decode needs at least one untimed step (it compiles)")
    device = model.device
    ids, mask = (t.to(device) for t in padded_prompts(model.config.get_text_config().vocab_size, batch, context, seed))
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    step_call = model.get_compiled_call(CompileConfig()) if compiled else model
    with peak_memory(device, interval=0.002, settle=True) as memory:
        prefilled = new_cache(model, cache, context + warmup + decode_steps + 1)
        synchronize(device)
        start = time.perf_counter()
        out = model(**generation_inputs(model, ids, prefilled, mask, positions, first=True), logits_to_keep=1)
        synchronize(device)
        prefill = time.perf_counter() - start
        kv, reserved, state = cache_bytes(prefilled)
        first = out.logits[:, -1:].argmax(-1)
        del out
        if repeats == 1:
            times = timed_decode(model, step_call, prefilled, first, mask, positions, warmup + decode_steps)
    if repeats == 1:
        all_times, peak = [times], memory.growth
    else:
        all_times = [timed_decode(model, step_call, copy.deepcopy(prefilled), first, mask, positions, warmup + decode_steps)
                     for _ in range(repeats)]
        peak = None
    del prefilled
    rows = []
    for offset, times in enumerate(all_times):
        step = statistics.median(times[warmup:])
        rows.append(Measurement(name, round + offset, context, batch, prefill, 1.0 / step, batch / step,
                                max(0.0, times[0] - step) if compiled else None, kv, reserved, state, kv + state, peak))
    return rows


def timed_decode(model, step_call, cache, token: Tensor, mask: Tensor, positions: Tensor, steps: int) -> list[float]:
    """Greedy decode `steps` tokens after `token` `[B, 1]` into `cache`; each step's seconds."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        positions = positions[:, -1:] + 1
        out = step_call(**generation_inputs(model, token, cache, mask, positions, first=False))
        token = out.logits[:, -1:].argmax(-1)
        synchronize(token.device)  # a GPU step is done when its token is
        times.append(time.perf_counter() - start)
    return times


WARMUP_CONTEXT = 512  # tokens of the untimed first call: long enough to touch every code path


def max_context(kv_bytes: int, state_bytes: int, context: int, budget_bytes: int) -> int:
    """Largest context whose cache fits `budget_bytes`: K/V grow linearly, the state is fixed."""
    per_token = kv_bytes / context
    if per_token == 0:
        return -1  # no K/V at all: any length fits once the state does
    return max(0, int((budget_bytes - state_bytes) // per_token))


def max_batch(bytes_per_sequence: float, budget_bytes: int) -> int:
    """Largest batch whose cache fits `budget_bytes`: K/V and state both grow with the batch."""
    return int(budget_bytes // bytes_per_sequence) if bytes_per_sequence > 0 else -1


def compare(
    contenders: dict[str, Contender | tuple], baselines: list[str], contexts: list[int],
    decode_steps: int = 32, budget_bytes: int = 1 << 30, rounds: int = 1, progress=None, batches: list[int] = (1,),
    prefill_once: bool = False,
) -> dict:
    """Measure every `name -> Contender(model, cache kind, compiled)` at every context and
    batch, alternating, `rounds` times, and the ratios of every other contender to each of
    `baselines` (median over rounds). A compiled contender whose compilation fails is left
    out, with the reason, under `skipped`. `prefill_once`: each contender prefills once per
    context and batch and decodes its `rounds` from copies of that cache, one contender after
    the other (for large batches, where the prefill takes minutes and the decode seconds)."""
    contenders = {name: Contender(*spec) for name, spec in contenders.items()}
    skipped, compile_s = [], {}
    for name, spec in list(contenders.items()):  # untimed: first calls pay one-time start-up costs (and compile)
        start = time.perf_counter()
        try:
            measure(spec.model, "warm-up", min(*contexts, WARMUP_CONTEXT), spec.cache, decode_steps=2, warmup=1,
                    batch=min(batches), compiled=spec.compiled)
        except Exception as error:  # torch.compile fails in many ways: no C++ compiler, an op it cannot trace, ...
            if not spec.compiled:
                raise
            skipped.append({"model": name, "reason": f"torch.compile failed: {_first_line(error)}"})
            del contenders[name]
            continue
        if spec.compiled:
            compile_s[name] = time.perf_counter() - start
    baselines = [b for b in baselines if b in contenders]
    rows: list[Measurement] = []
    for round in range(1 if prefill_once else rounds):
        for context in contexts:
            for batch in batches:
                for name, spec in contenders.items():
                    if progress:
                        progress(f"{name} @ {context}" + (f" x {batch}" if len(batches) > 1 else "")
                                 + (f" (round {round + 1}/{rounds})" if rounds > 1 and not prefill_once else ""))
                    rows.extend(measure(spec.model, name, context, spec.cache, decode_steps, round=round, batch=batch,
                                        compiled=spec.compiled, repeats=rounds if prefill_once else 1))
    ratios = [
        {"model": name, "baseline": baseline, "context": context, "batch": batch,
         **_ratios_over_rounds(rows, name, baseline, context, batch, rounds)}
        for baseline in baselines for batch in batches for context in contexts for name in contenders if name not in baselines
    ]
    return {
        "baselines": baselines, "contexts": contexts, "batches": list(batches), "decode_steps": decode_steps,
        "rounds": rounds, "prefill_once": prefill_once, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "dtype": str(next(iter(contenders.values())).model.dtype).removeprefix("torch."),
        "device": describe(next(iter(contenders.values())).model.device),
        "measurements": [r.to_dict() for r in rows], "ratios": ratios,
        "cache_budget": _budgets(rows, max(contexts), min(batches), budget_bytes),
        "compile_s": compile_s, "skipped": skipped,
    }


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return type(error).__name__ + (f": {lines[0]}" if lines else "")


def _budgets(rows: list[Measurement], context: int, batch: int, budget_bytes: int) -> list[dict]:
    """Per model, from its first-round measurement at `context` and `batch`: the longest
    context one sequence's cache fits in `budget_bytes`, and the largest batch at `context`."""
    out = []
    for r in rows:
        if r.context == context and r.batch == batch and r.round == 0:
            per_sequence = r.cache_bytes / r.batch
            out.append({"model": r.model, "budget_bytes": budget_bytes, "context": context,
                        "max_context": max_context(r.kv_bytes / r.batch, r.state_bytes / r.batch, context, budget_bytes),
                        "bytes_per_sequence": per_sequence, "max_batch": max_batch(per_sequence, budget_bytes)})
    return out


RATIOS = {  # ratio name -> the measurement field divided: contender / baseline
    "cache_bytes_ratio": "cache_bytes",
    "decode_speedup": "decode_tokens_per_s",  # at equal batches, also the ratio of total tokens/s
    "prefill_time_ratio": "prefill_s",
    "peak_memory_ratio": "peak_memory_bytes",
}


def _ratios_over_rounds(rows: list[Measurement], name: str, baseline: str, context: int, batch: int, rounds: int) -> dict:
    """Each ratio's median over rounds, and its range (`<ratio>_min`, `<ratio>_max`)."""
    pick = {(r.model, r.round): r for r in rows if r.context == context and r.batch == batch}
    out = {}
    for key, field in RATIOS.items():
        if getattr(pick[(name, 0)], field) is None:
            continue  # not measured (peak memory with a shared prefill)
        values = [getattr(pick[(name, i)], field) / max(getattr(pick[(baseline, i)], field), 1e-12) for i in range(rounds)]
        out[key] = statistics.median(values)
        if rounds > 1:
            out[f"{key}_min"], out[f"{key}_max"] = min(values), max(values)
    return out


MEDIAN_FIELDS = ("prefill_s", "decode_tokens_per_s", "decode_total_tokens_per_s", "kv_bytes", "kv_reserved_bytes",
                 "state_bytes", "cache_bytes", "peak_memory_bytes")


def median_measurements(result: dict) -> list[dict]:
    """One row per (model, context, batch): each field's median over the rounds of
    `compare`'s result (a bench.json written before batches counts as batch 1)."""
    groups: dict[tuple, list[dict]] = {}
    for row in result["measurements"]:
        groups.setdefault((row["model"], row["context"], row.get("batch", 1)), []).append(row)
    out = []
    for (model, context, batch), members in groups.items():
        row = {"model": model, "context": context, "batch": batch, "rounds": len(members)}
        for field in MEDIAN_FIELDS:
            if members[0].get(field) is not None:
                row[field] = statistics.median(m[field] for m in members)
        out.append(row)
    return out


BASELINES = {  # name -> how the original runs: transformers' default cache, a static cache, and compiled
    "original": ("dynamic", False),
    "original+static-cache": ("static", False),
    "original+static-cache+compiled": ("static", True),
}


def check_contexts(config: BenchConfig, model_config) -> None:
    """Refuse contexts that, with the decode steps, go beyond the positions of the model
    `model_config` (its text config) describes."""
    limit = model_config.max_position_embeddings
    if max(config.contexts) + config.decode_steps + 8 > limit:
        raise ConfigError(f"--contexts {max(config.contexts)} plus decoding exceeds the model's {limit} positions")


def against_original(converted: dict[str, Any], original, config: BenchConfig, progress: Callable[[str], None] | None = None) -> dict:
    """`compare` the converted models (`name -> model`) with their original, which runs
    with transformers' dynamic cache (`original`), with a static cache
    (`original+static-cache`) and, with `config.compile`, with a static cache and compiled
    decode steps (`original+static-cache+compiled`); all are baselines. Every model must
    be in `config.dtype`."""
    check_contexts(config, original.config)
    for name, model in {"the original": original, **converted}.items():
        require(model.dtype == config.torch_dtype, f"{name} is in {model.dtype}, the benchmark in {config.dtype}")
    contenders = {name: Contender(original.eval(), cache, compiled) for name, (cache, compiled) in BASELINES.items()
                  if config.compile or not compiled}
    baselines = list(contenders)
    contenders.update({name: Contender(model.eval(), "hybrid") for name, model in converted.items()})
    return compare(contenders, baselines, list(config.contexts), config.decode_steps,
                   budget_bytes=int(config.budget_gib * (1 << 30)), rounds=config.rounds, progress=progress,
                   batches=list(config.batches), prefill_once=config.prefill_once)
