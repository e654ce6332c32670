"""Which groups to window: the `recency`, `ablation`, `ablation-greedy` and `random` scorers
compared on SmolLM2-135M with the training-free `window` mixer (window 64 + 4 sinks), no training.

    python -m benchmarks.quality.scorers            # resumes: finished measurements are kept in the JSON

Scores: the recency scores of docs/results/smollm2-135m-scores.json; the ablation costs are
measured on wikitext-2-valid (calibration text only), once per setting in `ABLATIONS`, and
written with them into docs/results/smollm2-135m-<measurement>-scores.json (resumable
through a checkpoint beside it). `ablation-greedy` is the default settings (2 x 1,024
tokens from 256, four rounds): the `ablation-greedy` variant takes its order, the `ablation`
variant its round 0 (the single-group costs). `ablation-2048` is the first version's
settings (2 x 2,048 tokens from 1,024, one round). Each selection (variant x beta) is
converted and its perplexity measured on the first `--tokens` tokens of the held-out and
the out-of-domain text in `--context`-token windows, as is the original. Writes
docs/results/scorers.json and the "Scorers" section of docs/results/analysis.md (replaced
on every run). One thread: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from recurformer.ablation import AblationConfig, calibration_sequences, measure_ablation
from recurformer.data import load_documents
from recurformer.evaluate import TASKS
from recurformer.evaluate.perplexity import PerplexityOptions
from recurformer.files import write_json_atomic, write_text_atomic
from recurformer.loading import load_model
from recurformer.mixers import MixerConfig
from recurformer.scoring import HeadScores, SelectionConfig, record_ablation
from recurformer.surgery import convert

from benchmarks.common import HELD_OUT, OUT_OF_DOMAIN, RESULTS, ROOT, TRAIN

TEXTS = {"held-out": HELD_OUT, "out-of-domain": OUT_OF_DOMAIN}
CALIBRATION = TRAIN[0]
WINDOW = MixerConfig(kind="window", window=64)  # the training-free window the scorers are compared with  # the ablation costs are measured on the first training corpus
# measurement -> its settings; variant -> (scorer, the measurement its scores need, or None: the recency scores)
ABLATIONS = {"ablation-greedy": AblationConfig(),
             "ablation-2048": AblationConfig(ablation_seq_len=2048, ablation_from=1024, ablation_rounds=1)}
VARIANTS = {"recency": ("recency", None), "ablation-2048": ("ablation", "ablation-2048"),
            "ablation": ("ablation", "ablation-greedy"), "ablation-greedy": ("ablation-greedy", "ablation-greedy"),
            "random": ("random", None)}
SCORERS = tuple(VARIANTS)
SECTION = "## Scorers: which groups to window (training-free)"
BEGIN, END = "<!-- written by benchmarks/scorers.py -->", "<!-- end of benchmarks/scorers.py -->"


def ablation_scores(model, tokenizer, recency: HeadScores, path: Path, data: Path, config: AblationConfig) -> HeadScores:
    """The recency scores plus the ablation measurement `config`, measured (or resumed) and saved at `path`."""
    if path.is_file():
        return HeadScores.load(path)
    tokens = calibration_sequences(tokenizer, load_documents([data]), config, model.config, seed=0)
    partial = path.with_name(path.name + ".ablation-partial.json")
    record_ablation(recency, measure_ablation(model, tokens, config, checkpoint=partial), config)
    recency.ablation["data"] = [f"../{data.relative_to(ROOT.parent)}"]
    recency.save(path)
    partial.unlink(missing_ok=True)
    return recency


def perplexities(model, tokenizer, args) -> dict:
    task = TASKS["ppl"]
    out = {}
    for name, file in TEXTS.items():
        options = PerplexityOptions(data=[str(file)], context=args.context, max_tokens=args.tokens, batch_size=1)
        out[name] = task.evaluate(model.eval(), tokenizer, options)["ppl"]
    return out


def spearman(a: dict, b: dict) -> float:
    """Rank correlation of two scores over the same groups (no ties among float costs)."""
    keys = sorted(a)
    ra, rb = (torch.tensor([v[k] for k in keys]).argsort().argsort().double() for v in (a, b))
    return torch.corrcoef(torch.stack([ra, rb]))[0, 1].item()


def table(results: dict, betas: list[float]) -> str:
    original = results["original"]
    lines = ["| beta | scorer | held-out ppl | ratio | out-of-domain ppl | ratio |", "|---|---|---|---|---|---|",
             f"| 0 | (original) | {original['held-out']:.3f} | 1.000x | {original['out-of-domain']:.3f} | 1.000x |"]
    for beta in betas:
        for scorer in SCORERS:
            key = f"{scorer}@{beta}"
            if key in results:
                r = results[key]
                lines.append(f"| {beta} | {scorer} | {r['held-out']:.3f} | {r['held-out'] / original['held-out']:.3f}x | "
                             f"{r['out-of-domain']:.3f} | {r['out-of-domain'] / original['out-of-domain']:.3f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(Path.home() / ".cache/recurformer/models/smollm2-135m"))
    parser.add_argument("--scores", default=str(RESULTS / "smollm2-135m-scores.json"))
    parser.add_argument("--tokens", type=int, default=16384, help="tokens scored of each evaluation text")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--betas", type=float, nargs="+", default=[0.5, 0.75])
    parser.add_argument("--scorers", nargs="+", default=list(SCORERS), choices=SCORERS)
    parser.add_argument("--out", default=str(RESULTS / "scorers.json"))
    parser.add_argument("--markdown", default=str(RESULTS / "analysis.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)

    net, tokenizer, _ = load_model(args.model)
    recency = HeadScores.load(args.scores)
    recency.check_model(net, args.model)
    measured = {name: ablation_scores(net, tokenizer, HeadScores.load(args.scores),
                                      RESULTS / f"smollm2-135m-{name}-scores.json", CALIBRATION, config)
                for name, config in ABLATIONS.items() if any(VARIANTS[v][1] == name for v in args.scorers)}
    scores = {v: measured[VARIANTS[v][1]] if VARIANTS[v][1] else recency for v in args.scorers}
    out = Path(args.out)
    saved = json.loads(out.read_text()) if out.is_file() else {}
    settings = {"tokens": args.tokens, "context": args.context, "mixer": asdict(WINDOW)}
    results = saved.get("perplexity", {}) if saved.get("settings") == settings else {}

    def record(key: str, model) -> None:
        if key not in results:
            start = time.perf_counter()
            results[key] = {**perplexities(model, tokenizer, args), "seconds": time.perf_counter() - start}
            write_json_atomic(out, {**saved, "settings": settings, "perplexity": results})
            print(key, results[key], flush=True)

    record("original", net)
    chosen = {}
    for beta in args.betas:
        for scorer in args.scorers:
            spec = SelectionConfig(beta=beta, scorer=VARIANTS[scorer][0], seed=0).select(scores[scorer])
            chosen[f"{scorer}@{beta}"] = set(spec.groups)
            if f"{scorer}@{beta}" not in results:
                record(f"{scorer}@{beta}", convert(net, spec, WINDOW))
    summary = {"settings": settings, "perplexity": results}
    rr = recency.group_values()
    summary["ablations"] = {name: {**held.ablation, "spearman_recency_vs_ablation": spearman(
        rr, {g: -c for g, c in held.group_values("ablation").items()})} for name, held in measured.items()}
    summary["overlap_with_recency"] = {v: {str(b): len(chosen[f"recency@{b}"] & chosen[f"{v}@{b}"]) for b in args.betas}
                                       for v in args.scorers if v != "recency" and "recency" in args.scorers}
    write_json_atomic(out, summary)
    write_section(Path(args.markdown), summary, args)


def write_section(path: Path, summary: dict, args) -> None:
    """Replace the generated part of the section (between BEGIN and END); text after END is kept."""
    text = path.read_text()
    head = text.split(SECTION)[0].rstrip("\n")
    tail = text.split(END, 1)[1] if END in text else "\n"
    lines = [SECTION, "", BEGIN,
             (f"`python -m benchmarks.quality.scorers` ([`scorers.json`](scorers.json)): SmolLM2-135M, every selected group "
             f"replaced by the training-free `window` mixer (window 64 + 4 sinks, the heads' own weights), no "
             f"training. Perplexity on the first {args.tokens:,} tokens of `{HELD_OUT.name}` (held-out) "
             f"and `{OUT_OF_DOMAIN.name}` (out-of-domain) in {args.context}-token windows; ratio to the "
             f"original measured the same way. `random` is one draw (seed 0)."), "",
             table(summary["perplexity"], args.betas), ""]
    for name, a in summary["ablations"].items():
        rounds = a.get("ablation_rounds", 1)
        lines.append(f"`{name}` costs: {a['ablation_sequences']} x {a['ablation_seq_len']} tokens of `{CALIBRATION.name}`, "
                     f"NLL of tokens at positions >= {a['ablation_from']} (base NLL {a['base_nll']:.4f} nats), "
                     f"{rounds} round{'s' if rounds > 1 else ''}, {a['seconds']:.0f} s"
                     + (" (rounds: " + ", ".join(f"{t:.0f} s" for t in a["round_seconds"]) + "; NLL with the earlier "
                        "rounds' groups windowed: " + ", ".join(f"{n:.4f}" for n in a["round_base_nll"]) + ")"
                        if rounds > 1 else "")
                     + f". Spearman rank correlation of its single-group ranking (cheapest first) with recency "
                     f"(rr_16): {a['spearman_recency_vs_ablation']:.3f}.")
        lines.append("")
    if summary["overlap_with_recency"]:
        lines.append("Chosen groups shared with recency: " + "; ".join(
            f"{v} " + ", ".join(f"{n} at beta {b}" for b, n in o.items())
            for v, o in summary["overlap_with_recency"].items() if v != "random") + ".")
        lines.append("")
    write_text_atomic(path, head + "\n\n" + "\n".join(lines) + END + tail)


if __name__ == "__main__":
    main()
