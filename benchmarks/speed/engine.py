"""The conversion against the original in one patched llama.cpp build (issue 62, docs/engine.md).

Makes the GGUFs first (cached in `--work`): SmolLM2-135M, and its default conversions at beta
0.5 and 0.75 (the groups the example run's scores pick, docs/results/example-run/scores.json;
the window+mamba2 mixer, untrained: speed and memory do not depend on the weights' values, and
the tail is computed whatever its gate), each at F32 and Q8_0 through `recurformer export`.
Then, on `--threads` threads, one model at a time, flash attention on for every row:

- decode tokens/s of `--decode` tokens after 512, 2,048, 4,096 and 8,150 tokens (`llama-bench -d`);
- prefill seconds of 8,150 tokens (`llama-bench -p`);
- the engine's own report of its KV cache and recurrent state at an 8,192-token context
  (the `llama_kv_cache` / `llama_memory_recurrent` lines `llama-completion` logs);
- held-out perplexity (8 chunks of 512 tokens, 3 of 2,048 and 2 of 4,096, `llama-perplexity`)
  at F32, F16, Q8_0 and `llama-quantize`'s Q4_K_M, beside PyTorch's under the same protocol, for
  these models and, with `--trained DIR`, a trained conversion (`--perplexity-only` measures
  this table alone into an existing engine.json); with `--trained`, also the trained
  conversion's Q4_K_M with the new tensors' types chosen each way of QUANT_CHOICES;
- decode tokens/s of 16 sequences together, 128 tokens each after one shared 4,096-token prompt
  in a unified cache (`llama-batched-bench -pps -kvu`: its S_TG, all sequences' tokens), Q8_0.

Past SmolLM2's 8K (unless `--no-long`): a random-weight model of Qwen2.5-0.5B's shape (32K
positions, its 151,936-token vocabulary; SmolLM2's tokenizer, padded by the converter,
`benchmarks/gguf_converter_shim.py`) and its window+mamba2 conversions at the same betas (groups drawn at random with a seed), at
Q8_0: decode tokens/s after 16,384 and 32,736 tokens (one repetition: each is a prefill of
that many tokens first) and the engine's KV + state at a 32,768-token context.

Each model's row is kept in `--work` as it is measured, so an interrupted run goes on where it
stopped (delete `--work`/rows to measure again).

Each conversion's ratio to the original of the same weight type comes with its limit from
bytes: what a decode step reads (weights, the kept heads' cache over the whole context, the
window heads' cache over their window) for the original over the same for the conversion.

    python -m benchmarks.speed.engine [--engine .engine] [--work runs/engine-bench] [--quick] [--no-long]

Writes docs/results/engine.json and prints the markdown of docs/results/engine.md.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path

from recurformer.checks import read_json_object
from recurformer.files import write_json_atomic

from benchmarks.common import HELD_OUT, RESULTS, ROOT, random_spec
from benchmarks.speed.llama_cpp import llama_bench

SCORES = RESULTS / "example-run" / "scores.json"
BETAS = (0.5, 0.75)
TYPES = ("f32", "q8_0")
# the perplexity table's: also F16 and llama-quantize's Q4_K_M
PPL_TYPES = ("f32", "f16", "q8_0", "q4_k_m")
CONTEXTS = (512, 2048, 4096, 8150)
PREFILL = 8150
MEMORY_CONTEXT = 8192
BATCH = dict(sequences=16, prompt=4096, generate=128)
PPL_CONTEXT, PPL_CHUNKS = 512, 8  # llama-perplexity's chunks of held-out text
# the table's chunkings: 2,048 and 4,096 tokens wrap the window cache (768 cells at llama-perplexity's ubatch)
PPL_CHUNKINGS = ((512, 8), (2048, 3), (4096, 2))
LONG = dict(shape="qwen2.5-0.5b", type="q8_0", contexts=(16384, 32736), memory_context=32768)


def model_names() -> list[str]:
    return ["original", *(f"beta{beta}" for beta in BETAS)]


def default_conversion(model, beta: float):
    """SmolLM2-135M's default conversion at `beta`: the groups the example run's scores pick,
    replaced by the default mixer (window+mamba2), untrained."""
    from recurformer.mixers import MixerConfig
    from recurformer.scoring import HeadScores, select_heads
    from recurformer.surgery import convert

    return convert(model, select_heads(HeadScores.load(SCORES), beta), MixerConfig())


def quantize_q4_k_m(engine: Path, f32: Path, out: Path, *options: str) -> None:
    """`llama-quantize` of `f32` to Q4_K_M into `out` (written under a staging name, then renamed);
    `options`: its own (`--tensor-type NAME=TYPE`, ...)."""
    staging = out.with_suffix(".tmp")
    subprocess.run([str(engine / "build" / "bin" / "llama-quantize"), *options, str(f32), str(staging), "Q4_K_M", "2"],
                   check=True, capture_output=True)
    staging.replace(out)


def model_sources(work: Path) -> dict[str, str]:
    """name -> what `recurformer export` reads: the original's name and the untrained
    conversions, saved once into `work`."""
    from recurformer.loading import load_model

    work.mkdir(parents=True, exist_ok=True)
    sources = {"original": "smollm2-135m"}
    model = tokenizer = None
    for beta in BETAS:
        folder = work / f"beta{beta}"
        if not (folder / "config.json").exists():
            if model is None:
                model, tokenizer, _ = load_model("smollm2-135m", progress=False)
            default_conversion(model, beta).save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        sources[f"beta{beta}"] = str(folder)
    return sources


def make_ggufs(work: Path, sources: dict[str, str], types=TYPES, engine: Path | None = None) -> dict[tuple[str, str], Path]:
    """(name, type) -> GGUF, made once into `work`: `recurformer export` for f32, f16 and q8_0,
    `llama-quantize` of the F32 file for q4_k_m (its own choice of type per tensor)."""
    from recurformer.export import export_command

    ggufs = {}
    for name, source in sources.items():
        for out_type in sorted(types, key=lambda t: t != "f32"):  # F32 first: Q4_K_M is made from it
            path = work / f"{name}-{out_type}.gguf"
            if not path.exists() and out_type == "q4_k_m":
                quantize_q4_k_m(engine, ggufs[name, "f32"], path)
            elif not path.exists():
                export_command(source, str(path), out_type)
            ggufs[name, out_type] = path
    return ggufs


def long_config():
    """Qwen2.5-0.5B's published shape (transformers' Qwen2Config)."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False)


