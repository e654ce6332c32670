"""kvpress's presses on the equal-cache problem set, measured as our rows are (docs/results/long-context.md,
"Peers at equal cache bytes").

Runs in the peers' own virtual environment (`benchmarks/peers/README.md`) and does not import
recurformer: kvpress 0.5.5 needs transformers < 5.3, recurformer's environment has a newer one.
It reads the problem set (`benchmarks/peers/problems.py`: token ids, so every row gets
the same problems) and our rows' JSON (`benchmarks/peers/ours.py`: the cache bytes to
match), and measures each press as `benchmarks/peers/ours.py` measures our rows:

- loss: prefill `prefix` tokens with the press on (the cache is compressed after each layer),
  then score the next-token predictions of the `scored` tokens after them with that cache, in
  one forward pass at positions `prefix ...`, press off;
- cache bytes: the compressed keys and values after a prefill, press on, of the first held-out
  sequence's first 8,192 tokens;
- passkey: prefill the context with the press on, then the question (not compressed) at its
  positions and 8 greedy tokens, as kvpress's pipeline does (without its chat template: our
  prompt format is the same for every row).

A press removes the fraction `compression_ratio` of every layer's and head's tokens; it is set
so that the press keeps `n` tokens of an 8,192-token prefill, `n * bytes per token` being the
cache bytes of our row named by `--match` (e.g. `window64-b0.5`). Rows already in `--out` are
kept, not recomputed.

    $PEERS_VENV/bin/python benchmarks/peers/kvpress_eval.py --match window64-b0.5,window64-b0.75

`--ruler PROBLEMS` measures the retrieval comparison instead ("Retrieval at equal cache bytes"):
the problem set of `benchmarks/peers/ruler_problems.py` (RULER at 4K, passkey at 1K/2K/4K),
each press at each budget of our rows' file (`--ours`, `ruler_ours.py`'s: a budget's bytes at
each context length C), its ratio set at each C so that it keeps those bytes of a C-token
context; answers as `ruler_ours.py` answers (context prefilled with the press on, question
uncompressed, greedy until an EOS id of the problem set, a blank line or the problem's
`max_new_tokens`); rows and problems already in `--out` are kept, so a run resumes.

    $PEERS_VENV/bin/python benchmarks/peers/kvpress_eval.py --ruler runs/ruler-problems.json \
        --budgets 0.5,0.25 --presses expected-attention,snapkv,kvzip,tova,knorm

`--shared PROBLEMS` measures the shared-context comparison ("Shared context: one prefill, many
questions"): the problem set of `benchmarks/peers/shared_problems.py`, each press at each budget
of `shared_ours.py`'s file, its ratio set per context so that it keeps the budget's bytes at that
context's length; each context is prefilled once with the press on, then every question is
answered by recurformer's own answering core (`src/recurformer/evaluate/conversation.py`, loaded
by path: it imports only torch) in both modes.

    $PEERS_VENV/bin/python benchmarks/peers/kvpress_eval.py --shared runs/shared-context-problems.json \
        --budgets 0.5 --presses kvzip
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from kvpress import (DecodingPress, ExpectedAttentionPress, KeyDiffPress, KnormPress, KVzipPress, SnapKVPress,
                     StreamingLLMPress, TOVAPress)
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

ROOT = Path(__file__).resolve().parent.parent.parent
RESULTS = ROOT / "docs" / "results" / "long-context"
SCHEMA = "recurformer-long-context-rows/1"
RULER_SCHEMA = "recurformer-ruler-rows/1"
SHARED_SCHEMA = "recurformer-shared-context-rows/1"
STREAM_SCHEMA = "recurformer-stream-rows/1"
PRESSES = {  # name -> (label, press class); every press with its defaults but the ratio
    "snapkv": ("SnapKV", SnapKVPress),
    "expected-attention": ("ExpectedAttention", ExpectedAttentionPress),
    "knorm": ("Knorm", KnormPress),
    "streaming-llm": ("StreamingLLM", StreamingLLMPress),
    "kvzip": ("KVzip", KVzipPress),
    "tova": ("TOVA", TOVAPress),
    "keydiff": ("KeyDiff", KeyDiffPress),
}
BYTES_TOKENS = 8192
ANSWER_TOKENS = 8
LOGIT_CHUNK = 512


def cache_sizes(cache: DynamicCache) -> dict:
    """Bytes of the keys and values a cache holds (each storage once, for the reserved bytes)."""
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    held = sum(t.numel() * t.element_size() for t in tensors)
    reserved = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    return {"tokens": cache.get_seq_length(), "kv_bytes": held, "kv_reserved_bytes": reserved, "state_bytes": 0,
            "cache_bytes": reserved}


@torch.no_grad()
def prefilled_nll(model, press, sequence: torch.Tensor, prefix: int) -> torch.Tensor:
    """NLL (nats) `[T - prefix - 1]` of tokens `prefix + 1 ...` of `sequence` `[T]`, predicted
    with the cache the press left after prefilling the first `prefix` tokens."""
    cache = DynamicCache()
    with press(model):
        model.model(input_ids=sequence[None, :prefix], past_key_values=cache)
    rest = sequence[prefix:-1]
    positions = torch.arange(prefix, prefix + len(rest))[None]
    hidden = model.model(input_ids=rest[None], past_key_values=cache, position_ids=positions).last_hidden_state[0]
    targets = sequence[prefix + 1:]
    nll = torch.empty(len(rest))
    for start in range(0, len(rest), LOGIT_CHUNK):
        part = slice(start, start + LOGIT_CHUNK)
        nll[part] = F.cross_entropy(model.lm_head(hidden[part]).float(), targets[part], reduction="none")
    return nll


@torch.no_grad()
def greedy_answer(model, press, ids: list[int], question_start: int) -> list[int]:
    """Prefill the context `ids[:question_start]` with the press on, feed the question at its
    positions, then greedy tokens: the answer's `ANSWER_TOKENS` ids."""
    cache = DynamicCache()
    with press(model):
        model.model(input_ids=torch.tensor(ids[:question_start])[None], past_key_values=cache)
    position, step, answer = question_start, torch.tensor(ids[question_start:])[None], []
    while len(answer) < ANSWER_TOKENS:
        positions = torch.arange(position, position + step.shape[1])[None]
        logits = model(input_ids=step, past_key_values=cache, position_ids=positions, logits_to_keep=1).logits
        answer.append(int(logits[0, -1].argmax()))
        position += step.shape[1]
        step = torch.tensor([[answer[-1]]])
    return answer


