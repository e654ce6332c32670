"""GPU benchmark (issue 47): 8B-shaped models on one CUDA GPU, the conversion against the original.

Random-weight models with the configs of Llama-3.1-8B and Qwen2.5-7B (no weights travel),
built on the GPU in bf16, converted as `run` converts (window+mamba2, window and tail state
`auto`; the groups drawn at random with a seed: speed depends on how many groups each layer
keeps, not on which). For each model, against the original with a `StaticCache` and SDPA,
both eager and both replayed from a CUDA graph (`+graphs`; also the original's compiled
decode with `--compile`):

- batch 1 at each `--contexts`: prefill time (logits of the last token only), decode
  tokens/s (median step after warm-up steps; eager and `+graphs`: the conversion's
  `DecodeGraph`, the original's forward over its `StaticCache` captured as it is), cache
  bytes, peak GPU memory; at the throughput
  context one eager step under torch.profiler (host and device time, kernels launched);
- at `--throughput-context` (32K): the largest batch whose weights, cache and a 2 GiB
  workspace fit `--memory-gib` (70), from the cache bytes measured at batch 1; the
  original's total tokens/s at its largest batch, the conversion's at twice that and at its
  own largest batch, each cache made of the prefilled row repeated (`HybridCache.repeat_rows`,
  a `StaticCache` of that batch): the decode's cost does not depend on what the rows hold,
  and a prefill of 26 x 32K tokens would take the time of the whole check;
- one optimizer step of the tail recipe's lm stage (KL to the original, tails trainable),
  weights in bf16.

Every section is timed with CUDA synchronization; results go to `--out`/gpu.json after every
section (a run killed at its deadline keeps what it measured), with the GPU, torch, Triton,
transformers and the SSD kernel in use. `--deadline-s` stops starting new sections.

    python -m benchmarks.speed.gpu --out docs/results [--models llama-3.1-8b,qwen2.5-7b]
        [--contexts 8192,32768,131072] [--betas 0.5,0.75] [--memory-gib 70] [--compile] [--deadline-s 500]

`--render FILE` writes docs/results/gpu.md from a gpu.json (no GPU needed).
"""

from __future__ import annotations

import argparse
import copy
import gc
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers
from transformers import CompileConfig, DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers import AttentionInterface, AttentionMaskInterface, StaticCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from recurformer.bench import cache_bytes, timed_decode
from recurformer.cache import CACHE_ARGUMENT, HybridCache
from recurformer.decode_graph import DecodeGraph, GraphedStep
from recurformer.device import synchronize
from recurformer.files import write_json_atomic, write_text_atomic
from recurformer.mixers import MixerConfig, resolve_for_model
from recurformer.ops.decode_attention import decode_attention
from recurformer.ops.ssd import gpu_kernel, ssd, ssd_naive
from recurformer.recipe import recipe_for
from recurformer.surgery import convert
from recurformer.train import objective_for

from benchmarks.common import RESULTS, random_spec

GIB = 1 << 30
ORIGINAL_MODES, CONVERSION_MODES = ("eager", "graphs", "graphs-split"), ("eager", "graphs")
WORKSPACE = 2 * GIB  # room kept free beside weights and caches: activations of a decode step, allocator slack
SHAPES = {  # the public configs' shapes; max_position_embeddings raised to 128K where the model's YaRN reaches it
    "llama-3.1-8b": (LlamaForCausalLM, LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False)),
    "qwen2.5-7b": (Qwen2ForCausalLM, Qwen2Config(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, use_sliding_window=False)),
}


def build_original(name: str, device: str = "cuda", seed: int = 0):
    """The random-weight model of shape `name`, on `device` in bf16, SDPA."""
    model_class, config = SHAPES[name]
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class._from_config(config, dtype=torch.bfloat16)
    return model.eval().requires_grad_(False)


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    """The most GPU memory allocated since `reset_peak` (None on the CPU: not measured here)."""
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@torch.no_grad()
def prefill(model, context: int, hybrid: bool, seed: int = 0):
    """(seconds, cache, first token `[1, 1]`) of one random prompt of `context` tokens."""
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (1, context),
                        generator=torch.Generator().manual_seed(seed)).to(model.device)
    cache = HybridCache(model.config.text_config.num_hidden_layers) if hybrid else DynamicCache(config=model.config)
    synchronize(model.device)
    start = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{CACHE_ARGUMENT: cache})
    token = out.logits[:, -1:].argmax(-1)
    synchronize(model.device)
    return time.perf_counter() - start, cache, token