def make_long_ggufs(work: Path) -> dict[str, Path]:
    """name -> LONG's GGUF of the random-weight original and its conversions, exported once into `work`."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from recurformer.export import export_command
    from recurformer.hub import resolve_model
    from recurformer.mixers import MixerConfig
    from recurformer.surgery import convert

    from benchmarks.gguf_converter_shim import unknown_tokenizer_converter

    folder = work / LONG["shape"]
    sources = {name: folder / name for name in model_names()}
    if not all((source / "config.json").exists() for source in sources.values()):
        torch.manual_seed(0)
        original = Qwen2ForCausalLM(long_config()).eval()
        tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
        for name, source in sources.items():
            model = original if name == "original" else convert(original, random_spec(original.config, float(
                name.removeprefix("beta"))), MixerConfig())
            model.save_pretrained(source)
            tokenizer.save_pretrained(source)
    ggufs = {}
    for name, source in sources.items():
        path = folder / f"{name}-{LONG['type']}.gguf"
        if not path.exists():
            with unknown_tokenizer_converter():
                export_command(str(source), str(path), LONG["type"])
        ggufs[name] = path
    return ggufs


def measure_long(engine: Path, ggufs: dict, work: Path, threads: int, decode: int) -> list[dict]:
    """One row per LONG GGUF (kept in `work` as measured): decode after each of LONG's contexts
    (one repetition), the step's bytes, the engine's KV + state at LONG's memory context."""
    kept = path_of_rows(work, False)
    rows = []
    for name, path in ggufs.items():
        done = kept / f"{LONG['shape']}-{name}.json"
        if not done.exists():
            layout = gguf_layout(path)
            print(f"{LONG['shape']} {name}: decode after {LONG['contexts']}", file=sys.stderr, flush=True)
            records = llama_bench(str(engine / "build" / "bin" / "llama-bench"), str(path), threads, 1, "-p", "0",
                                  "-n", str(decode), "-d", ",".join(map(str, LONG["contexts"])), "-fa", "1")
            write_json_atomic(done, {
                "model": name, "type": LONG["type"], "file_bytes": path.stat().st_size, "layout": layout,
                "decode_tokens_per_s": {r["n_depth"]: r["avg_ts"] for r in records},
                "step_bytes": {c: step_bytes(path, layout, c) for c in LONG["contexts"]},
                "memory": memory_report(engine / "build" / "bin" / "llama-completion", path, threads,
                                        LONG["memory_context"]),
            })
        rows.append(json.loads(done.read_text(), object_hook=int_keys))
    return rows


