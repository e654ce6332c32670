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

Writes docs/results/operator-calls.json and .md.

    python -m benchmarks.speed.operator_calls [--lengths 8192,32768]
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

from benchmarks.common import RESULTS
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


class Calls(TorchDispatchMode):
    """Counts the operator calls made under it, by name."""

    def __init__(self):
        super().__init__()
        self.names: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func._schema.name] += 1
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict:
        kernels_ = sum(n for name, n in self.names.items() if name not in VIEWS)
        return {"calls": sum(self.names.values()), "not_views": kernels_}


def layer_models(length: int, window: int) -> tuple[LlamaForCausalLM, torch.nn.Module]:
    """One-layer original and its conversion (one of two KV groups replaced by window+mamba2)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(length, window) + 16)
    config._attn_implementation = "sdpa"
    original = LlamaForCausalLM(config).eval()
    mixer = MixerConfig(kind="window+mamba2", window=window, sinks=4, ssd_state=8)
    return original, convert(original, ReplacementSpec(1, 2, [(0, 1)]), mixer, init="random").eval()


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
def decode_step_calls(window: int, after: int = 300) -> dict:
    """Calls of one static decode step after `after` tokens, for both models (its count does not
    depend on `after`)."""
    original, converted = layer_models(after, window)
    step_ids, step_positions = torch.ones(1, 1, dtype=torch.long), torch.full((1, 1), after)
    static = StaticCache(config=original.config, max_cache_len=after + 8)
    original(torch.randint(1, 97, (1, after)), use_cache=True, **{CACHE_ARGUMENT: static})
    hybrid = HybridCache(1)
    converted(torch.randint(1, 97, (1, after)), **{CACHE_ARGUMENT: hybrid})
    hybrid.make_static(after + 8, torch.tensor([0]))
    with Calls() as original_calls:
        original(input_ids=step_ids, position_ids=step_positions, use_cache=True, **{CACHE_ARGUMENT: static})
    with Calls() as converted_calls:
        static_step(converted, step_ids, step_positions, hybrid)
    return {"original": original_calls.summary(), "conversion": converted_calls.summary()}


def table(results: dict) -> str:
    lines = ["| what | original: calls (not views) | conversion: calls (not views) |", "|---|---|---|"]
    for length, rows in results["prefill"].items():
        cells = [f"{rows[m]['calls']:,} ({rows[m]['not_views']:,})" for m in ("original", "conversion")]
        lines.append(f"| prefill of {int(length):,} tokens | {cells[0]} | {cells[1]} |")
    step = results["decode_step"]
    cells = [f"{step[m]['calls']:,} ({step[m]['not_views']:,})" for m in ("original", "conversion")]
    lines.append(f"| one static decode step | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8192,32768", type=lambda t: [int(v) for v in t.split(",") if v])
    parser.add_argument("--window", type=int, default=141)
    parser.add_argument("--out", type=Path, default=RESULTS / "operator-calls.json")
    args = parser.parse_args(argv)
    if not args.lengths or min(args.lengths) < 1 or args.window < 1:
        raise SystemExit("error: --lengths and --window must be positive")
    os.environ[kernels.ENV] = "torch"
    kernels.reset()
    torch.set_num_threads(1)
    results = {"window": args.window, "prefill": {}, "decode_step": decode_step_calls(args.window),
               "torch": torch.__version__}
    for length in args.lengths:
        results["prefill"][str(length)] = prefill_calls(length, args.window)
        print(f"{length}: {results['prefill'][str(length)]}", flush=True)
    text = (f"# Operator calls of one layer\n\n`python -m benchmarks.speed.operator_calls` (PyTorch paths, window "
            f"{args.window} + 4 sinks, beta 0.5 in a one-layer tiny Llama; torch {torch.__version__}).\n\n"
            f"{table(results)}\n")
    try:
        write_json_atomic(args.out, results)
        write_text_atomic(args.out.with_suffix(".md"), text)
    except OutputError as error:
        raise SystemExit(f"error: {error}") from None
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