def static_rows(model, dynamic: DynamicCache, batch: int, capacity: int) -> StaticCache:
    """A `StaticCache` of `batch` rows and `capacity` tokens holding the one prefilled row of
    `dynamic` in every row (`dynamic` is emptied layer by layer as it is copied)."""
    static = StaticCache(config=model.config, max_cache_len=capacity)
    for source, layer in zip(dynamic.layers, static.layers):
        keys, values = source.keys, source.values
        layer.lazy_initialization(keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1))
        layer.keys[:, :, : keys.shape[2]] = keys
        layer.values[:, :, : values.shape[2]] = values
        layer.cumulative_length.fill_(keys.shape[2])
        source.keys = source.values = None
    return static


@torch.no_grad()
def decode(model, cache, token, context: int, batch: int, steps: int, warmup: int, mode: str = "eager") -> dict:
    """Decode `warmup + steps` greedy tokens for `batch` rows after `context` tokens, `mode`:
    `eager`, `compiled` (the original: transformers' compiled call, CUDA graphs through
    torch.compile), `graphs` (`graphed_step`: a CUDA graph) or `graphs-split` (the original's
    graph with its attention through our split-key decode kernel); the median step, tokens/s per
    row and in total, and the peak GPU memory of the decode."""
    positions = torch.full((batch, 1), context - 1, dtype=torch.long, device=model.device)
    token = token.expand(batch, 1).contiguous()
    reset_peak(model.device)
    if mode in ("graphs", "graphs-split"):
        implementation = model.config._attn_implementation
        if mode == "graphs-split":
            model.config._attn_implementation = SPLIT
        try:
            graph, times = graphed_step(model, cache, batch, context + warmup + steps + 1), []
            for _ in range(warmup + steps):
                start = time.perf_counter()
                positions = positions + 1
                token = graph(token, positions)[:, -1:].argmax(-1)
                synchronize(model.device)
                times.append(time.perf_counter() - start)
        finally:
            model.config._attn_implementation = implementation
    else:
        mask = torch.ones(batch, context, dtype=torch.long, device=model.device)
        call = model.get_compiled_call(CompileConfig()) if mode == "compiled" else model
        times = timed_decode(model, call, cache, token, mask, positions, warmup + steps)
    step = statistics.median(times[warmup:])
    return {"step_ms": 1000 * step, "tokens_per_s": 1 / step, "total_tokens_per_s": batch / step,
            "first_step_s": times[0], "peak_gib": peak_gib(model.device)}


SPLIT = "recurformer-split"  # transformers' attention name of `split_attention`


