"""Training throughput (tokens/s) of the lm stage against training the original model the
same way, in one process on the same batches: the same next-token loss, the same layer
recompute (`LMObjective`'s default, as `recurformer run` trains), fp32 or bf16 autocast as
`--precision auto` picks. The converted models are built here from the committed head
scores (SmolLM2-135M, recency selection at `--beta`), so the benchmark needs no earlier run.
Each round measures every row once, in order; a ratio is taken within a round, and the JSON
keeps its median over the rounds with the range.

Writes docs/results/train_throughput.json.

    python -m benchmarks.speed.train_throughput [--beta 0.5] [--steps 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from recurformer import HeadScores, MixerConfig, convert, make_scorer, select_heads
from recurformer.files import write_json_atomic
from recurformer.loading import load_model
from recurformer.train.lm import LMObjective
from recurformer.train.loop import resolve_precision

from benchmarks.common import RESULTS

SCORES = RESULTS / "smollm2-135m-scores.json"
# (model kind, trainable set, recompute): the original first, as the baseline of the ratios
ROWS = (
    ("original", "all", True),
    ("original", "all", False),
    ("mamba", "all", True),
    ("mamba", "mixers", True),
    ("window+mamba2", "all", True),
    ("window+mamba2", "tail", True),
)


def tokens_per_second(model, objective, batches, autocast: bool) -> float:
    """Tokens/s of optimizer steps on `batches` (each `[b, T]`), the first step untimed."""
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
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="ratios are medians over rounds, with their range")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    autocast = resolve_precision("auto") == "bf16"
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 49152, (args.batch_size, args.seq_len), generator=generator) for _ in range(args.steps + 1)]
    spec = select_heads(HeadScores.load(SCORES), beta=args.beta, scorer=make_scorer("recency"))
    rates = {row: [] for row in ROWS}
    for round_ in range(args.rounds):
        for kind, trainable, recompute in ROWS:
            model = load_model("smollm2-135m", progress=False)[0]
            if kind != "original":
                model = convert(model, spec, MixerConfig(kind=kind), init="reuse")
            rate = tokens_per_second(model.train(), LMObjective(trainable, recompute=recompute), batches, autocast)
            rates[(kind, trainable, recompute)].append(rate)
            print(f"round {round_}: {kind} {trainable} recompute={recompute}: {rate:.1f} tokens/s", flush=True)
            del model
    rows = []
    for row, values in rates.items():
        ratios = [value / base for value, base in zip(values, rates[ROWS[0]])]  # within each round
        kind, trainable, recompute = row
        rows.append({"model": kind, "trainable": trainable, "recompute": recompute,
                     "tokens_per_s": statistics.median(values), "ratio_to_original": statistics.median(ratios),
                     "ratio_range": [min(ratios), max(ratios)]})
    write_json_atomic(RESULTS / "train_throughput.json", {
        "bf16_autocast": autocast, "beta": args.beta, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "timed_steps": args.steps, "rounds": args.rounds, "threads": torch.get_num_threads(), "rows": rows,
    })


if __name__ == "__main__":
    main()
