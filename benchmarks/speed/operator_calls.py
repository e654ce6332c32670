"""Operator calls of one layer, the conversion against the original: a prefill at several
lengths and one static decode step, with the PyTorch paths (`RECURFORMER_KERNELS=torch`: the
code a GPU runs where Triton and flash-linear-attention are not, less the kernels they
replace). On a GPU each call that is not a view is a kernel launch, and a step or a prefill
of an 8B-class model is bound by its launches long before its arithmetic
(`docs/results/gpu.md`); on the CPU each costs a few microseconds of the host. A count, not
a timing: it runs on any machine, beside anything.

One decoder layer of a tiny Llama (4 query heads, 2 KV groups), converted at beta 0.5
(one group replaced) with `window+mamba2` at `run`'s SmolLM2 window (141 + 4 sinks): the
counts depend on the layer's structure, the window and the scan's chunk, not on its sizes.

Where Triton is installed, the static decode step is counted again as a GPU runs it: our
Triton kernels (the decode attention, the cache write, the ring-buffer step, the mamba2
step) run through Triton's interpreter on the CPU (a subprocess: the interpreter is chosen
when a kernel is defined), each launch counted once and the interpreter's own calls not at
all; for the original with transformers' SDPA (what its users run) and with our split-key
kernel (the GPU benchmark's `graphs-split` baseline); at one and two layers, which gives
the calls per layer and per step besides, and so a 32-layer (8B-shaped) step.

Writes docs/results/operator-calls.json and .md.

    python -m benchmarks.speed.operator_calls [--lengths 8192,32768]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

from benchmarks.common import RESULTS, ROOT
from benchmarks.speed.gpu import SPLIT  # registers our split-key kernel as a transformers attention
from recurformer.cache import CACHE_ARGUMENT, HybridCache
from recurformer.config import ReplacementSpec
from recurformer.decode_graph import static_step
from recurformer.files import OutputError, write_json_atomic, write_text_atomic
from recurformer.mixers import MixerConfig
from recurformer.ops import kernels
from recurformer.surgery import convert

# Calls that only describe a tensor anew (no kernel on a GPU).
VIEWS = {"aten::view", "aten::_unsafe_view", "aten::reshape", "aten::transpose", "aten::unsqueeze", "aten::squeeze",
         "aten::expand", "aten::slice", "aten::select", "aten::t", "aten::permute", "aten::as_strided", "aten::alias",
         "aten::detach", "aten::split", "aten::split_with_sizes", "aten::unbind", "aten::chunk", "aten::narrow",
         "aten::unflatten", "aten::flatten", "aten::movedim", "aten::lift_fresh"}


# Calls that allocate and launch nothing (a CUDA graph takes its memory from its pool).
ALLOCATIONS = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty"}


class Calls(TorchDispatchMode):
    """Counts the operator calls made under it, by name; a Triton kernel launched under it
    (`launched`) counts as one call, its interpreter's own calls as none."""

    active: Calls | None = None  # the mode counting now, if any

    def __init__(self):
        super().__init__()
        self.names: Counter[str] = Counter()
        self.paused = False

    def __enter__(self):
        Calls.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        Calls.active = None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.names[func._schema.name] += 1
        return func(*args, **(kwargs or {}))

    def launched(self, kernel: str, run):
        """`run()`, a launch of Triton `kernel` in the interpreter, counted as one call."""
        self.names[f"triton::{kernel}"] += 1
        self.paused = True
        try:
            return run()
        finally:
            self.paused = False

    def summary(self) -> dict:
        kernels_ = sum(n for name, n in self.names.items() if name not in VIEWS)
        launches = sum(n for name, n in self.names.items() if name not in VIEWS and name not in ALLOCATIONS)
        return {"calls": sum(self.names.values()), "not_views": kernels_, "launches": launches}