def split_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface, for the original's `graphs-split` decode: a decode
    step (one query, a bool mask) through our split-key kernel (`ops/decode_attention`), the
    one a conversion's kept heads use; anything else through SDPA. query `[B, H, T, D]`, key
    and value `[B, Hkv, C, D]` -> `[B, T, H, D]`."""
    batch, heads, length, dim = query.shape
    if length == 1 and attention_mask is not None and attention_mask.dtype == torch.bool:
        groups = key.shape[1]
        out = decode_attention(query.reshape(batch, groups, heads // groups, dim), key, value, attention_mask,
                               dim**-0.5 if scaling is None else scaling)
        return out.reshape(batch, 1, heads, dim), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


AttentionInterface.register(SPLIT, split_attention)
AttentionMaskInterface.register(SPLIT, sdpa_mask)


def graphed_step(model, cache, batch: int, capacity: int):
    """The decode step captured as a CUDA graph: a conversion's `DecodeGraph` over its
    `HybridCache`, the original's own forward over its `StaticCache` (transformers builds
    the mask on the device while a stream captures)."""
    if isinstance(cache, HybridCache):
        return DecodeGraph(model, cache, capacity=capacity)
    return GraphedStep(lambda ids, positions: model(input_ids=ids, position_ids=positions, use_cache=True,
                                                    **{CACHE_ARGUMENT: cache}).logits, batch, model.device)


@torch.no_grad()
def profile_step(model, cache, token, context: int, top: int = 12) -> dict:
    """One eager decode step of one row under torch.profiler (`profiled`): what an eager
    step on a GPU spends its time on (launching, not computing)."""
    mask = torch.ones(1, context, dtype=torch.long, device=model.device)
    positions = torch.full((1, 1), context - 1, dtype=torch.long, device=model.device)
    return profiled(lambda: timed_decode(model, model, cache, token, mask, positions, 1), model.device, top)


def profiled(work, device: torch.device, top: int = 12) -> dict:
    """`work()` under torch.profiler: the host's and the device's time, the kernels launched,
    and the operators that take the most host time and the most device time."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        work()
    events = profiler.key_averages()
    kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    operators = [e for e in events if e.key.startswith("aten::")]
    by_host = sorted(operators, key=lambda e: -e.self_cpu_time_total)
    by_device = sorted(kernels or operators, key=lambda e: -e.self_device_time_total)
    return {"host_ms": sum(e.self_cpu_time_total for e in events) / 1000,
            "device_ms": sum(e.self_device_time_total for e in kernels) / 1000 if kernels else None,
            "kernel_launches": sum(e.count for e in kernels) if kernels else None,
            "aten_calls": sum(e.count for e in operators),
            "top_host": [{"op": e.key, "calls": e.count, "self_host_ms": e.self_cpu_time_total / 1000}
                         for e in by_host[:top]],
            "top_device": [{"op": e.key[:120], "calls": e.count, "self_device_ms": e.self_device_time_total / 1000}
                           for e in by_device[:top]]}


