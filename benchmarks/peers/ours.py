"""Ways to shrink SmolLM2-135M's KV cache, measured alike at equal cache bytes: our rows.

Every row reads the problem set of `benchmarks/peers/problems.py` and is measured the way
`peers/kvpress_eval.py` measures kvpress's presses (docs/results/long-context.md, "Peers at
equal cache bytes"):

- loss: prefill the first `prefix` tokens of each sequence into the row's cache, then score
  the next-token predictions of the `scored` tokens after them with that cache, in one forward
  pass at positions `prefix ...` (for a cache that holds all it keeps this is the full forward's
  loss at those positions, `tests/test_long_context_peers.py`);
- cache bytes: held and reserved by the cache once the first held-out sequence's 8,192 tokens
  are in it (prefix + scored; our caches do not depend on how the tokens arrived);
- passkey: prefill the context (`ids[:question_start]`), feed the question at its positions,
  then 8 greedy tokens; the completions are stored and scored by the table (`benchmarks/peers/table.py`).

Rows (`--rows`): `original`; `window64-b<beta>` (our training-free `window` mixer, 64 + 4 sinks,
recency scores); `window-eqwm2-b<beta>` (its window sized to the bytes of a `window+mamba2`
model); `streaming-b<beta>` (StreamingLLM: every KV group windowed, beta 1.0, window sized to the
bytes of `window64-b<beta>`); `duo-b<beta>` (DuoAttention-style: the `ablation` scorer keeps the
retrieval groups, the others windowed 64 + 4 sinks); trained models given as
`--model NAME=DIR`; and, for each `--rival NAME` of those, `NAME-rival`: the training-free
`window` on that model's groups at its cache bytes (`recurformer.equal_cache.window_baseline`).
Rows already in `--out` are kept, not recomputed.

    python -m benchmarks.peers.ours --rows original,window64-b0.5,streaming-b0.5 \\
        --model wm2-b0.5-trained=runs/wm2-b05-s40-16/final
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from recurformer import HeadScores, MixerConfig, convert, make_scorer, select_heads
from recurformer.bench import cache_bytes, new_cache
from recurformer.cache import CACHE_ARGUMENT
from recurformer.equal_cache import equal_cache_window, window_baseline
from recurformer.evaluate.logits import chunked_logits
from recurformer.files import write_json_atomic
from recurformer.loading import load_any, load_model
from recurformer.modeling import RecurFormerForCausalLM

from benchmarks.common import RESULTS, ROOT

SCHEMA = "recurformer-long-context-rows/1"
ANSWER_TOKENS = 8
SINKS = 4


@torch.no_grad()
def prefilled_nll(model, sequence: Tensor, prefix: int, cache) -> Tensor:
    """NLL (nats) `[T - prefix - 1]` of tokens `prefix + 1 ...` of `sequence` `[T]`, predicted
    with `cache` prefilled by the first `prefix` tokens; the cache then holds `T - 1` tokens."""
    decoder = model.get_decoder()
    decoder(input_ids=sequence[None, :prefix], **{CACHE_ARGUMENT: cache}, use_cache=True)
    rest = sequence[prefix:-1]
    positions = torch.arange(prefix, prefix + len(rest))[None]
    hidden = decoder(input_ids=rest[None], **{CACHE_ARGUMENT: cache}, position_ids=positions,
                     use_cache=True).last_hidden_state[0]
    nll = torch.empty(len(rest))
    for part, logits in chunked_logits(model, hidden):
        nll[part] = F.cross_entropy(logits, sequence[prefix + 1:][part], reduction="none")
    return nll


@torch.no_grad()
def greedy_answer(model, ids: list[int], question_start: int, cache, new_tokens: int = ANSWER_TOKENS) -> list[int]:
    """Prefill the context `ids[:question_start]`, feed the question at its positions, then
    `new_tokens` greedy tokens (the answer's ids)."""
    context, question = torch.tensor(ids[:question_start])[None], torch.tensor(ids[question_start:])[None]
    model.get_decoder()(input_ids=context, **{CACHE_ARGUMENT: cache}, use_cache=True)
    position = question_start
    answer: list[int] = []
    step = question
    while len(answer) < new_tokens:
        positions = torch.arange(position, position + step.shape[1])[None]
        logits = model(input_ids=step, **{CACHE_ARGUMENT: cache}, position_ids=positions, use_cache=True,
                       logits_to_keep=1).logits
        answer.append(int(logits[0, -1].argmax()))
        position += step.shape[1]
        step = torch.tensor([[answer[-1]]])
    return answer


def fresh_cache(model):
    """Our hybrid cache for a converted model, transformers' dynamic cache for the original."""
    return new_cache(model, "hybrid" if isinstance(model, RecurFormerForCausalLM) else "dynamic", 0)


def measure(model, tokenizer, problems: dict) -> dict:
    """Loss per text, cache bytes at 8K and passkey completions of `model` on `problems`."""
    model.eval()
    loss, cache_sizes = {}, None
    for text, entry in problems["loss"].items():
        nll = []
        for sequence in entry["sequences"]:
            cache = fresh_cache(model)
            nll.append(prefilled_nll(model, torch.tensor(sequence), problems["prefix"], cache))
            if cache_sizes is None:
                kv, reserved, state = cache_bytes(cache)
                cache_sizes = {"tokens": cache.get_seq_length(), "kv_bytes": kv, "kv_reserved_bytes": reserved,
                               "state_bytes": state, "cache_bytes": reserved + state}
        values = torch.cat(nll).double()
        loss[text] = {"file": entry["file"], "tokens": len(values), "nll": values.mean().item()}
        print(f"  {text}: nll {loss[text]['nll']:.4f}", flush=True)
    passkey = []
    for problem in problems["passkey"]:
        cache = fresh_cache(model)
        answer = greedy_answer(model, problem["ids"], problem["question_start"], cache)
        passkey.append({"context": problem["context"], "depth": problem["depth"], "answer": problem["answer"],
                        "completion": tokenizer.decode(answer, skip_special_tokens=True)})
        print(f"  passkey {problem['context']} @ {problem['depth']}: {passkey[-1]['completion']!r} "
              f"(key {problem['answer']})", flush=True)
    return {"cache": cache_sizes, "loss": loss, "passkey": passkey}


@dataclass(frozen=True)
class Variant:
    """A training-free conversion of the original: which groups are windowed, and how wide."""

    name: str
    label: str
    scores: str
    scorer: str
    beta: float
    window: int

    def build(self, original):
        spec = select_heads(HeadScores.load(self.scores), self.beta, make_scorer(self.scorer))
        return convert(original, spec, MixerConfig(kind="window", window=self.window, sinks=SINKS))


def cache_at(original, spec, config: MixerConfig, tokens: int = 8192, probe: int = 300) -> int:
    """Bytes a conversion's cache holds at `tokens` tokens: its kept K/V grow linearly from a
    `probe`-token prefill, its mixer state is fixed once allocated."""
    with torch.no_grad():
        cache = convert(original, spec, config)(torch.randint(0, 1000, (1, probe)), use_cache=True).past_key_values
    sizes = cache.nbytes()
    return sizes["kv"] * tokens // probe + sizes["mixer_state"]


def variant(name: str, original, scores: str, ablation_scores: str) -> Variant:
    """The training-free row called `name` (module docstring)."""
    found = re.fullmatch(r"(window64|window-eqwm2|streaming|duo)-b([0-9.]+)", name)
    if not found:
        raise SystemExit(f"error: unknown row {name!r}; rows are original, window64-bB, window-eqwm2-bB, "
                         "streaming-bB, duo-bB, or --model NAME=DIR")
    kind, beta = found.group(1), float(found.group(2))
    spec = select_heads(HeadScores.load(scores), beta, make_scorer("recency"))
    if kind == "window64":
        return Variant(name, f"window 64 + 4 sinks, beta {beta}", scores, "recency", beta, 64)
    if kind == "duo":
        return Variant(name, f"DuoAttention-style: ablation-kept groups full, others window 64 + 4 sinks, "
                       f"beta {beta}", ablation_scores, "ablation", beta, 64)
    if kind == "window-eqwm2":
        library_shape = MixerConfig(kind="window+mamba2", window=64, ssd_state="head_dim")  # the first default
        window = equal_cache_window(original, convert(original, spec, library_shape))
        return Variant(name, f"window {window} + 4 sinks (the bytes of window+mamba2), beta {beta}", scores,
                       "recency", beta, window)
    target = cache_at(original, spec, MixerConfig(kind="window", window=64, sinks=SINKS))
    every = select_heads(HeadScores.load(scores), 1.0, make_scorer("recency"))
    per_slot = cache_at(original, every, MixerConfig(kind="window", window=64, sinks=SINKS)) / (64 + SINKS)
    window = round(target / per_slot) - SINKS
    return Variant(name, f"StreamingLLM: every group window {window} + 4 sinks (bytes of window64-b{beta})",
                   scores, "recency", 1.0, window)


def trained_label(model, folder: str) -> str:
    """'window+mamba2 (64 + 4 sinks), 45 of 90 groups, trained: FOLDER' (the window only for
    the kinds that have one)."""
    mixer, spec = model.config.mixer, model.config.replacement
    groups = spec["num_layers"] * spec["num_kv_heads"]
    window = f" ({mixer['window']} + {mixer['sinks']} sinks)" if mixer["kind"].startswith("window") else ""
    return f"{mixer['kind']}{window}, {len(spec['groups'])} of {groups} groups, trained: `{folder}`"


def load_results(path: Path, digest: str) -> dict:
    if not path.exists():
        return {"schema": SCHEMA, "problems": digest, "rows": {}}
    results = json.loads(path.read_text())
    if results.get("problems") != digest:
        raise SystemExit(f"error: {path} was made on problem set {results.get('problems')}, not {digest}; "
                         "use another --out")
    return results


def add_row(path: Path, digest: str, name: str, row: dict) -> None:
    """Write `row` into the results at `path`, read again just before: rows that another run of
    this script added meanwhile are kept."""
    results = load_results(path, digest)
    results["rows"][name] = row
    write_json_atomic(path, results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default=str(ROOT / "runs" / "long-context-problems.json"))
    parser.add_argument("--rows", default="", help="comma-separated training-free rows (module docstring)")
    parser.add_argument("--model", action="append", default=[], metavar="NAME=DIR", help="a converted model folder")
    parser.add_argument("--rival", action="append", default=[], metavar="NAME",
                        help="also the window at equal bytes on the groups of --model NAME")
    parser.add_argument("--scores", default=str(RESULTS / "smollm2-135m-scores.json"))
    parser.add_argument("--ablation-scores", default=str(RESULTS / "smollm2-135m-ablation-2048-scores.json"))
    parser.add_argument("--out", default=str(RESULTS / "long-context" / "peers-ours.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    problems = json.loads(Path(args.problems).read_text())
    out = Path(args.out)
    results = load_results(out, problems["digest"])
    models = dict(item.split("=", 1) for item in args.model if "=" in item)
    if len(models) != len(args.model):
        raise SystemExit(f"error: --model takes NAME=DIR, got {args.model}")
    for directory in models.values():
        if not (Path(directory) / "config.json").is_file():
            raise SystemExit(f"error: --model {directory}: not a model folder (no config.json)")
    original, tokenizer, _ = load_model(problems["model"], progress=False)
    names = [name for name in args.rows.split(",") if name]
    unknown = [name for name in args.rival if name not in models]
    if unknown:
        raise SystemExit(f"error: --rival {unknown[0]}: no --model of that name")
    for name in names + list(models) + [f"{name}-rival" for name in args.rival]:
        if name in results["rows"]:
            print(f"{name}: already in {out}, kept", flush=True)
            continue
        print(name, flush=True)
        if name == "original":
            model, record = original, {"label": "original (full cache)"}
        elif name in models:
            model, _ = load_any(models[name])
            record = {"label": trained_label(model, models[name]), "folder": models[name]}
        elif name.endswith("-rival"):
            model, window = window_baseline(original, load_any(models[name.removesuffix("-rival")])[0])
            record = {"label": f"window {window} + {SINKS} sinks on the groups of `{name.removesuffix('-rival')}`, "
                      "at its bytes, no training", "window": window, "sinks": SINKS}
        else:
            row = variant(name, original, args.scores, args.ablation_scores)
            model = row.build(original)
            record = {"label": row.label, "scores": row.scores, "scorer": row.scorer, "beta": row.beta,
                      "window": row.window, "sinks": SINKS}
        add_row(out, problems["digest"], name, {"method": "ours", **record, **measure(model, tokenizer, problems)})
        del model
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
