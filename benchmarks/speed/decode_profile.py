"""Where a decode step's time goes: SmolLM2-135M against its conversions, at one long context.

Times each part of one decode step (wall clock, summed over layers): the kept heads'
attention (q/k/v/o projections, RoPE, attention over the cache, the merge with the
mixer's output), the replaced heads' step (`mixer.step`, with its projections), the cache
bookkeeping (`cache.update` for the K/V, `cache.mixer_state`), the MLP, the final norm +
LM head, and the rest (embedding, layer norms, residual adds, the mask, Python overhead).

Every contender is prefilled first; then the contenders take their decode steps in turn,
one step each per round, so a change in the machine's load touches all of them alike.
Median over the timed steps after warm-up. Writes decode_profile.json and
decode_profile.png to `--out` (default docs/results) and prints a markdown table.

`--batch B` decodes B left-padded rows as `bench --batch` does (`recurformer.bench.padded_prompts`).
`--fill random` skips the prefill (16 x 4,096 tokens take minutes per model here): each
cache is filled with random keys and values for the prompt's tokens and zero mixer states
whose ring buffers are marked full, so that a step reads and computes what it would after
a prefill (its time does not depend on the values); the logits are then meaningless, and
only the timing is kept.

    python -m benchmarks.speed.decode_profile [--context 8150] [--steps 24] [--batch 1] [--fill prefill] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from recurformer.bench import generation_inputs, new_cache, padded_prompts
from recurformer.cache import HybridCache
from recurformer.commands import convert_command
from recurformer.files import write_json_atomic
from recurformer.loading import load_converted, load_model
from recurformer.mixers import MixerConfig
from recurformer.report import save_figure
from recurformer.scoring import SelectionConfig

from benchmarks.common import RESULTS, ROOT

ATTENTION, STEP, CACHE, MLP, HEAD, REST = (
    "kept attention", "replaced step", "cache bookkeeping", "mlp", "norm + lm_head", "rest",
)
PARTS = (ATTENTION, STEP, CACHE, MLP, HEAD, REST)


class PartTimer:
    """Wall time by part during one step: forward hooks on modules, and wrappers around
    methods that are called directly (no hooks fire), whose time is taken out of the part
    of the module that encloses them."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.undo = []

    def watch(self, module, part: str) -> None:
        start = [0.0]

        def before(mod, args):
            start[0] = time.perf_counter()

        def after(mod, args, output):
            self.seconds[part] += time.perf_counter() - start[0]

        handles = [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
        self.undo += [handle.remove for handle in handles]

    def wrap(self, owner, method: str, part: str, inside: str) -> None:
        """Time `owner.method` as `part`, taking its time out of `inside`."""
        call = getattr(owner, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = call(*args, **kwargs)
            elapsed = time.perf_counter() - start
            self.seconds[part] += elapsed
            self.seconds[inside] -= elapsed
            return result

        setattr(owner, method, timed)
        self.undo.append(lambda: delattr(owner, method))

    def detach(self) -> None:
        for undo in self.undo:
            undo()
        self.undo.clear()


def attach(model, cache) -> PartTimer:
    timer = PartTimer()
    base = model.model
    for layer in base.layers:
        attention = layer.self_attn
        timer.watch(attention, ATTENTION)
        mixer = getattr(attention, "mixer", None)
        if mixer is not None:
            timer.wrap(mixer, "step", STEP, inside=ATTENTION)
        timer.watch(layer.mlp, MLP)
    for method in ("update", "mixer_state"):
        if hasattr(cache, method):
            timer.wrap(cache, method, CACHE, inside=ATTENTION)
    timer.watch(base.norm, HEAD)
    timer.watch(model.lm_head, HEAD)
    return timer


FILLS = ("prefill", "random")


def fill_rings(mixer, state: dict, context: int) -> None:
    """Mark every ring-buffer slot of a window kind's `state` as holding a token, as after a
    prefill of `context` tokens (a step attends over the filled slots only)."""
    for name, index in state.items():
        if name == "index" or name.endswith(".index"):
            ring = mixer.get_submodule(name.rpartition(".")[0])  # the window mixer that owns it
            recent = max(ring.sinks, context - ring.window)
            positions = torch.cat([torch.arange(min(ring.sinks, context)), torch.arange(recent, context)])
            index[:, ring.slots(positions)] = positions


def fill_randomly(model, cache, batch: int, context: int) -> None:
    """Put random keys and values for `context` tokens into every layer of `cache` (a
    `HybridCache`: the kept heads' only; the mixer states allocated as zeros, their ring
    buffers full)."""
    config = model.config.get_text_config()
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    generator = torch.Generator().manual_seed(0)
    for index, layer in enumerate(cache.layers):
        if isinstance(cache, HybridCache):
            attention = model.model.layers[index].self_attn
            if attention.mixer is not None:
                fill_rings(attention.mixer, cache.mixer_state(index, attention.mixer, batch, model.dtype, "cpu"), context)
            heads, kwargs = len(attention.kept_kv_heads), {}
        else:
            heads, kwargs = config.num_key_value_heads, {"cache_kwargs": {"cache_position": torch.arange(context)}}
        keys, values = (torch.randn(batch, heads, context, dim, generator=generator, dtype=model.dtype) for _ in range(2))
        layer.update(keys, values, **kwargs)


class Decoder:
    """One contender: a model and its cache, prefilled with `batch` rows of random tokens
    (`context` tokens in the longest, left-padded) or filled at random (`fill`), then
    decoding greedily one timed step at a time."""

    def __init__(self, model, cache_kind: str, context: int, steps: int, batch: int = 1, fill: str = "prefill") -> None:
        self.model = model
        ids, self.mask = padded_prompts(model.config.get_text_config().vocab_size, batch, context)
        self.positions = (self.mask.cumsum(1) - 1).clamp(min=0)
        self.cache = new_cache(model, cache_kind, context + steps + 8)
        if fill == "random":
            fill_randomly(model, self.cache, batch, context)
            self.token = ids[:, -1:]
            return
        with torch.no_grad():
            out = model(**generation_inputs(model, ids, self.cache, self.mask, self.positions, first=True), logits_to_keep=1)
        self.token = out.logits[:, -1:].argmax(-1)

    @torch.no_grad()
    def step(self) -> dict[str, float]:
        """One decode step: milliseconds by part, and `total`."""
        timer = attach(self.model, self.cache)
        start = time.perf_counter()
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        self.positions = self.positions[:, -1:] + 1
        out = self.model(**generation_inputs(self.model, self.token, self.cache, self.mask, self.positions, first=False))
        total = time.perf_counter() - start
        timer.detach()
        self.token = out.logits[:, -1:].argmax(-1)
        parts = {part: 1000 * timer.seconds.get(part, 0.0) for part in PARTS[:-1]}
        parts[REST] = 1000 * total - sum(parts.values())
        parts["total"] = 1000 * total
        return parts


def profile(contenders: dict, context: int, steps: int, warmup: int = 4, progress=print, batch: int = 1,
            fill: str = "prefill") -> dict[str, dict[str, float]]:
    """`name -> (model, cache kind)`: median milliseconds per decode step by part, the
    contenders' steps interleaved (one each per round)."""
    decoders = {}
    for name, (model, kind) in contenders.items():
        progress(f"{'prefilling' if fill == 'prefill' else 'filling at random'} {name}: {batch} x {context} tokens")
        decoders[name] = Decoder(model, kind, context, warmup + steps, batch, fill)
    samples: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in decoders}
    for round in range(warmup + steps):
        for name, decoder in decoders.items():
            parts = decoder.step()
            if round >= warmup:
                for part, ms in parts.items():
                    samples[name][part].append(ms)
    return {name: {part: statistics.median(values) for part, values in by_part.items()} for name, by_part in samples.items()}


def plot(rows: dict, context: int, steps: int, path: Path, batch: int = 1) -> None:
    figure, axis = plt.subplots(figsize=(8, 3.8))
    left = [0.0] * len(rows)
    for part in PARTS:
        values = [rows[name][part] for name in rows]
        axis.barh(list(rows), values, left=left, label=part)
        left = [a + b for a, b in zip(left, values)]
    axis.invert_yaxis()
    axis.set_xlabel(f"ms per decode step{f' of {batch} rows' if batch > 1 else ''} at {context} tokens (median of {steps})")
    axis.legend(fontsize=7, loc="lower right")
    save_figure(figure, path)


def table(rows: dict) -> str:
    lines = ["| model | total ms | " + " | ".join(PARTS) + " |", "|---|---|" + "---|" * len(PARTS)]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['total']:.1f} | " + " | ".join(f"{row[p]:.1f}" for p in PARTS) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--scores", default=str(RESULTS / "smollm2-135m-scores.json"))
    parser.add_argument("--context", type=int, default=8150)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch", type=int, default=1, help="left-padded rows decoded together")
    parser.add_argument("--fill", choices=FILLS, default="prefill", help="random: fill the caches without a prefill (timing only)")
    parser.add_argument("--scorer", default="recency", help="which statistic of --scores selects the groups")
    parser.add_argument("--variants", default="mamba:0.5,mamba:0.75,mamba2:0.5,window:0.5,window+linear:0.5,window+mamba:0.5,"
                        "window+mamba2:0.5", help="mixer:beta,...")
    parser.add_argument("--work", default=str(ROOT / "runs" / "bench"))
    parser.add_argument("--out", default=str(RESULTS), help="folder for decode_profile.json and .png")
    args = parser.parse_args()
    if args.batch < 1 or args.context < 1 or args.steps < 1:
        parser.error("--batch, --context and --steps must be positive")
    original = load_model(args.model)[0].eval()
    contenders = {"original (DynamicCache)": (original, "dynamic"), "original (StaticCache)": (original, "static")}
    for variant in args.variants.split(","):
        mixer, beta = variant.split(":")
        out = Path(args.work) / f"{mixer}-beta{beta}-{args.scorer}"
        if not (out / "config.json").exists():
            convert_command(args.model, args.scores, str(out), SelectionConfig(beta=float(beta), scorer=args.scorer),
                            MixerConfig(kind=mixer), force=True)
        contenders[f"{mixer} beta {beta}"] = (load_converted(str(out))[0].eval(), "hybrid")
    rows = profile(contenders, args.context, args.steps, progress=lambda line: print(line, flush=True), batch=args.batch,
                   fill=args.fill)
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / "decode_profile.json", {
        "context": args.context, "steps": args.steps, "batch": args.batch, "fill": args.fill, "scorer": args.scorer,
        "threads": torch.get_num_threads(), "unit": "ms per decode step (median)",
        "rows": rows,
    })
    plot(rows, args.context, args.steps, folder / "decode_profile.png", args.batch)
    print(table(rows))


if __name__ == "__main__":
    main()