def largest_batch(weights: int, per_sequence: int, memory: int) -> int:
    """The most sequences whose cache fits beside the weights and the workspace in `memory`."""
    return max(0, int((memory - weights - WORKSPACE) // per_sequence))


def _decodes(model, name: str, cache, token, context: int, batch: int, steps: int, warmup: int,
             modes: list[str]) -> list[dict]:
    """One row per decode mode, each from its own copy of the prefilled `cache` (the last from it)."""
    rows = []
    for i, mode in enumerate(modes):
        own = cache if i == len(modes) - 1 else copy.deepcopy(cache)
        row = {"model": name if mode == "eager" else f"{name}+{mode}", "context": context, "batch": batch}
        try:
            row.update(decode(model, own, token, context, batch, steps, warmup, mode))
        except Exception as error:  # noqa: BLE001 - a capture or compile that fails is recorded; eager is not caught
            if mode == "eager":
                raise
            row["error"] = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
        rows.append(row)
        del own
        free()
    return rows


@torch.no_grad()
def batch1(model, name: str, context: int, hybrid: bool, steps: int, warmup: int, modes: list[str],
           profile: bool = False) -> list[dict]:
    """Prefill one sequence of `context` tokens, then decode it in each of `modes` (the
    original: a dynamic-cache prefill copied into a static cache, which decodes); `profile`:
    also one eager step under the profiler (`profile_step`)."""
    reset_peak(model.device)
    seconds, cache, token = prefill(model, context, hybrid)
    prefill_peak = peak_gib(model.device)
    kv, _, state = cache_bytes(cache)
    capacity = context + warmup + steps + 1
    if hybrid:
        cache.repeat_rows(1, capacity)
    else:
        cache = static_rows(model, cache, 1, capacity)
    measured = {"prefill_s": seconds, "prefill_peak_gib": prefill_peak, "kv_bytes": kv, "state_bytes": state,
                "cache_bytes": kv + state}
    if profile:
        measured["profile"] = profile_step(model, copy.deepcopy(cache), token, context)
        measured["prefill_profile"] = profiled(lambda: prefill(model, context, hybrid), model.device)
        free()
    return [{**row, **measured} for row in _decodes(model, name, cache, token, context, 1, steps, warmup, modes)]


@torch.no_grad()
def batched(model, name: str, context: int, batch: int, hybrid: bool, steps: int, warmup: int,
            modes: list[str]) -> list[dict]:
    """Decode `batch` copies of one prefilled sequence of `context` tokens in each of `modes`,
    each from a prefill of its own (a copy of a batch's cache would not fit beside it)."""
    rows = []
    for mode in modes:
        _, cache, token = prefill(model, context, hybrid)
        capacity = context + warmup + steps + 1
        if hybrid:
            cache.repeat_rows(batch, capacity)
        else:
            cache = static_rows(model, cache, batch, capacity)
        free()
        rows += _decodes(model, name, cache, token, context, batch, steps, warmup, [mode])
    return rows


def train_step(student, teacher, seq_len: int) -> dict:
    """One optimizer step of the tail recipe's lm stage (its micro-batches of one sequence of
    `seq_len` tokens), timed after one untimed micro-batch."""
    recipe = recipe_for(student.config.mixer_config().kind, None)
    config = recipe.stage("lm").train_config("lm", 1, 0)
    objective = objective_for(config, student, teacher)
    module = objective.prepare(student)
    try:
        return _timed_step(module, objective, config, recipe.name, seq_len)
    finally:  # the student decodes next: its layers no longer recompute, eval mode, no gradients
        objective.finish(module)
        student.eval().requires_grad_(False)


def _timed_step(module, objective, config, recipe: str, seq_len: int) -> dict:
    """`train_step`'s measurement, on the prepared `module`."""
    device = next(module.parameters()).device
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=config.lr)
    ids = torch.randint(0, module.config.text_config.vocab_size, (1, seq_len), device=device)
    loss, _ = objective.loss(module, ids)
    loss.backward()
    optimizer.zero_grad(set_to_none=True)
    micro = config.batch_size // config.grad_accum
    reset_peak(device)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(config.grad_accum):
        loss, _ = objective.loss(module, ids.expand(micro, -1))
        (loss / config.grad_accum).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    seconds = time.perf_counter() - start
    return {"recipe": recipe, "stage": "lm", "trainable": config.trainable, "seq_len": seq_len,
            "sequences": config.batch_size, "step_s": seconds, "tokens_per_s": config.batch_size * seq_len / seconds,
            "peak_gib": peak_gib(device),
            "trainable_parameters": sum(p.numel() for p in module.parameters() if p.requires_grad)}


def ssd_check(device: str) -> dict:
    """Which SSD kernel the conversions' prefill runs on the GPU at this benchmark's sizes
    (head 128, state 32), in fp32 and bf16, and its relative error against the fp32 loop."""
    g = torch.Generator().manual_seed(0)
    x, dt = torch.randn(1, 512, 8, 128, generator=g), torch.nn.functional.softplus(torch.randn(1, 512, 8, generator=g) - 1)
    A, B, C = -(8 * torch.rand(8, generator=g) + 0.01), torch.randn(1, 512, 8, 32, generator=g), torch.randn(1, 512, 8, 32, generator=g)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        placed = [t.to(device, dtype) for t in (x, B, C)]
        out[f"kernel_{name}"] = gpu_kernel(placed[0], placed[1]) or "torch (the chunked scan)"
        y = ssd(placed[0], dt.to(device), A.to(device), placed[1], placed[2])
        ref = ssd_naive(x.to(dtype).float(), dt, A, B.to(dtype).float(), C.to(dtype).float())
        out[f"relative_error_{name}"] = float((y.float().cpu() - ref).norm() / ref.norm())
    return out


def environment(device: str) -> dict:
    out = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
    if device == "cpu":
        return {"gpu": None, **out}
    import triton  # noqa: PLC0415 - present on GPU machines only

    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "gpu_memory_gib": props.total_memory / GIB, "cuda": torch.version.cuda,
            "triton": triton.__version__, **out}


