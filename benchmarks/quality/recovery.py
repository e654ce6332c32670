"""Recovery of SmolLM2-135M after replacing half its KV groups: perplexity before and after
each continual-training stage, for init=reuse and init=random, at a fixed CPU budget.

Writes docs/results/recovery.json and docs/results/recovery.md. Resumable: a stage whose
output holds train_summary.json (or a metrics file) is not run again.

    python -m benchmarks.quality.recovery [--work runs/recovery] [--transfer-steps 70] [--lm-steps 50]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from recurformer.commands import analyze_command, convert_command, eval_command, train_command
from recurformer.files import write_json_atomic, write_text_atomic
from recurformer.recipe import RECIPES
from recurformer.scoring import SelectionConfig
from recurformer.train import has_checkpoint

from benchmarks.common import HELD_OUT, RESULTS, ROOT, TRAIN

EVAL = [str(HELD_OUT)]
DATA = [str(path) for path in TRAIN]
RECIPE = RECIPES["mixers"]  # run's recipe of the mamba mixer this study converts to


def once(path: Path, make):
    """Run `make()` unless `path` exists; return the JSON at `path`."""
    if not path.exists():
        make()
    return json.loads(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=str(ROOT / "runs" / "recovery"))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--transfer-steps", type=int, default=70)
    parser.add_argument("--lm-steps", type=int, default=50)
    parser.add_argument("--eval-tokens", type=int, default=32768)
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)

    def ppl(model: str, name: str) -> dict:
        path = work / f"ppl-{name}.json"
        return once(path, lambda: eval_command(model, "ppl", str(path), data=EVAL, max_tokens=args.eval_tokens))

    scores = work / "scores.json"
    if not scores.exists():
        analyze_command(args.model, DATA[:1], str(scores), selection=SelectionConfig(scorer="recency"))
    rows = [{"variant": "original", "stage": "-", **ppl(args.model, "original")}]
    for init in ("reuse", "random"):
        converted = work / f"converted-{init}"
        if not (converted / "config.json").exists():
            convert_command(args.model, str(scores), str(converted), SelectionConfig(beta=args.beta, scorer="recency"), init=init, force=True)
        rows.append({"variant": f"init={init}", "stage": "converted, untrained", **ppl(str(converted), f"{init}-untrained")})
        transfer = work / f"transfer-{init}"
        config = RECIPE.transfer.train_config("transfer", args.transfer_steps, seed=0)
        summary = once(transfer / "train_summary.json", lambda: train_command(
            str(converted), DATA, str(transfer), config, resume=has_checkpoint(transfer)))
        rows.append({"variant": f"init={init}", "stage": "after transfer", **ppl(str(transfer), f"{init}-transfer"),
                     "train_tokens": summary["tokens"], "train_minutes": summary["elapsed_s"] / 60})
    lm = work / "lm-reuse"
    config = RECIPE.lm.train_config("lm", args.lm_steps, seed=0)
    summary = once(lm / "train_summary.json", lambda: train_command(
        str(work / "transfer-reuse"), DATA, str(lm), config, resume=has_checkpoint(lm)))
    transfer_summary = json.loads((work / "transfer-reuse" / "train_summary.json").read_text())
    rows.append({"variant": "init=reuse", "stage": "after transfer + lm", **ppl(str(lm), "reuse-lm"),
                 "train_tokens": transfer_summary["tokens"] + summary["tokens"],
                 "train_minutes": (transfer_summary["elapsed_s"] + summary["elapsed_s"]) / 60})

    original = rows[0]["ppl"]
    for row in rows:
        row["ppl_ratio"] = row["ppl"] / original
    write_json_atomic(RESULTS / "recovery.json", {"model": args.model, "beta": args.beta, "rows": rows,
                                                  "eval_tokens": rows[0]["tokens"], "written": time.strftime("%Y-%m-%d")})
    lines = ["| variant | stage | perplexity | x original | training tokens | training minutes |", "|---|---|---|---|---|---|"]
    for row in rows:
        tokens = f"{row['train_tokens']:,}" if "train_tokens" in row else "-"
        minutes = f"{row['train_minutes']:.1f}" if "train_minutes" in row else "-"
        lines.append(f"| {row['variant']} | {row['stage']} | {row['ppl']:.2f} | {row['ppl_ratio']:.2f} | {tokens} | {minutes} |")
    write_text_atomic(RESULTS / "recovery-table.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
