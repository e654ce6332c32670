"""Reduced precision on the real model: does conversion keep the kept heads, and does decoding
hold in bf16? Writes docs/results/precision.json and docs/results/precision.md.

Two measurements on SmolLM2-135M and real text (the start of WikiText-2 test), both with
teacher forcing (the same real tokens fed to both paths):

- `empty_spec`: the model loaded in each dtype, converted with nothing replaced; the max
  absolute logit difference to the original and the share of positions whose top-1 token
  changed, over `--context` tokens.
- `decode`: in `--dtype`, the original and the model converted at `--beta` with each mixer
  kind (the scores in docs/results/smollm2-135m-scores.json, init "reuse", untrained):
  prefill `--prompt` tokens, then decode `--decode` tokens one at a time with the cache,
  against one full forward of the same tokens without a cache, and both against the full
  forward of the same weights in fp32. Max absolute logit difference, mean absolute
  difference, top-1 agreement over all positions, and the cache's bytes at the end.

Each invocation is one run, stored under `--label` beside earlier runs in the JSON (so the
code before a fix and after it can be measured with the same script):

    git archive <commit> src | tar -x -C /tmp/base   # the code before the fix
    PYTHONPATH=/tmp/base/src python -m benchmarks.quality.precision --label before --note "main at <commit>"
    python -m benchmarks.quality.precision --label after
    python -m benchmarks.quality.precision --label "after, bf16 state" --state-dtype bfloat16 --skip-empty-spec
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import recurformer
from recurformer import HeadScores, HybridCache, MixerConfig, ReplacementSpec, convert, make_scorer, select_heads
from recurformer.cache import CACHE_ARGUMENT

from benchmarks.common import HELD_OUT, RESULTS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KINDS = ("mamba", "mamba2", "window")


def text_ids(tokenizer, path: Path, count: int) -> torch.Tensor:
    """The first `count` tokens of `path` `[1, count]`."""
    ids = tokenizer(path.read_text()[: count * 12], return_tensors="pt").input_ids[:, :count]
    if ids.shape[1] < count:
        raise SystemExit(f"error: {path} has fewer than {count} tokens")
    return ids


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Logits `[1, T, V]` of two paths: max and mean absolute difference, top-1 agreement."""
    a, b = a.float(), b.float()
    return {
        "max_abs_diff": (a - b).abs().max().item(),
        "mean_abs_diff": (a - b).abs().mean().item(),
        "top1_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
    }


@torch.no_grad()
def empty_spec(model_dir: str, ids: torch.Tensor, dtypes: list[str]) -> dict:
    out = {}
    for name in dtypes:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[name]).eval()
        text = model.config
        converted = convert(model, ReplacementSpec.empty(text.num_hidden_layers, text.num_key_value_heads))
        row = compare(converted(ids, use_cache=False).logits, model(ids).logits)
        row["top1_changed"] = 1 - row.pop("top1_agreement")
        row["inv_freq_dtype"] = str(converted.model.rotary_emb.inv_freq.dtype).removeprefix("torch.")
        out[name] = row
        print(f"empty spec, {name}: {row}", flush=True)
    return out


@torch.no_grad()
def decode_drift(model, ids: torch.Tensor, prompt: int, cache) -> dict:
    """Prefill `prompt` tokens, decode the rest one at a time; compared with one full forward
    (`decode_vs_full`), and both with the full forward of the same weights upcast to fp32
    (`decode_vs_fp32`, `forward_vs_fp32`): an untrained converted model amplifies rounding
    far more than the original, and only the excess of decode over forward is decoding's."""
    full = model(ids, use_cache=False).logits
    start = time.perf_counter()
    steps = [model(ids[:, :prompt], **{CACHE_ARGUMENT: cache}, use_cache=True).logits]
    for t in range(prompt, ids.shape[1]):
        steps.append(model(ids[:, t : t + 1], **{CACHE_ARGUMENT: cache}, use_cache=True).logits)
    seconds = time.perf_counter() - start
    decoded = torch.cat(steps, dim=1)
    reference = copy.deepcopy(model).float()(ids, use_cache=False).logits
    row = {"decode_vs_full": compare(decoded, full), "decode_vs_fp32": compare(decoded, reference),
           "forward_vs_fp32": compare(full, reference), "seconds": seconds}
    if isinstance(cache, HybridCache):
        sizes = cache.nbytes()
        row["kv_bytes"], row["state_bytes"] = sizes["kv"], sizes["mixer_state"]
        states = [t for layer in cache.layers for t in (layer.mixer_state or {}).values() if t.is_floating_point()]
        row["state_dtypes"] = sorted({str(t.dtype).removeprefix("torch.") for t in states})
    else:
        row["kv_bytes"], row["state_bytes"] = sum(t.numel() * t.element_size() for l in cache.layers for t in (l.keys, l.values)), 0
    return row