class Results:
    """gpu.json, rewritten after every section."""

    def __init__(self, out: Path, settings: dict):
        self.path = out / "gpu.json"
        self.data = {"settings": settings, "environment": environment(settings["device"]), "ssd": None, "models": {},
                     "errors": []}
        self.save()

    def save(self) -> None:
        write_json_atomic(self.path, self.data)

    def add(self, model: str, section: str, row) -> None:
        self.data["models"].setdefault(model, {}).setdefault(section, []).append(row)
        self.save()
        print(f"[{model}] {section}: {row}", flush=True)


def run(args) -> None:
    start = time.perf_counter()
    late = lambda: time.perf_counter() - start > args.deadline_s  # noqa: E731
    results = Results(args.out, {k: v for k, v in vars(args).items() if k not in ("out", "render")})
    results.data["ssd"] = ssd_check(args.device)
    results.save()
    print("ssd:", results.data["ssd"], flush=True)
    originals = [m for m in args.modes if m in ORIGINAL_MODES] + (["compiled"] if args.compile else [])
    conversions = [m for m in args.modes if m in CONVERSION_MODES]
    for shape in args.models:
        if late():
            break
        original = build_original(shape, args.device)
        weights = weight_bytes(original)
        results.add(shape, "weights", {"bytes": weights, "gib": weights / GIB})
        per_sequence = {}
        for context in args.contexts:
            if late():
                break
            for row in batch1(original, "original", context, False, args.steps, args.warmup, originals,
                              profile=context == args.throughput_context):
                results.add(shape, "batch1", row)
            if context == args.throughput_context:
                per_sequence["original"] = row["cache_bytes"]
        if "original" in per_sequence and not late():
            base = largest_batch(weights, per_sequence["original"], args.memory_gib * GIB)
            for row in batched(original, "original", args.throughput_context, base, False, args.steps, args.warmup,
                               originals):
                results.add(shape, "throughput", row)
        for beta in args.betas:
            if late():
                break
            if original is None:
                original = build_original(shape, args.device)
            mixer = resolve_for_model(MixerConfig(), original.config)
            converted = convert(original, random_spec(original.config, beta), mixer)
            name = f"conversion@{beta}"
            results.add(shape, "mixer", {"model": name, **mixer.to_dict()})
            try:
                if not args.no_train:
                    results.add(shape, "train", {"model": name, **train_step(converted, original, args.train_seq_len)})
            except (torch.OutOfMemoryError, RuntimeError) as error:  # recorded: a kernel may refuse (fla on Hopper)
                results.data["errors"].append(f"{shape} {name} train: {str(error).splitlines()[0]}")
            del original
            original = None
            free()
            for context in args.contexts:
                if late():
                    break
                for row in batch1(converted, name, context, True, args.steps, args.warmup, conversions,
                                  profile=context == args.throughput_context):
                    results.add(shape, "batch1", row)
                if context == args.throughput_context:
                    per_sequence[name] = row["cache_bytes"]
            if name in per_sequence and "original" in per_sequence and not late():
                base = largest_batch(weights, per_sequence["original"], args.memory_gib * GIB)
                own = largest_batch(weight_bytes(converted), per_sequence[name], args.memory_gib * GIB)
                for batch in sorted({2 * base, own}):
                    if late():
                        break
                    for row in batched(converted, name, args.throughput_context, batch, True, args.steps, args.warmup,
                                       conversions):
                        results.add(shape, "throughput", {**row, "largest_batch": own, "original_largest_batch": base})
            del converted
            free()
        del original  # the next shape's original is built alone
        free()
    results.data["seconds"] = time.perf_counter() - start
    results.save()