def layer_models(length: int, window: int, layers: int = 1) -> tuple[LlamaForCausalLM, torch.nn.Module]:
    """A tiny original of `layers` layers and its conversion (in each layer one of two KV
    groups replaced by window+mamba2)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(length, window) + 16)
    config._attn_implementation = "sdpa"
    original = LlamaForCausalLM(config).eval()
    mixer = MixerConfig(kind="window+mamba2", window=window, sinks=4, ssd_state=8)
    spec = ReplacementSpec(layers, 2, [(layer, 1) for layer in range(layers)])
    return original, convert(original, spec, mixer, init="random").eval()


@torch.no_grad()
def prefill_calls(length: int, window: int) -> dict:
    """Calls of a prefill of `length` tokens, for both models."""
    original, converted = layer_models(length, window)
    ids = torch.randint(1, 97, (1, length))
    rows = {}
    for name, model, cache in (("original", original, None), ("conversion", converted, HybridCache(1))):
        with Calls() as calls:
            model(ids, use_cache=True, logits_to_keep=1, **({} if cache is None else {CACHE_ARGUMENT: cache}))
        rows[name] = calls.summary()
    return rows


@torch.no_grad()
def decode_step_calls(window: int, after: int = 300, layers: int = 1, split: bool = False) -> dict:
    """Calls of one static decode step after `after` tokens, for both models (its count does not
    depend on `after`); `split`: the original's attention through our split-key kernel too
    (`original-split`)."""
    original, converted = layer_models(after, window, layers)
    step_ids, step_positions = torch.ones(1, 1, dtype=torch.long), torch.full((1, 1), after)
    rows = {}
    for name, implementation in (("original", "sdpa"), *((("original-split", SPLIT),) if split else ())):
        original.config._attn_implementation = implementation
        static = StaticCache(config=original.config, max_cache_len=after + 8)
        original(torch.randint(1, 97, (1, after)), use_cache=True, **{CACHE_ARGUMENT: static})
        with Calls() as calls:
            original(input_ids=step_ids, position_ids=step_positions, use_cache=True, **{CACHE_ARGUMENT: static})
        rows[name] = calls.summary()
    hybrid = HybridCache(layers)
    converted(torch.randint(1, 97, (1, after)), **{CACHE_ARGUMENT: hybrid})
    hybrid.make_static(after + 8, torch.tensor([0]))
    with Calls() as converted_calls:
        static_step(converted, step_ids, step_positions, hybrid)
    return {**rows, "conversion": converted_calls.summary()}


GPU_MODELS = ("original", "original-split", "conversion")


def gpu_step_launches(window: int) -> dict:
    """The static decode step's launches on a GPU's paths (module docstring), counted in
    Triton's interpreter: per layer, per step besides the layers, and for 32 layers."""
    from triton.runtime.interpreter import InterpretedFunction

    from recurformer.ops import triton_kernels

    triton_kernels.interpret_on_the_cpu()
    launch = InterpretedFunction.run

    def counted_launch(self, *args, **kwargs):
        if Calls.active is None:
            return launch(self, *args, **kwargs)
        return Calls.active.launched(self.__name__, lambda: launch(self, *args, **kwargs))

    InterpretedFunction.run = counted_launch
    one, two = (decode_step_calls(window, layers=n, split=True) for n in (1, 2))
    if triton_kernels._failed:
        raise SystemExit(f"error: a Triton kernel failed in the interpreter: {triton_kernels._failed}")
    launches = {}
    for model in GPU_MODELS:
        per_layer = two[model]["launches"] - one[model]["launches"]
        besides = one[model]["launches"] - per_layer
        launches[model] = {"per_layer": per_layer, "besides_layers": besides, "layers_32": besides + 32 * per_layer}
    return launches


def gpu_step_launches_in_interpreter(window: int) -> dict | None:
    """`gpu_step_launches` in a subprocess with Triton's interpreter; None where Triton is not installed."""
    if importlib.util.find_spec("triton") is None:
        return None
    done = subprocess.run([sys.executable, "-m", "benchmarks.speed.operator_calls", "--gpu-step", "--window",
                           str(window)], env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"error: counting the GPU paths failed: {(done.stderr.strip().splitlines() or [''])[-1]}")
    return json.loads(done.stdout.splitlines()[-1])


def table(results: dict) -> str:
    lines = ["| what | original: calls (not views) | conversion: calls (not views) |", "|---|---|---|"]
    for length, rows in results["prefill"].items():
        cells = [f"{rows[m]['calls']:,} ({rows[m]['not_views']:,})" for m in ("original", "conversion")]
        lines.append(f"| prefill of {int(length):,} tokens | {cells[0]} | {cells[1]} |")
    step = results["decode_step"]
    cells = [f"{step[m]['calls']:,} ({step[m]['not_views']:,})" for m in ("original", "conversion")]
    lines.append(f"| one static decode step | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def gpu_table(launches: dict | None) -> str:
    """The launches of a static decode step on the GPU's paths, or why they were not counted."""
    if launches is None:
        return "The GPU paths' launches were not counted: Triton is not installed here."
    intro = ("A static decode step as a GPU runs it: kernel launches (operator calls that neither view nor only "
             "allocate, and our Triton kernels' launches, counted once each in Triton's interpreter).")
    lines = [intro, "", "| | original, transformers' SDPA | original, our split-key kernel | conversion |",
             "|---|---|---|---|"]
    for key, what in (("per_layer", "per layer"), ("besides_layers", "per step besides the layers"),
                      ("layers_32", "a step of 32 layers (8B-shaped)")):
        lines.append(f"| {what} | " + " | ".join(f"{launches[m][key]:,}" for m in GPU_MODELS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8192,32768", type=lambda t: [int(v) for v in t.split(",") if v])
    parser.add_argument("--window", type=int, default=141)
    parser.add_argument("--out", type=Path, default=RESULTS / "operator-calls.json")
    parser.add_argument("--gpu-step", action="store_true", help=argparse.SUPPRESS)  # the interpreter's subprocess
    args = parser.parse_args(argv)
    if not args.lengths or min(args.lengths) < 1 or args.window < 1:
        raise SystemExit("error: --lengths and --window must be positive")
    os.environ[kernels.ENV] = "torch"
    kernels.reset()
    torch.set_num_threads(1)
    if args.gpu_step:
        print(json.dumps(gpu_step_launches(args.window)))
        return
    results = {"window": args.window, "prefill": {}, "decode_step": decode_step_calls(args.window),
               "gpu_step_launches": gpu_step_launches_in_interpreter(args.window), "torch": torch.__version__}
    for length in args.lengths:
        results["prefill"][str(length)] = prefill_calls(length, args.window)
        print(f"{length}: {results['prefill'][str(length)]}", flush=True)
    text = (f"# Operator calls of one layer\n\n`python -m benchmarks.speed.operator_calls` (PyTorch paths, window "
            f"{args.window} + 4 sinks, beta 0.5 in a one-layer tiny Llama; torch {torch.__version__}).\n\n"
            f"{table(results)}\n\n{gpu_table(results['gpu_step_launches'])}\n")
    try:
        write_json_atomic(args.out, results)
        write_text_atomic(args.out.with_suffix(".md"), text)
    except OutputError as error:
        raise SystemExit(f"error: {error}") from None
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