def measure(model, tokenizer, press, problems: dict) -> dict:
    """Loss per text, cache bytes at 8K and passkey completions of the press on `problems`."""
    loss = {}
    for text, entry in problems["loss"].items():
        values = torch.cat([prefilled_nll(model, press, torch.tensor(s), problems["prefix"])
                            for s in entry["sequences"]]).double()
        loss[text] = {"file": entry["file"], "tokens": len(values), "nll": values.mean().item()}
        print(f"  {text}: nll {loss[text]['nll']:.4f}", flush=True)
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        first = problems["loss"]["heldout"]["sequences"][0][:BYTES_TOKENS]
        model.model(input_ids=torch.tensor(first)[None], past_key_values=cache)
    passkey = []
    for problem in problems["passkey"]:
        answer = greedy_answer(model, press, problem["ids"], problem["question_start"])
        passkey.append({"context": problem["context"], "depth": problem["depth"], "answer": problem["answer"],
                        "completion": tokenizer.decode(answer, skip_special_tokens=True)})
        print(f"  passkey {problem['context']} @ {problem['depth']}: {passkey[-1]['completion']!r} "
              f"(key {problem['answer']})", flush=True)
    return {"cache": cache_sizes(cache), "loss": loss, "passkey": passkey}


@torch.no_grad()
def ruler_answer(model, tokenizer, press, ids: list[int], question_start: int, max_new_tokens: int,
                 eos: set[int]) -> tuple[list[int], DynamicCache]:
    """Prefill the context with the press on, feed the question at its positions, then greedy
    tokens until an `eos` id, a blank line or `max_new_tokens` (`ruler_ours.py`'s rule); the
    answer's ids and the cache after the prefill's compression."""
    cache = DynamicCache()
    with press(model):
        model.model(input_ids=torch.tensor(ids[:question_start])[None], past_key_values=cache)
    sizes = cache_sizes(cache)
    position, step, answer = question_start, torch.tensor(ids[question_start:])[None], []
    while len(answer) < max_new_tokens:
        positions = torch.arange(position, position + step.shape[1])[None]
        logits = model(input_ids=step, past_key_values=cache, position_ids=positions, logits_to_keep=1).logits
        token = int(logits[0, -1].argmax())
        if token in eos:
            break
        answer.append(token)
        if "\n\n" in tokenizer.decode(answer, skip_special_tokens=True).strip():
            break
        position += step.shape[1]
        step = torch.tensor([[token]])
    return answer, sizes