def gguf_layout(path: Path) -> dict:
    """What a decode step's attention reads, from the GGUF's keys: the KV groups on the full
    cache (`kept_groups`) and on the window (`window_groups`), summed over the layers, the
    window and its sinks, head_dim. A stock architecture keeps every group."""
    import gguf  # the reader reads any architecture's keys

    keys = {name: field.contents() for name, field in gguf.GGUFReader(path).fields.items()}
    arch = keys["general.architecture"]

    def summed(key: str) -> int:
        value = keys.get(f"{arch}.{key}", 0)
        return sum(value) if isinstance(value, list) else value * keys[f"{arch}.block_count"]

    heads = keys[f"{arch}.attention.head_count"]
    head_dim = keys.get(f"{arch}.attention.key_length") or keys[f"{arch}.embedding_length"] // (
        max(heads) if isinstance(heads, list) else heads)
    return {"layers": keys[f"{arch}.block_count"], "kept_groups": summed("attention.head_count_kv"),
            "window_groups": summed("mixer.head_count_kv"), "head_dim": head_dim,
            "window": keys.get(f"{arch}.attention.sliding_window", 0),
            "sinks": keys.get(f"{arch}.attention.sliding_window_sinks", 0)}


def step_bytes(path: Path, layout: dict, context: int, cache_bytes: int = 2) -> int:
    """What one decode step reads after `context` tokens: the weights, then K and V (F16 by
    default) of the kept groups over the context and of the window groups over their window."""
    per_group_token = 2 * layout["head_dim"] * cache_bytes
    window = min(context, layout["window"] + layout["sinks"])
    return (path.stat().st_size + per_group_token * layout["kept_groups"] * context
            + per_group_token * layout["window_groups"] * window)