def _integers(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--models", default=",".join(SHAPES), type=lambda t: t.split(","))
    parser.add_argument("--contexts", default="8192,32768,131072", type=_integers)
    parser.add_argument("--betas", default="0.5,0.75", type=lambda t: [float(v) for v in t.split(",")])
    parser.add_argument("--throughput-context", type=int, default=32768)
    parser.add_argument("--memory-gib", type=float, default=70)
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--train-seq-len", type=int, default=1024)
    parser.add_argument("--compile", action="store_true", help="also the original's decode under torch.compile "
                        "(transformers' compiled call: CUDA graphs), beside the conversion's own graphs")
    parser.add_argument("--deadline-s", type=float, default=500)
    parser.add_argument("--modes", default="graphs,graphs-split", type=lambda t: t.split(","),
                        help="decode modes: eager (bound by the host on a GPU: docs/results/gpu-before-split.md), "
                             "graphs (both models), graphs-split (the original only)")
    parser.add_argument("--no-train", action="store_true", help="skip the training step")
    parser.add_argument("--render", type=Path, help="write gpu.md beside this gpu.json and stop")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to try the script itself on tiny shapes")
    args = parser.parse_args()
    if args.render:
        if not args.render.is_file():
            raise SystemExit(f"gpu.py: --render {args.render}: no such file")
        write_text_atomic(args.render.with_suffix(".md"), render(args.render))
        return
    unknown = [m for m in args.models if m not in SHAPES]
    if unknown:
        raise SystemExit(f"gpu.py: unknown model shape {unknown[0]!r}; choose from {', '.join(SHAPES)}")
    unknown = [m for m in args.modes if m not in ORIGINAL_MODES]
    if unknown:
        raise SystemExit(f"gpu.py: unknown decode mode {unknown[0]!r}; choose from {', '.join(ORIGINAL_MODES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu.py: needs a CUDA GPU (torch sees none)")
    args.out.mkdir(parents=True, exist_ok=True)
    run(args)


TARGETS = {  # issue 47: (what, beta, context or None, the least ratio that meets it; prefill: the most)
    "decode_128k": "batch 1, decode at 128K >= 1.25x the static-cache original (beta 0.5)",
    "decode_8k": "batch 1, decode at 8K >= 0.95x (beta 0.5)",
    "prefill_32k": "prefill at 32K <= 0.9x the original's time",
    "throughput": "at 32K, twice the original's largest batch: total tokens/s >= 1.6x (beta 0.5), >= 2.5x (beta 0.75)",
    "largest_batch": "largest batch at 32K in 70 GiB >= 1.9x (beta 0.5), >= 3.5x (beta 0.75)",
}


def _gib(n: float | None) -> str:
    """Bytes as GiB, or a value already in GiB, two decimals; `-` where not measured (CPU)."""
    return "-" if n is None else f"{n / GIB:.2f}" if n > 1000 else f"{n:.2f}"


def _base_name(model: str) -> str:
    """`conversion@0.5+graphs` -> `conversion@0.5`: the model, whatever decode mode."""
    return model.split("+")[0]


def _baseline(originals: dict, row: dict) -> dict | None:
    """The original's row a `row` compares with, at its context: a conversion's decode in a
    mode (`+graphs`) with the original's in the same mode where measured, else with its
    compiled one (CUDA graphs too), else with the eager one."""
    mode = row["model"].partition("+")[2]
    if mode and not row["model"].startswith("original"):
        for name in (f"original+{mode}", "original+compiled"):
            if (name, row["context"]) in originals:
                return originals[(name, row["context"])]
    return originals.get(("original", row["context"]))


def _profile_lines(what: str, p: dict) -> list[str]:
    """A profiled piece of work (`profiled`) as a bullet: host and device time, and the
    operators that take the most device time."""
    device = "" if p["device_ms"] is None else f", {p['device_ms']:.1f} ms on the device in {p['kernel_launches']:,} kernels"
    top = "; ".join(f"{o['op']} {o['self_device_ms']:.1f} ms ({o['calls']})" for o in p.get("top_device", [])[:4])
    return [f"- {what} under the profiler: {p['host_ms']:.1f} ms on the host, {p['aten_calls']:,} operator calls"
            f"{device}." + (f" Most device time: {top}." if top and p["device_ms"] else "")]


def render(path: Path) -> str:
    """docs/results/gpu.md from gpu.json: the environment, the SSD kernel check, and per model
    shape the batch-1 rows, the throughput rows and the training step, each beside the
    original, with the byte limit of each decode ratio: (weights + cache of the original) /
    (weights + cache of the conversion), what a step that only streams its bytes would gain."""
    import json  # noqa: PLC0415

    data = json.loads(path.read_text())
    env = data["environment"]
    software = ", ".join(f"{name} {env[key]}" for name, key in (("torch", "torch"), ("CUDA", "cuda"), ("Triton", "triton"),
                         ("transformers", "transformers"), ("Python", "python")) if env.get(key))
    lines = [f"# GPU results ({env['gpu'] or 'CPU'})", "",
             f"Written by `python -m benchmarks.speed.gpu --render {path}` from `{path.name}`; how it measures: "
             f"`benchmarks/speed/gpu.py` and docs/gpu.md. Software: {software}.", ""]
    for note in data.get("notes", []):
        lines += [note, ""]
    ssd_row = data.get("ssd") or {}
    if ssd_row:
        lines += ["SSD scan at head 128, state 32, against the fp32 loop: " + "; ".join(
            f"{dtype}: {ssd_row[f'kernel_{dtype}']}, relative error {ssd_row[f'relative_error_{dtype}']:.1e}"
            for dtype in ("float32", "bfloat16") if f"kernel_{dtype}" in ssd_row), ""]
    for shape, sections in data["models"].items():
        weights = {"original": sections["weights"][0]["bytes"]}
        lines += [f"## {shape}", "", f"Weights: {_gib(weights['original'])} GiB (bf16).", ""]
        failed = [r for section in ("batch1", "throughput") for r in sections.get(section, []) if "error" in r]
        rows = [r for r in sections.get("batch1", []) if "error" not in r]
        base = {(r["model"], r["context"]): r for r in rows if r["model"].startswith("original")}
        if rows:
            lines += ["| model | context | prefill s | x original | decode tokens/s | x original | byte limit | cache GiB "
                      "| peak GiB |", "|---|---|---|---|---|---|---|---|---|"]
            for r in rows:
                o = _baseline(base, r)
                prefill = "" if o is None or r is o else f"{r['prefill_s'] / o['prefill_s']:.2f}"
                speed = "" if o is None or r is o else f"{r['tokens_per_s'] / o['tokens_per_s']:.2f}"
                limit = "" if o is None or r is o else \
                    f"{(weights['original'] + o['cache_bytes']) / (weights['original'] + r['cache_bytes']):.2f}"
                lines.append(f"| {r['model']} | {r['context']:,} | {r['prefill_s']:.2f} | {prefill} | "
                             f"{r['tokens_per_s']:.1f} | {speed} | {limit} | {_gib(r['cache_bytes'])} | "
                             f"{_gib(r['peak_gib'])} |")
            lines.append("")
        profiled_models = {}
        for r in rows:
            if "profile" in r:
                profiled_models.setdefault(_base_name(r["model"]), r)
        for model, r in profiled_models.items():
            lines += _profile_lines(f"{model}, one eager step at {r['context']:,}", r["profile"])
            if "prefill_profile" in r:
                lines += _profile_lines(f"{model}, its prefill of {r['context']:,} tokens", r["prefill_profile"])
        if profiled_models:
            lines.append("")
        rows = [r for r in sections.get("throughput", []) if "error" not in r]
        if rows:
            firsts = {(r["model"], r["context"]): r for r in rows if r["model"].startswith("original")}
            lines += ["| model | batch | total tokens/s | x original at its largest batch | step ms | peak GiB |",
                      "|---|---|---|---|---|---|"]
            for r in rows:
                first = _baseline(firsts, r)
                ratio = "" if first is None or r is first else f"{r['total_tokens_per_s'] / first['total_tokens_per_s']:.2f}"
                lines.append(f"| {r['model']} | {r['batch']} | {r['total_tokens_per_s']:.0f} | {ratio} | {r['step_ms']:.1f} | "
                             f"{_gib(r['peak_gib'])} |")
            lines.append("")
        sizes = [r for r in rows if "largest_batch" in r]
        if sizes:
            base_batch = sizes[0]["original_largest_batch"]
            lines += [f"Largest batch at the throughput context in the memory budget (from the batch-1 cache bytes): "
                      f"original {base_batch}, " + ", ".join(
                          f"{m} {b} ({b / base_batch:.2f}x)" for m, b in {r["model"]: r["largest_batch"] for r in sizes}.items())
                      + ".", ""]
        for r in failed:
            lines += [f"- {r['model']} at {r['context']:,} x {r['batch']} failed: {r['error']}"]
        if failed:
            lines.append("")
        for r in sections.get("train", []):
            lines += [f"Training step ({r['model']}, recipe {r['recipe']} {r['stage']} stage, {r['sequences']} x "
                      f"{r['seq_len']} tokens, {r['trainable_parameters']:,} trainable parameters): {r['step_s']:.2f} s, "
                      f"{r['tokens_per_s']:.0f} tokens/s, peak {_gib(r['peak_gib'])} GiB.", ""]
    if data.get("errors"):
        lines += ["## Errors", "", *[f"- {e}" for e in data["errors"]], ""]
    lines += ["## Targets (issue 47)", "", "Each against the original decoding in the same way (graphs beside graphs), and "
              "judged against the original with the same decode-attention kernel where that was measured "
              "(`original+graphs-split`): a gain that only the kernel gives is not the conversion's.", ""]
    for shape, sections in data["models"].items():
        lines += [f"{shape}:", "", *_target_lines(sections), ""]
    return "\n".join(lines)


def _target_lines(sections: dict) -> list[str]:
    """Each issue-47 target with what `sections` measured of it (or that it was not measured)."""
    out = []
    for key, text in TARGETS.items():
        measured = _target_values(sections, key)
        out.append(f"- {text}: " + ("; ".join(measured) if measured else "not measured in this run") + ".")
    return out


def _target_values(sections: dict, key: str) -> list[str]:
    """The measured side of one target: ratios against each original row that fits it."""
    batch1 = [r for r in sections.get("batch1", []) if "error" not in r]
    throughput = [r for r in sections.get("throughput", []) if "error" not in r]
    row = lambda rows, model, **match: next((r for r in rows if r["model"] == model  # noqa: E731
                                             and all(r[k] == v for k, v in match.items())), None)
    originals = ("original+graphs", "original+graphs-split", "original+compiled")
    values = []
    if key in ("decode_128k", "decode_8k"):
        context = 131072 if key == "decode_128k" else 8192
        conv = row(batch1, "conversion@0.5+graphs", context=context)
        for name in originals:
            if conv and (o := row(batch1, name, context=context)):
                values.append(f"{conv['tokens_per_s'] / o['tokens_per_s']:.2f}x {name}")
    elif key == "prefill_32k":
        conv = next((r for r in batch1 if r["model"].startswith("conversion@0.5") and r["context"] == 32768), None)
        base = next((r for r in batch1 if r["model"].startswith("original") and r["context"] == 32768), None)
        if conv and base:
            values.append(f"{conv['prefill_s'] / base['prefill_s']:.2f}x (first prefill, wall clock)")
            if "prefill_profile" in conv and "prefill_profile" in base and conv["prefill_profile"]["device_ms"]:
                values.append(f"{conv['prefill_profile']['device_ms'] / base['prefill_profile']['device_ms']:.2f}x "
                              "on the device (profiled second prefill)")
    else:
        for beta in ("0.5", "0.75"):
            for r in (r for r in throughput if r["model"] == f"conversion@{beta}+graphs"):
                if key == "largest_batch":
                    values.append(f"beta {beta}: {r['largest_batch'] / r['original_largest_batch']:.2f}x")
                    break
                for name in originals:  # at twice the original's batch, or at what fitted
                    if o := row(throughput, name, batch=r["original_largest_batch"]):
                        values.append(f"beta {beta} at batch {r['batch']} (the original's {o['batch']}): "
                                      f"{r['total_tokens_per_s'] / o['total_tokens_per_s']:.2f}x {name}")
    return values


if __name__ == "__main__":
    main()