def measure_ruler(model, tokenizer, args) -> None:
    """Every press at every budget of our rows on the RULER/passkey problem set (module docstring)."""
    problems = read_json(Path(args.ruler), "problem set")
    ours = read_json(Path(args.ours), "our rows")
    if ours.get("problems") != problems["digest"]:
        raise SystemExit(f"error: {args.ours} was made on problem set {ours.get('problems')}, not {problems['digest']}")
    per_token = bytes_per_token(model)
    eos = set(problems["eos"])
    out = Path(args.out)
    for budget in (name for name in args.budgets.split(",") if name):
        if budget not in ours.get("budgets", {}):
            raise SystemExit(f"error: --budgets {budget}: not a budget of {args.ours} ({', '.join(ours.get('budgets', {}))})")
        for name in (n for n in args.presses.split(",") if n):
            label, press_class = PRESSES[name]
            row_name = f"{name}@{budget}"
            results = open_results(out, RULER_SCHEMA, problems["digest"])
            row = results["rows"].get(row_name, {"budget": budget, "kind": name, "labels": {}, "cache": {},
                                                 "completions": {}, "seconds": 0.0})
            todo = [(i, p) for i, p in enumerate(problems["problems"]) if str(i) not in row["completions"]]
            print(f"{row_name}: {len(todo)} problems to answer", flush=True)
            for index, problem in todo:
                context = problem["context"]
                ratio = 1 - ours["budgets"][budget]["bytes"][str(context)] / (per_token * context)
                start = time.time()
                answer, sizes = ruler_answer(model, tokenizer, press_class(compression_ratio=ratio), problem["ids"],
                                             problem["question_start"], problem["max_new_tokens"], eos)
                row["seconds"] += time.time() - start
                row["labels"][str(context)] = f"kvpress {label}, compression {ratio:.3f} at {context:,} tokens"
                # kvpress keeps a fraction of the context: its bytes at C tokens are the ratio's share of C
                row["cache"][str(context)] = round(per_token * context * (1 - ratio))
                row["completions"][str(index)] = tokenizer.decode(answer, skip_special_tokens=True)
                row.setdefault("measured", {})[str(index)] = sizes["kv_bytes"]
                latest = read_json(out, "results") if out.exists() else results
                latest["rows"][row_name] = row
                latest["versions"] = {n: version(n) for n in ("kvpress", "transformers", "torch")}
                write_json_atomic(out, latest)
                print(f"  {problem['task']} @ {context}: {row['completions'][str(index)]!r} "
                      f"(expected {problem['answers']}) {time.time() - start:.0f}s", flush=True)
    print(f"wrote {out}")