def memory_report(binary: Path, gguf: Path, threads: int, context: int = MEMORY_CONTEXT) -> dict:
    """MiB of the KV caches and of the recurrent state, as the engine logs them at `context`."""
    done = subprocess.run([str(binary), "-m", str(gguf), "-c", str(context), "-n", "1", "-p", "Hello",
                           "-t", str(threads), "-fa", "on", "-no-cnv", "--no-warmup", "-v", "-fit", "off"],
                          capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    kv = [float(m) for m in re.findall(r"llama_kv_cache: size = +([0-9.]+) MiB", log)]
    state = [float(m) for m in re.findall(r"llama_memory_recurrent: size = +([0-9.]+) MiB", log)]
    if not kv:
        raise RuntimeError(f"no KV cache size in the log of {gguf.name}: {log[-2000:]}")
    return {"kv_mib": sum(kv), "kv_caches_mib": kv, "state_mib": sum(state), "total_mib": sum(kv) + sum(state)}


def batched(binary: Path, gguf: Path, threads: int) -> dict:
    """Total tokens/s of BATCH's sequences after one shared prompt (llama-batched-bench -pps)."""
    n, prompt, generate = BATCH["sequences"], BATCH["prompt"], BATCH["generate"]
    done = subprocess.run([str(binary), "-m", str(gguf), "-c", str(prompt + n * generate + 256), "-b", "2048",
                           "-ub", "512", "-npp", str(prompt), "-ntg", str(generate), "-npl", str(n), "-pps", "-kvu",
                           "-t", str(threads), "-fa", "on", "--output-format", "jsonl"],
                          capture_output=True, text=True, timeout=3600, check=True)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if not rows:
        raise RuntimeError(f"llama-batched-bench measured nothing on {gguf.name}: {done.stderr[-2000:]}")
    return {k: rows[-1][k] for k in ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")}


def measure(engine: Path, ggufs: dict, work: Path, threads: int, repetitions: int, decode: int,
            contexts: tuple[int, ...], quick: bool) -> list[dict]:
    """One row per GGUF, each kept in `work` as it is measured (a kept row is not measured again)."""
    bench = engine / "build" / "bin" / "llama-bench"
    kept = path_of_rows(work, quick)
    rows = []
    for (name, out_type), path in ggufs.items():
        done = kept / f"{name}-{out_type}.json"
        if done.exists():
            rows.append(json.loads(done.read_text(), object_hook=int_keys))
            continue
        layout = gguf_layout(path)
        print(f"{name} {out_type}: decode", file=sys.stderr, flush=True)
        records = llama_bench(str(bench), str(path), threads, repetitions, "-p", "0", "-n", str(decode),
                              "-d", ",".join(map(str, contexts)), "-fa", "1")
        decode_rows = {r["n_depth"]: r for r in records}
        print(f"{name} {out_type}: prefill", file=sys.stderr, flush=True)
        prefill = llama_bench(str(bench), str(path), threads, repetitions, "-p", str(PREFILL if not quick else 1024),
                              "-n", "0", "-fa", "1")[0]
        row = {
            "model": name, "type": out_type, "file_bytes": path.stat().st_size, "layout": layout,
            "decode_tokens_per_s": {c: decode_rows[c]["avg_ts"] for c in contexts},
            "decode_tokens_per_s_stddev": {c: decode_rows[c]["stddev_ts"] for c in contexts},
            "step_bytes": {c: step_bytes(path, layout, c) for c in contexts},
            "prefill_tokens": prefill["n_prompt"], "prefill_s": prefill["n_prompt"] / prefill["avg_ts"],
            "memory": memory_report(engine / "build" / "bin" / "llama-completion", path, threads),
            "build": {k: records[0].get(k) for k in ("build_commit", "build_number", "cpu_info")},
        }
        if out_type == "q8_0" and not quick:
            print(f"{name} {out_type}: 16 sequences", file=sys.stderr, flush=True)
            row["batched"] = batched(engine / "build" / "bin" / "llama-batched-bench", path, threads)
        write_json_atomic(done, row)
        rows.append(row)
    return rows


def path_of_rows(work: Path, quick: bool) -> Path:
    folder = work / ("rows-quick" if quick else "rows")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def int_keys(obj: dict) -> dict:
    """JSON turns the contexts (int keys) into strings; a kept row gets them back."""
    return {int(k) if k.isdigit() else k: v for k, v in obj.items()}


def perplexity_as_llama_cpp(model, ids: list[int], bos: int | None, context: int = PPL_CONTEXT,
                            chunks: int = PPL_CHUNKS) -> float:
    """A PyTorch model's perplexity under llama-perplexity's protocol: chunks of `context`
    tokens, each starting with BOS when the vocabulary adds one, each scored on its second half."""
    import torch

    nll, count = 0.0, 0
    for chunk in range(chunks):
        tokens = torch.tensor(ids[chunk * context:(chunk + 1) * context])[None]
        if bos is not None:
            tokens[0, 0] = bos
        with torch.no_grad():
            logprobs = torch.log_softmax(model(tokens).logits[0].double(), -1)
        first = context // 2
        targets = tokens[0, first + 1:]
        nll -= logprobs[first:-1].gather(-1, targets[:, None]).sum().item()
        count += len(targets)
    return math.exp(nll / count)


def llama_perplexity(binary: Path, gguf: Path, text: Path, threads: int = 2, context: int = PPL_CONTEXT,
                     chunks: int = PPL_CHUNKS) -> float:
    """llama-perplexity's final estimate on `text` (flash attention off: the cache read as stored)."""
    done = subprocess.run([str(binary), "-m", str(gguf), "-f", str(text), "-c", str(context), "-b", str(context),
                           "--chunks", str(chunks), "-t", str(threads), "-fa", "off"],
                          capture_output=True, text=True, check=True)
    return float(re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr).group(1))


def portable(source: str) -> str:
    """`source` as a results file names it: relative to the checkout where it lies inside it."""
    path = Path(source).resolve()
    return str(path.relative_to(ROOT)) if Path(source).exists() and path.is_relative_to(ROOT) else source


def perplexities(engine: Path, sources: dict[str, str], work: Path, threads: int) -> list[dict]:
    """Held-out perplexity of each model in PyTorch (F32) and in the engine (each of PPL_TYPES),
    same protocol, at each of PPL_CHUNKINGS."""
    from recurformer.loading import load_any

    ggufs = make_ggufs(work, sources, PPL_TYPES, engine)
    text = work / "held-out.txt"
    text.write_text(HELD_OUT.read_text()[:60000])
    rows = []
    for name, source in sources.items():
        model, shown = None, portable(source)
        for context, chunks in PPL_CHUNKINGS:
            # each row kept as it is measured (an interrupted run goes on), under the source it measured
            kept = work / "perplexity" / f"{name}-{context}x{chunks}.json"
            row = read_json_object(kept) if kept.exists() else None
            if row is None or row.get("source") != shown or any(f"engine_{t}" not in row for t in PPL_TYPES):
                if model is None:
                    model, tokenizer = load_any(source)
                    add_bos = bool(getattr(tokenizer, "add_bos_token", False))
                    ids = ([tokenizer.bos_token_id] if add_bos else []) + tokenizer(text.read_text()).input_ids
                row = {"model": name, "source": shown, "context": context, "chunks": chunks,
                       "pytorch_f32": perplexity_as_llama_cpp(model.eval(), ids, tokenizer.bos_token_id if add_bos else None,
                                                              context, chunks)}
                for out_type in PPL_TYPES:
                    row[f"engine_{out_type}"] = llama_perplexity(engine / "build" / "bin" / "llama-perplexity",
                                                                 ggufs[name, out_type], text, threads, context, chunks)
                kept.parent.mkdir(parents=True, exist_ok=True)
                write_json_atomic(kept, row)
            rows.append(row)
    return rows


# Q4_K_M's choices for the new tensors, against the alternatives (llama-quantize --tensor-type):
# the window's V as V (the patch's rule) or as any matrix (upstream's rule for an unknown name), and
# the tail's projections at the file's main type or at q8_0
QUANT_CHOICES = {
    "attn_v_win as attn_v (the patch)": (),
    "attn_v_win as any matrix (q5_0 here)": ("--tensor-type", "attn_v_win=q5_0"),
    "attn_v_win as attn_v, ssm_in and ssm_out q8_0": ("--tensor-type", "ssm_in=q8_0", "--tensor-type", "ssm_out=q8_0"),
}


def quant_choices(engine: Path, f32: Path, work: Path, threads: int, context: int = 4096, chunks: int = 2) -> list[dict]:
    """Held-out perplexity of `f32` quantized to Q4_K_M each way of QUANT_CHOICES, with each file's bytes."""
    text = work / "held-out.txt"
    rows = []
    for name, options in QUANT_CHOICES.items():
        path = work / f"{f32.stem}-choice{len(rows)}.gguf"
        if not path.exists():
            quantize_q4_k_m(engine, f32, path, *options)
        rows.append({"choice": name, "bytes": path.stat().st_size, "context": context, "chunks": chunks,
                     "perplexity": llama_perplexity(engine / "build" / "bin" / "llama-perplexity", path, text, threads,
                                                    context, chunks)})
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Each conversion over the original of its weight type: measured, and the limit from bytes
    (prefill and the 16 sequences where the rows have them: the long rows do not)."""
    originals = {r["type"]: r for r in rows if r["model"] == "original"}
    out = []
    for r in rows:
        if r["model"] == "original":
            continue
        o = originals[r["type"]]
        entry = {"model": r["model"], "type": r["type"],
                 "decode": {c: r["decode_tokens_per_s"][c] / o["decode_tokens_per_s"][c] for c in r["decode_tokens_per_s"]},
                 "decode_limit": {c: o["step_bytes"][c] / r["step_bytes"][c] for c in r["step_bytes"]},
                 "memory": r["memory"]["total_mib"] / o["memory"]["total_mib"]}
        if "prefill_s" in r:
            entry["prefill"] = r["prefill_s"] / o["prefill_s"]
        if "batched" in r and "batched" in o:
            entry["batched"] = r["batched"]["speed_tg"] / o["batched"]["speed_tg"]
        out.append(entry)
    return out


def markdown(data: dict) -> str:
    rows, rel = data["rows"], data["ratios"]
    contexts = list(rows[0]["decode_tokens_per_s"])
    lines = ["| model | weights | " + " | ".join(f"decode @{int(c):,}" for c in contexts)
             + " | prefill s | KV + state MiB @8K |", "|---|---|" + "---|" * (len(contexts) + 2)]
    for r in rows:
        decode = " | ".join(f"{r['decode_tokens_per_s'][c]:.1f}" for c in contexts)
        lines.append(f"| {r['model']} | {r['type'].upper()} | {decode} | {r['prefill_s']:.1f} | "
                     f"{r['memory']['total_mib']:.1f} |")
    lines += ["", "| conversion | weights | " + " | ".join(f"decode @{int(c):,} (limit)" for c in contexts)
              + " | prefill | memory | 16 sequences @4K |", "|---|---|" + "---|" * (len(contexts) + 3)]
    for e in rel:
        decode = " | ".join(f"{e['decode'][c]:.2f}x ({e['decode_limit'][c]:.2f}x)" for c in contexts)
        batch = f"{e['batched']:.2f}x" if "batched" in e else ""
        lines.append(f"| {e['model']} | {e['type'].upper()} | {decode} | {e['prefill']:.2f}x | {e['memory']:.2f}x | {batch} |")
    if "perplexity" in data:
        types = [t for t in PPL_TYPES if f"engine_{t}" in data["perplexity"][0]]
        lines += ["", "| model | chunks | PyTorch F32 | " + " | ".join(f"engine {t.upper()}" for t in types) + " |",
                  "|---|---|---|" + "---|" * len(types)]
        for p in data["perplexity"]:
            chunks = f"{p['chunks']} x {p['context']:,}" if "context" in p else f"{PPL_CHUNKS} x {PPL_CONTEXT}"
            cells = " | ".join(f"{p[f'engine_{t}']:.3f} ({p[f'engine_{t}'] / p['pytorch_f32']:.4f}x)" for t in types)
            lines.append(f"| {p['model']} | {chunks} | {p['pytorch_f32']:.3f} | {cells} |")
    if "quant_choices" in data:
        lines += ["", "Q4_K_M of the trained conversion, the new tensors' types "
                  f"({data['quant_choices'][0]['chunks']} x {data['quant_choices'][0]['context']:,} held-out tokens):", "",
                  "| choice | perplexity | file MiB |", "|---|---|---|"]
        for c in data["quant_choices"]:
            lines.append(f"| {c['choice']} | {c['perplexity']:.3f} | {c['bytes'] / 2**20:.1f} |")
    if "long" in data:
        long = data["long"]
        contexts = list(long["rows"][0]["decode_tokens_per_s"])
        lines += ["", f"{long['shape']} shape, random weights, {long['type'].upper()}:", "",
                  "| model | " + " | ".join(f"decode @{int(c):,}" for c in contexts)
                  + f" | KV + state MiB @{long['memory_context']:,} |", "|---|" + "---|" * (len(contexts) + 1)]
        ratio = {e["model"]: e for e in long["ratios"]}
        for r in long["rows"]:
            e = ratio.get(r["model"])
            decode = " | ".join(f"{r['decode_tokens_per_s'][c]:.1f}" + (
                f" ({e['decode'][c]:.2f}x, limit {e['decode_limit'][c]:.2f}x)" if e else "") for c in contexts)
            memory = f"{r['memory']['total_mib']:.1f}" + (f" ({e['memory']:.3f}x)" if e else "")
            lines.append(f"| {r['model']} | {decode} | {memory} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", type=Path, default=ROOT / ".engine", help="the engine (make engine)")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "engine-bench", help="where the GGUFs are kept")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--decode", type=int, default=32, help="tokens generated after each context")
    parser.add_argument("--quick", action="store_true", help="short contexts, no batched row: a check of the script")
    parser.add_argument("--out", type=Path, default=RESULTS / "engine.json")
    parser.add_argument("--rows", type=Path, help="print the tables of this engine.json and stop (no timing)")
    parser.add_argument("--no-long", action="store_true", help="leave out the Qwen2.5-0.5B-shaped rows at 16K and 32K")
    parser.add_argument("--perplexity-only", action="store_true",
                        help="measure the perplexity table alone and put it into --out's existing rows (no timing)")
    parser.add_argument("--trained", type=Path,
                        help="a trained conversion (as `recurformer run` saves it, e.g. runs/demo/final): its perplexity rows too")
    args = parser.parse_args()
    if args.trained and not (args.trained / "config.json").exists():
        parser.error(f"--trained {args.trained}: no config.json there (a converted model's folder)")
    trained = {"trained": str(args.trained)} if args.trained else {}
    if args.rows:
        print(markdown(json.loads(args.rows.read_text())))
        return
    if args.perplexity_only:
        data = read_json_object(args.out) if args.out.exists() else None
        if data is None or "rows" not in data:
            parser.error(f"--perplexity-only: {args.out} holds no measured rows to add the table to")
        data["perplexity"] = perplexities(args.engine, {**model_sources(args.work), **trained}, args.work, args.threads)
        if trained:
            data["quant_choices"] = quant_choices(args.engine, args.work / "trained-f32.gguf", args.work, args.threads)
        write_json_atomic(args.out, data)
        print(markdown(data))
        return
    for tool in ("llama-bench", "llama-completion", "llama-batched-bench"):
        if not (args.engine / "build" / "bin" / tool).exists():
            parser.error(f"--engine {args.engine}: no build/bin/{tool}; run `make engine` first")
    contexts = (256, 512) if args.quick else CONTEXTS
    ggufs = make_ggufs(args.work, model_sources(args.work))
    rows = measure(args.engine, ggufs, args.work, args.threads, 1 if args.quick else args.repetitions,
                   args.decode, contexts, args.quick)
    data = {"threads": args.threads, "repetitions": args.repetitions, "decode_tokens": args.decode,
            "flash_attention": True, "batched": BATCH, "rows": rows}
    data["ratios"] = ratios(rows)
    if not args.quick:
        data["perplexity"] = perplexities(args.engine, {**model_sources(args.work), **trained}, args.work, args.threads)
        if not args.no_long:
            long_rows = measure_long(args.engine, make_long_ggufs(args.work), args.work, args.threads, args.decode)
            data["long"] = {**LONG, "rows": long_rows, "ratios": ratios(long_rows)}
        write_json_atomic(args.out, data)
    print(markdown(data))


if __name__ == "__main__":
    main()
