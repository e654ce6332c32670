"""Does KVzip need its uneven budgets? KVzip's scores (`kept_press.py`) on the original model with
every head kept, against kvpress's KVzip at the same bytes, on the first contexts of the
shared-context set (docs/results/long-context.md, "Shared context"), with each `--allocation`:
`even` (`head`: every head keeps the same count, as the `compose-kvzip@B` rows) and `global`
(all heads' tokens ranked together, as kvpress ranks them and as the `compose-global-kvzip@B`
rows). `global` matching kvpress checks our KVzip; `even` below it measures what the even split
costs KVzip itself.

Writes docs/results/long-context/kvzip-allocation.json (resumable per context and allocation).

    OMP_NUM_THREADS=1 python -m benchmarks.peers.kvzip_allocation --contexts 4 --allocation global
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from recurformer import MixerConfig, convert
from recurformer.config import ReplacementSpec
from recurformer.files import write_json_atomic
from recurformer.loading import load_model

from benchmarks.common import ROOT
from benchmarks.peers.kept_press import KeptPress
from benchmarks.peers.shared_ours import RESULTS, answer_context
from benchmarks.peers.shared_problems import digests
from benchmarks.peers.shared_table import is_exact

ALLOCATIONS = {"even": "head", "global": "global"}  # this script's names -> KeptPress's


def right(answers: dict, context: dict) -> int:
    """Questions of `context` answered exactly, multi-request."""
    return sum(is_exact(r["completion"], n["value"]) for r, n in zip(answers["multi-request"], context["needles"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default=str(ROOT / "runs" / "shared-context-problems.json"))
    parser.add_argument("--peers", default=str(RESULTS / "shared-kvpress.json"))
    parser.add_argument("--row", default="kvzip@0.25", help="kvpress's KVzip row to set against")
    parser.add_argument("--contexts", type=int, default=4)
    parser.add_argument("--allocation", default="even", choices=sorted(ALLOCATIONS))
    parser.add_argument("--out", default=str(RESULTS / "kvzip-allocation.json"))
    args = parser.parse_args()
    for path in (args.problems, args.peers):
        if not Path(path).is_file():
            raise SystemExit(f"error: no such file: {path}")
    problems, peers = json.loads(Path(args.problems).read_text()), json.loads(Path(args.peers).read_text())
    if args.row not in peers["rows"]:
        raise SystemExit(f"error: --row {args.row}: not in {args.peers} ({', '.join(peers['rows'])})")
    accepted = digests(problems)
    if peers.get("problems") not in accepted:
        raise SystemExit(f"error: {args.peers} answers another problem set than {args.problems}")
    torch.set_num_threads(1)
    peer = peers["rows"][args.row]
    keep = peer["cache"] / peer["full"]  # the fraction of the original's bytes the press kept
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.is_file() else {}
    if result.get("problems") not in accepted or result.get("row") != args.row:
        result = {"problems": problems["digest"], "row": args.row, "keep": keep, "contexts": {}}
    result["problems"] = problems["digest"]
    original, tokenizer, _ = load_model(problems["model"], progress=False)
    config = original.config
    every_head_kept = ReplacementSpec(config.num_hidden_layers, config.num_key_value_heads, [])
    model = convert(original, every_head_kept, MixerConfig(kind="window", window=64, sinks=4)).eval()
    eos = set(problems["eos"])
    for index in range(args.contexts):
        done = result["contexts"].setdefault(str(index), {})
        if args.allocation in done:
            continue
        context, start = problems["contexts"][index], time.time()
        press = KeptPress(model, "kvzip", keep, tokenizer, ALLOCATIONS[args.allocation])
        answers = answer_context(model, tokenizer, context, eos, press)
        press.remove()
        done.update({args.allocation: right(answers, context), "kvpress": right(peer["contexts"][str(index)], context),
                     "questions": len(context["needles"]), f"seconds_{args.allocation}": time.time() - start})
        write_json_atomic(out, result)
        print(f"context {index}: {done}", flush=True)
    measured = [c for c in result["contexts"].values() if args.allocation in c]
    ours, theirs = (sum(c[k] for c in measured) for k in (args.allocation, "kvpress"))
    total = sum(c["questions"] for c in measured)
    print(f"KVzip's scores, allocation {args.allocation}, keeping {keep:.3f} of the tokens: {ours}/{total}; "
          f"kvpress's KVzip: {theirs}/{total}")


if __name__ == "__main__":
    main()