def conversation_module():
    """recurformer's answering core (`evaluate/conversation.py`), loaded by path: it imports
    only torch, so both environments answer the shared-context questions with the same code."""
    path = ROOT / "src" / "recurformer" / "evaluate" / "conversation.py"
    spec = importlib.util.spec_from_file_location("recurformer_conversation", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure_shared(model, tokenizer, args) -> None:
    """Every press at every budget of our rows on the shared-context problem set: each context
    prefilled once with the press on (compressed then, before any question), then every question
    in both modes from that cache, as `shared_ours.py` answers (module docstring)."""
    conversation = conversation_module()
    problems = read_json(Path(args.shared), "problem set")
    ours = read_json(Path(args.ours), "our rows")
    accepted = (problems["digest"], *problems.get("extends", ()))  # a prefix's rows stay valid (shared_problems.py)
    if ours.get("problems") not in accepted:
        raise SystemExit(f"error: {args.ours} was made on problem set {ours.get('problems')}, not {problems['digest']}")
    per_token, eos, out = bytes_per_token(model), set(problems["eos"]), Path(args.out)

    def stop(ids: list[int]) -> bool:  # recurformer.evaluate.shared_context.ends_answer
        return "\n" in tokenizer.decode(ids, skip_special_tokens=True).lstrip()

    for budget in (name for name in args.budgets.split(",") if name):
        if budget not in ours.get("budgets", {}):
            raise SystemExit(f"error: --budgets {budget}: not a budget of {args.ours} ({', '.join(ours.get('budgets', {}))})")
        kept_per_token, state = ours["budgets"][budget]["line"]
        for name in (n for n in args.presses.split(",") if n):
            label, press_class = PRESSES[name]
            row_name = f"{name}@{budget}"
            results = open_results(out, SHARED_SCHEMA, problems["digest"], accepted)
            length = problems["context"]
            ratio = 1 - ours["budgets"][budget]["bytes"] / (per_token * length)
            row = results["rows"].get(row_name, {"budget": budget, "kind": name, "contexts": {}, "seconds": 0.0})
            row.update(label=f"kvpress {label}, compression {ratio:.3f} at {length:,} tokens",
                       cache=round(per_token * length * (1 - ratio)), full=per_token * length)
            todo = [i for i in range(len(problems["contexts"][:args.contexts])) if str(i) not in row["contexts"]]
            print(f"{row_name}: {len(todo)} contexts to answer", flush=True)
            for index in todo:
                context, start = problems["contexts"][index], time.time()
                # the budget's bytes at this context's own length (its kept K/V grow with it, its state does not)
                keep = (kept_per_token * len(context["ids"]) + state) / (per_token * len(context["ids"]))
                cache = DynamicCache()
                with torch.no_grad(), press_class(compression_ratio=1 - keep)(model):
                    model.model(input_ids=torch.tensor(context["ids"])[None], past_key_values=cache)
                answered = conversation.ask(model, cache, len(context["ids"]), context["questions"], context["later"],
                                            context["golds"], eos, stop)
                row["contexts"][str(index)] = {
                    mode: [{"completion": tokenizer.decode(r["answer"], skip_special_tokens=True),
                            "logprobs": [round(v, 5) for v in r["logprobs"]], "argmax": r["argmax"]}
                           for r in records] for mode, records in answered.items()}
                row["seconds"] += time.time() - start
                latest = open_results(out, SHARED_SCHEMA, problems["digest"], accepted)
                latest["rows"][row_name] = row
                latest["extends"] = problems.get("extends", [])
                latest["versions"] = {n: version(n) for n in ("kvpress", "transformers", "torch")}
                write_json_atomic(out, latest)
                right = sum(r["completion"].strip().startswith(n["value"])
                            for r, n in zip(row["contexts"][str(index)]["multi-request"], context["needles"]))
                print(f"  context {index}: {right}/{len(context['needles'])} ({time.time() - start:.0f} s)", flush=True)
    print(f"wrote {out}")


@torch.no_grad()
def stream_units(model, press, stream: dict, chunk: int) -> tuple[list[dict], int]:
    """Feed `stream`'s ids `chunk` at a time at their true positions with `press` (a
    `DecodingPress`) on, and score its checks teacher-forced, as `recurformer.evaluate.stream`
    does: a check is right when each of its positions predicts the stream's next id. Returns
    the checks and the most tokens a layer's cache held during a forward."""
    ids, cache, peak = stream["ids"], DynamicCache(), 0
    wanted, argmax = {p for unit in stream["units"] for p in unit["positions"]}, {}

    def feed(start: int) -> None:
        nonlocal peak
        piece = ids[start:start + chunk]
        peak = max(peak, cache.get_seq_length() + len(piece))
        # positions are the stream's; the mask follows the cache's own (shorter) length
        logits = model(input_ids=torch.tensor([piece]), past_key_values=cache,
                       position_ids=torch.arange(start, start + len(piece))[None]).logits[0]
        argmax.update({p: int(logits[p - start].argmax()) for p in range(start, start + len(piece)) if p in wanted})

    whole = len(ids) // chunk * chunk
    with press(model):
        for start in range(0, whole, chunk):
            feed(start)
    if whole < len(ids):  # the last, shorter chunk: nothing is scored after it, so it is fed without the press
        feed(whole)       # (SnapKV's window asks for more tokens than it holds)
    units = [{"kind": unit["kind"], "distance": unit["distance"],
              "correct": all(argmax[p] == ids[p + 1] for p in unit["positions"])} for unit in stream["units"]]
    return units, peak


def measure_stream(model, args) -> None:
    """Every press at every budget of the stream problem set, as kvpress's `DecodingPress`
    around it: compressing after every forward (`compression_interval=1`) to `target_size`, the
    tokens our rows of the original keep at that budget (SnapKV's window one token short of a
    chunk: its buffer holds the last chunk and it asks for more than its window); streams
    already in `--out` are kept."""
    problems = read_json(Path(args.stream), "problem set")
    out, chunk = Path(args.out), problems["chunk"]
    for budget in (name for name in args.budgets.split(",") if name):
        if budget not in problems["kept"]:
            raise SystemExit(f"error: --budgets {budget}: not a budget of {args.stream} ({', '.join(problems['kept'])})")
        keep = problems["kept"][budget]
        for name in (n for n in args.presses.split(",") if n):
            label, press_class = PRESSES[name]
            row_name = f"{name}@{budget}"
            results = open_results(out, STREAM_SCHEMA, problems["digest"])
            row = results["rows"].get(row_name, {"budget": float(budget), "kind": name, "target_size": keep,
                                                 "label": f"kvpress DecodingPress({label}), target_size {keep}",
                                                 "streams": {}, "seconds": 0.0})
            todo = [i for i in range(len(problems["streams"])) if str(i) not in row["streams"]]
            print(f"{row_name}: {len(todo)} streams to feed", flush=True)
            for index in todo:
                start = time.time()
                base = press_class()
                if hasattr(base, "window_size"):  # SnapKV asks its buffer for more than its window: one chunk
                    base.window_size = min(base.window_size, chunk - 1)
                press = DecodingPress(base_press=base, compression_interval=1, target_size=keep)
                units, peak = stream_units(model, press, problems["streams"][index], chunk)
                row["streams"][str(index)] = {"units": units, "peak_tokens": peak}
                row["seconds"] += time.time() - start
                latest = open_results(out, STREAM_SCHEMA, problems["digest"])
                latest["rows"][row_name] = row
                latest["options"] = problems["options"]
                latest["versions"] = {n: version(n) for n in ("kvpress", "transformers", "torch")}
                write_json_atomic(out, latest)
                right = sum(u["correct"] for u in units)
                print(f"  stream {index}: {right}/{len(units)}, peak {peak} tokens ({time.time() - start:.0f} s)",
                      flush=True)
    print(f"wrote {out}")


def open_results(out: Path, schema: str, digest: str, accepted: tuple[str, ...] = ()) -> dict:
    """The rows file at `out` (a new one of `schema` if there is none), made on problem set `digest`
    or on one of `accepted` (a prefix of it, shared_problems.py: the file then counts as made on `digest`)."""
    results = read_json(out, "results") if out.exists() else {"schema": schema, "problems": digest, "rows": {}}
    if results.get("problems") != digest and results.get("problems") not in accepted:
        raise SystemExit(f"error: {out} was made on problem set {results.get('problems')}; use another --out")
    results["problems"] = digest
    return results


def bytes_per_token(model) -> int:
    """K/V bytes one token costs in an uncompressed cache: every layer's keys and values."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * config.num_key_value_heads * head_dim * 2 * model.dtype.itemsize


def read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"error: {what} {path} does not exist") from None
    except json.JSONDecodeError as error:
        raise SystemExit(f"error: {what} {path} is not JSON ({error})") from None


def write_json_atomic(path: Path, data: dict) -> None:
    """Write to a temporary file beside `path`, then rename it into place (recurformer.files's rule)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(handle, "w") as out:
        json.dump(data, out, indent=1)
    os.replace(temporary, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default=str(ROOT / "runs" / "long-context-problems.json"))
    parser.add_argument("--ours", help="our rows (the bytes to match); default: peers-ours.json (ruler-ours.json "
                        "with --ruler)")
    parser.add_argument("--match", default="window64-b0.5,window64-b0.75", help="our rows whose cache bytes to match")
    parser.add_argument("--presses", default="snapkv,expected-attention,knorm", help=", ".join(PRESSES))
    parser.add_argument("--model", default="/root/.cache/recurformer/models/smollm2-135m", help="a HF model folder")
    parser.add_argument("--out", help="default: peers-kvpress.json (ruler-kvpress.json with --ruler)")
    parser.add_argument("--ruler", metavar="PROBLEMS", help="the retrieval problem set (module docstring)")
    parser.add_argument("--budgets", default="0.5,0.25", help="with --ruler, --shared or --stream: budgets of --ours "
                        "(of the problem set with --stream)")
    parser.add_argument("--shared", metavar="PROBLEMS", help="the shared-context problem set (module docstring)")
    parser.add_argument("--contexts", type=int, help="with --shared: answer only the first N contexts")
    parser.add_argument("--stream", metavar="PROBLEMS", help="the stream problem set (module docstring)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    presses = [name for name in args.presses.split(",") if name]
    unknown = [name for name in presses if name not in PRESSES]
    if unknown:
        raise SystemExit(f"error: --presses: unknown {unknown}; choose from {', '.join(PRESSES)}")
    for chosen, name, measure_set in ((args.shared, "shared", measure_shared), (args.ruler, "ruler", measure_ruler)):
        if chosen:
            args.ours = args.ours or str(RESULTS / f"{name}-ours.json")
            args.out = args.out or str(RESULTS / f"{name}-kvpress.json")
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
            measure_set(model, AutoTokenizer.from_pretrained(args.model), args)
            return
    if args.stream:
        args.out = args.out or str(RESULTS / "stream-kvpress.json")
        measure_stream(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval(), args)
        return
    args.ours, args.out = args.ours or str(RESULTS / "peers-ours.json"), args.out or str(RESULTS / "peers-kvpress.json")
    problems = read_json(Path(args.problems), "problem set")
    ours = read_json(Path(args.ours), "our rows")
    if ours.get("problems") != problems["digest"]:
        raise SystemExit(f"error: {args.ours} was made on problem set {ours.get('problems')}, not {problems['digest']}")
    out = Path(args.out)
    results = read_json(out, "results") if out.exists() else {"schema": SCHEMA, "problems": problems["digest"],
                                                                "rows": {}}
    if results.get("problems") != problems["digest"]:
        raise SystemExit(f"error: {out} was made on problem set {results.get('problems')}; use another --out")
    results["versions"] = {name: version(name) for name in ("kvpress", "transformers", "torch")}
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    per_token = bytes_per_token(model)
    for match in (name for name in args.match.split(",") if name):
        if match not in ours["rows"]:
            raise SystemExit(f"error: --match {match}: no such row in {args.ours} (rows: {', '.join(ours['rows'])})")
        target = ours["rows"][match]["cache"]["cache_bytes"]
        keep = round(target / per_token)
        ratio = 1 - (keep + 0.5) / BYTES_TOKENS  # kvpress keeps int(tokens * (1 - ratio)) = `keep` of 8,192
        for name in presses:
            row = f"{name}@{match}"
            if row in results["rows"]:
                print(f"{row}: already in {out}, kept", flush=True)
                continue
            label, press_class = PRESSES[name]
            print(row, f"compression_ratio {ratio:.5f}", flush=True)
            record = measure(model, tokenizer, press_class(compression_ratio=ratio), problems)
            # read again: rows that another run of this script wrote meanwhile are kept
            results = {**results, "rows": read_json(out, "results")["rows"]} if out.exists() else results
            results["rows"][row] = {"method": "kvpress", "label": f"kvpress {label}, compression {ratio:.3f} "
                                    f"(the bytes of {match})", "press": press_class.__name__, "match": match,
                                    "compression_ratio": ratio, **record}
            write_json_atomic(out, results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
