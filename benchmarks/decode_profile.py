"""Where a decode step's time goes: SmolLM2-135M against its conversions, at one long context.

Times each part of one decode step with forward hooks (wall clock, summed over layers):
the kept heads' attention including the cache update, the mixer, the MLP, the final
norm + LM head, and the rest (embedding, layer norms, residual adds, Python overhead).
Median over the timed steps after warm-up. Writes docs/results/decode_profile.json and
decode_profile.png and prints a markdown table.

    python benchmarks/decode_profile.py [--context 8150] [--steps 24]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from recurformer.bench import new_cache  # noqa: E402
from recurformer.commands import convert_command  # noqa: E402
from recurformer.config import MixerConfig  # noqa: E402
from recurformer.files import write_json_atomic  # noqa: E402
from recurformer.loading import load_converted, load_model  # noqa: E402
from recurformer.report import save_figure  # noqa: E402
from recurformer.scoring import SelectionConfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
PARTS = ("attention (kept heads, with cache)", "mixer", "mlp", "norm + lm_head", "rest")


class PartTimer:
    """Accumulates wall time of hooked modules by part name during one step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.handles = []
        self.restore = []

    def watch(self, module, part: str) -> None:
        start = [0.0]

        def before(mod, args):
            start[0] = time.perf_counter()

        def after(mod, args, output):
            self.seconds[part] += time.perf_counter() - start[0]

        self.handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    def watch_step(self, mixer, part: str, inside: str) -> None:
        """Decoding calls `mixer.step` directly (no hooks fire): time it through a wrapper,
        and take its time out of the enclosing module's part `inside`."""
        step = mixer.step

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = step(*args, **kwargs)
            elapsed = time.perf_counter() - start
            self.seconds[part] += elapsed
            self.seconds[inside] -= elapsed
            return result

        mixer.step = timed
        self.restore.append(lambda: delattr(mixer, "step"))


def attach(model) -> PartTimer:
    timer = PartTimer()
    base = model.model
    for layer in base.layers:
        attention = layer.self_attn
        timer.watch(attention, PARTS[0])
        mixer = getattr(attention, "mixer", None)
        if mixer is not None:
            timer.watch_step(mixer, PARTS[1], inside=PARTS[0])
        timer.watch(layer.mlp, PARTS[2])
    timer.watch(base.norm, PARTS[3])
    timer.watch(model.lm_head, PARTS[3])
    return timer


@torch.no_grad()
def profile(model, cache_kind: str, context: int, steps: int, warmup: int = 4) -> dict[str, float]:
    """Median milliseconds per decode step, by part, after a prefill of `context` tokens."""
    torch.manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (1, context))
    cache = new_cache(model, cache_kind, context + warmup + steps + 8)
    out = model(prompt, past_key_values=cache, use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    timer = attach(model)
    samples = defaultdict(list)
    for step in range(warmup + steps):
        timer.seconds.clear()
        start = time.perf_counter()
        out = model(token, past_key_values=cache, use_cache=True, cache_position=torch.tensor([context + step]))
        total = time.perf_counter() - start
        token = out.logits[:, -1:].argmax(-1)
        if step >= warmup:
            parts = dict(timer.seconds)
            parts[PARTS[4]] = total - sum(parts.values())
            for part in PARTS:
                samples[part].append(1000 * parts.get(part, 0.0))
            samples["total"].append(1000 * total)
    for handle in timer.handles:
        handle.remove()
    for undo in timer.restore:
        undo()
    return {part: statistics.median(values) for part, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--scores", default=str(RESULTS / "smollm2-135m-scores.json"))
    parser.add_argument("--context", type=int, default=8150)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--variants", default="mamba:0.5,mamba:0.75,mamba2:0.5,window:0.5", help="mixer:beta,...")
    parser.add_argument("--work", default=str(ROOT / "runs" / "bench"))
    args = parser.parse_args()
    original = load_model(args.model)[0]
    contenders = {"original (DynamicCache)": (original, "dynamic"), "original (StaticCache)": (original, "static")}
    for variant in args.variants.split(","):
        mixer, beta = variant.split(":")
        out = Path(args.work) / f"{mixer}-beta{beta}"
        if not (out / "config.json").exists():
            convert_command(args.model, args.scores, str(out), SelectionConfig(beta=float(beta)), MixerConfig(kind=mixer),
                            force=True)
        contenders[f"{mixer} beta {beta}"] = (load_converted(str(out))[0].eval(), "hybrid")
    rows = {}
    for name, (model, kind) in contenders.items():
        print(f"profiling {name} at {args.context} tokens", flush=True)
        rows[name] = profile(model, kind, args.context, args.steps)
    write_json_atomic(RESULTS / "decode_profile.json", {
        "context": args.context, "steps": args.steps, "threads": torch.get_num_threads(), "unit": "ms per decode step (median)",
        "rows": rows,
    })
    figure, axis = plt.subplots(figsize=(8, 3.8))
    left = [0.0] * len(rows)
    for part in PARTS:
        values = [rows[name][part] for name in rows]
        axis.barh(list(rows), values, left=left, label=part)
        left = [a + b for a, b in zip(left, values)]
    axis.invert_yaxis()
    axis.set_xlabel(f"ms per decode step at {args.context} tokens (median of {args.steps})")
    axis.legend(fontsize=7, loc="lower right")
    save_figure(figure, RESULTS / "decode_profile.png")
    print("| model | total ms | " + " | ".join(PARTS) + " |")
    print("|---|---|" + "---|" * len(PARTS))
    for name, row in rows.items():
        print(f"| {name} | {row['total']:.1f} | " + " | ".join(f"{row[p]:.1f}" for p in PARTS) + " |")


if __name__ == "__main__":
    main()
