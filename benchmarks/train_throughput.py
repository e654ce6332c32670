"""Training throughput (tokens/s) of the lm stage against training the original model, in
one process on the same batches: fp32 or bf16 autocast as `--precision auto` picks.

Writes docs/results/train_throughput.json.

    python benchmarks/train_throughput.py [--converted runs/recovery/transfer-reuse] [--steps 3]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from recurformer.files import write_json_atomic
from recurformer.loading import load_converted, load_model
from recurformer.train.lm import LMObjective
from recurformer.train.loop import resolve_precision

ROOT = Path(__file__).resolve().parent.parent


def tokens_per_second(model, objective, batches, autocast: bool) -> float:
    module = objective.prepare(model)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-5)
    times = []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, _ = objective.loss(module, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i > 0:  # the first step warms up
            times.append(time.perf_counter() - start)
    return batches[0].numel() * len(times) / sum(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--converted", default=str(ROOT / "runs" / "recovery" / "transfer-reuse"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    autocast = resolve_precision("auto") == "bf16"
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 49152, (args.batch_size, args.seq_len), generator=generator) for _ in range(args.steps + 1)]
    rows = []
    for name, trainable in (("original", "all"), ("converted", "all"), ("converted", "mixers+lora"), ("converted", "mixers")):
        model = load_model("smollm2-135m", progress=False)[0] if name == "original" else load_converted(args.converted)[0]
        rate = tokens_per_second(model.train(), LMObjective(trainable), batches, autocast)
        rows.append({"model": name, "trainable": trainable, "tokens_per_s": rate})
        print(rows[-1], flush=True)
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["ratio_to_original"] = row["tokens_per_s"] / base
    write_json_atomic(ROOT / "docs" / "results" / "train_throughput.json", {
        "bf16_autocast": autocast, "batch_size": args.batch_size, "seq_len": args.seq_len, "timed_steps": args.steps,
        "threads": torch.get_num_threads(), "rows": rows,
    })


if __name__ == "__main__":
    main()
