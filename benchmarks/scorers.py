"""Which groups to window: the `recency`, `ablation` and `random` scorers compared on
SmolLM2-135M with the training-free `window` mixer (window 64 + 4 sinks), no training.

    python benchmarks/scorers.py            # resumes: finished measurements are kept in the JSON

Scores: the recency scores of docs/results/smollm2-135m-scores.json; the ablation costs are
measured on wikitext-2-valid (calibration text only) and written with them into
docs/results/smollm2-135m-ablation-scores.json (resumable through a checkpoint beside it).
Each selection (scorer x beta) is converted and its perplexity measured on the first
`--tokens` tokens of the held-out and the out-of-domain text in `--context`-token windows,
as is the original. Writes docs/results/scorers.json and the "Scorers" section of
docs/results/analysis.md (replaced on every run). One thread: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from recurformer.ablation import AblationConfig, ablation_costs, calibration_sequences
from recurformer.config import MixerConfig
from recurformer.data import load_documents
from recurformer.evaluate import TASKS
from recurformer.evaluate.perplexity import PerplexityOptions
from recurformer.files import write_json_atomic, write_text_atomic
from recurformer.loading import load_model
from recurformer.scoring import HeadScores, SelectionConfig
from recurformer.surgery import convert

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
DATA = ROOT.parent / "shared" / "data"
TEXTS = {"held-out": "wikitext-2-raw-test.txt", "out-of-domain": "lee-background-news.txt"}
CALIBRATION = "wikitext-2-valid.txt"
SCORERS = ("recency", "ablation", "random")
SECTION = "## Scorers: which groups to window (training-free)"
BEGIN, END = "<!-- written by benchmarks/scorers.py -->", "<!-- end of benchmarks/scorers.py -->"


def ablation_scores(model, tokenizer, recency: HeadScores, path: Path, data: Path) -> HeadScores:
    """The recency scores plus each group's ablation cost, measured (or resumed) and saved at `path`."""
    if path.is_file():
        return HeadScores.load(path)
    config = AblationConfig()
    tokens = calibration_sequences(tokenizer, load_documents([data]), config, model.config, seed=0)
    start = time.perf_counter()
    costs, base = ablation_costs(model, tokens, config, checkpoint=path.with_name(path.name + ".ablation-partial.json"))
    recency.groups["ablation"] = costs
    recency.ablation = {**asdict(config), "base_nll": base, "seconds": time.perf_counter() - start,
                        "data": [f"../{data.relative_to(ROOT.parent)}"]}
    recency.save(path)
    path.with_name(path.name + ".ablation-partial.json").unlink(missing_ok=True)
    return recency


def perplexities(model, tokenizer, args) -> dict:
    task = TASKS["ppl"]
    out = {}
    for name, file in TEXTS.items():
        options = PerplexityOptions(data=[str(DATA / file)], context=args.context, max_tokens=args.tokens, batch_size=1)
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
    parser.add_argument("--ablation-scores", default=str(RESULTS / "smollm2-135m-ablation-scores.json"))
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
    scores = {"recency": recency, "random": recency}
    if "ablation" in args.scorers:
        scores["ablation"] = ablation_scores(net, tokenizer, HeadScores.load(args.scores), Path(args.ablation_scores),
                                             DATA / CALIBRATION)
    out = Path(args.out)
    saved = json.loads(out.read_text()) if out.is_file() else {}
    settings = {"tokens": args.tokens, "context": args.context, "mixer": asdict(MixerConfig(kind="window"))}
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
            spec = SelectionConfig(beta=beta, scorer=scorer, seed=0).select(scores[scorer])
            chosen[f"{scorer}@{beta}"] = set(spec.groups)
            if f"{scorer}@{beta}" not in results:
                record(f"{scorer}@{beta}", convert(net, spec, MixerConfig(kind="window")))
    summary = {"settings": settings, "perplexity": results}
    if "ablation" in scores:
        costs, rr = scores["ablation"].group_values("ablation"), recency.group_values()
        rho = spearman(rr, {g: -c for g, c in costs.items()})  # both: higher = replaced earlier
        summary["ablation"] = {**scores["ablation"].ablation, "spearman_recency_vs_ablation": rho,
                               "overlap": {str(b): len(chosen[f"recency@{b}"] & chosen[f"ablation@{b}"])
                                           for b in args.betas},
                               "chosen": {str(b): len(chosen[f"ablation@{b}"]) for b in args.betas}}
    write_json_atomic(out, summary)
    write_section(Path(args.markdown), summary, args)


def write_section(path: Path, summary: dict, args) -> None:
    """Replace the generated part of the section (between BEGIN and END); text after END is kept."""
    text = path.read_text()
    head = text.split(SECTION)[0].rstrip("\n")
    tail = text.split(END, 1)[1] if END in text else "\n"
    lines = [SECTION, "", BEGIN,
             f"`python benchmarks/scorers.py` ([`scorers.json`](scorers.json)): SmolLM2-135M, every selected group "
             f"replaced by the training-free `window` mixer (window 64 + 4 sinks, the heads' own weights), no "
             f"training. Perplexity on the first {args.tokens:,} tokens of `wikitext-2-raw-test.txt` (held-out) "
             f"and `lee-background-news.txt` (out-of-domain) in {args.context}-token windows; ratio to the "
             f"original measured the same way. `random` is one draw (seed 0).", "",
             table(summary["perplexity"], args.betas), ""]
    if "ablation" in summary:
        a = summary["ablation"]
        lines += [f"Ablation costs: {a['ablation_sequences']} x {a['ablation_seq_len']} tokens of "
                  f"`{CALIBRATION}`, NLL of tokens at positions >= {a['ablation_from']} (base NLL "
                  f"{a['base_nll']:.4f} nats). Spearman rank correlation between the recency ranking (rr_16) and "
                  f"the ablation ranking (cheapest first): {a['spearman_recency_vs_ablation']:.3f}. Chosen sets "
                  "shared by recency and ablation: " + ", ".join(
                      f"{a['overlap'][str(b)]} of {a['chosen'][str(b)]} at beta {b}" for b in args.betas) + ".", ""]
    write_text_atomic(path, head + "\n\n" + "\n".join(lines) + END + tail)


if __name__ == "__main__":
    main()