def decode(model_dir: str, ids: torch.Tensor, args) -> dict:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[args.dtype]).eval()
    spec = select_heads(HeadScores.load(args.scores), beta=args.beta, scorer=make_scorer("recency"))
    out = {"original": decode_drift(model, ids, args.prompt, DynamicCache())}
    print(f"decode, original: {out['original']}", flush=True)
    extra = {} if args.state_dtype is None else {"state_dtype": args.state_dtype}
    for kind in KINDS:
        converted = convert(model, spec, MixerConfig(kind=kind, **extra), init="reuse")
        out[kind] = decode_drift(converted, ids, args.prompt, HybridCache(model.config.num_hidden_layers))
        print(f"decode, {kind}: {out[kind]}", flush=True)
    return out


def commit(path: Path) -> str:
    """The commit (and '+dirty') of the recurformer code being measured."""
    def git(*cmd):
        return subprocess.run(["git", "-C", str(path), *cmd], capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown (not a git checkout; see the note)"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def render(result: dict) -> str:
    s = result["settings"]
    lines = [
        "# Reduced precision on SmolLM2-135M",
        "",
        "Written by `benchmarks/precision.py` (see its docstring and `docs/precision.md`). Real text: the "
        f"start of `{s['data']}`. Each run measured the code at the commit shown.",
        "",
        f"## Converting with an empty spec ({s['context']:,} tokens)",
        "",
        "Nothing replaced: the converted model must give the original's logits exactly.",
        "",
        "| run | dtype | max abs logit diff | top-1 changed | rotary inv_freq |",
        "|---|---|---|---|---|",
    ]
    for label, run in result["runs"].items():
        for dtype, row in run.get("empty_spec", {}).items():
            lines.append(f"| {label} | {dtype} | {row['max_abs_diff']:.3g} | {row['top1_changed']:.2%} | {row['inv_freq_dtype']} |")
    lines += [
        "",
        f"## Decode drift in {s['dtype']}: prefill {s['prompt']} tokens, then {s['decode']:,} one at a time",
        "",
        f"All {s['prompt'] + s['decode']:,} positions. Converted at beta {s['beta']} with `{s['scores']}`, init reuse, "
        "untrained. *decode vs full*: the cached path against one full forward in the same dtype. *vs fp32*: "
        "each path against the full forward of the same weights upcast to fp32; decoding is as good as the "
        "forward when its columns match the forward's. Max / mean absolute logit difference, top-1 agreement.",
        "",
        "| run | model | state dtype | decode vs full | decode vs fp32 | forward vs fp32 | KV bytes | state bytes |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def cell(c: dict) -> str:
        return f"{c['max_abs_diff']:.3g} / {c['mean_abs_diff']:.3g} / {c['top1_agreement']:.1%}"

    for label, run in result["runs"].items():
        for model, row in run.get("decode", {}).items():
            states = ", ".join(row.get("state_dtypes", [])) or "-"
            lines.append(
                f"| {label} | {model} | {states} | {cell(row['decode_vs_full'])} | {cell(row['decode_vs_fp32'])} | "
                f"{cell(row['forward_vs_fp32'])} | {row['kv_bytes']:,} | {row['state_bytes']:,} |"
            )
    lines += ["", "Runs: " + "; ".join(f"`{label}`: commit {run['commit']}, {run['note']}" for label, run in result["runs"].items()), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True, help="name of this run in the results (e.g. before, after)")
    parser.add_argument("--note", default="", help="free text stored with the run")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--scores", default=str(RESULTS / "smollm2-135m-scores.json"))
    parser.add_argument("--data", default=str(HELD_OUT))
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="dtype of the decode measurement")
    parser.add_argument("--state-dtype", choices=sorted(DTYPES), help="MixerConfig.state_dtype (default: the code's default)")
    parser.add_argument("--context", type=int, default=2048, help="tokens of the empty-spec comparison")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--decode", type=int, default=1024)
    parser.add_argument("--skip-empty-spec", action="store_true")
    parser.add_argument("--json", default=str(RESULTS / "precision.json"))
    parser.add_argument("--md", default=str(RESULTS / "precision.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # a quality measurement: threads change nothing but the time

    model_dir = recurformer.resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = Path(args.data)
    settings = {"model": args.model, "data": data.name, "scores": Path(args.scores).name, "beta": args.beta,
                "dtype": args.dtype, "context": args.context, "prompt": args.prompt, "decode": args.decode}
    path = Path(args.json)
    result = json.loads(path.read_text()) if path.is_file() else {"settings": settings, "runs": {}}
    if result["settings"] != settings:
        raise SystemExit(f"error: {path} holds runs with other settings {result['settings']}; use another --json")

    run = {"commit": commit(Path(recurformer.__file__).parent), "note": args.note, "torch": torch.__version__}
    if not args.skip_empty_spec:
        run["empty_spec"] = empty_spec(model_dir, text_ids(tokenizer, data, args.context), ["float32", "bfloat16", "float16"])
    run["decode"] = decode(model_dir, text_ids(tokenizer, data, args.prompt + args.decode), args)
    result["runs"][args.label] = run
    path.write_text(json.dumps(result, indent=1) + "\n")
    Path(args.md).write_text(render(result))
    print(f"wrote {path} and {args.md}", file=sys.stderr)


if __name__ == "__main__":
    main()
