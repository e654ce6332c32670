"""The trained-original control: the original model trained by `recurformer run`'s lm recipe.

After training on WikiText, a converted model can score below the original on WikiText
test (the trained `window` model reached 0.87x): that is adaptation to the training
domain, not recovery of the original. Of `recurformer run`'s two stages only the lm stage
sees the next-token loss (the transfer stage fits the replaced heads' outputs), so this
control trains the ORIGINAL model as that stage trains a converted one: LoRA adapters
(rank 8, merged after) on next-token cross-entropy plus KL to the frozen original, on the
run's training sequences, at its learning rate, for its 16 steps of 8 x 512 tokens
(65,536 tokens), and measures the same perplexities as `run` (held-out and out-of-domain,
the first 16,384 tokens in windows of 2,048). A converted model has only recovered the
original where it is close to it and this control does not explain the difference. The
tail recipe of the window+* mixers trains on the KL alone, which leaves the original where
it is: for them the control is the original itself.

    python -m benchmarks.quality.trained_original --out docs/results/trained-original.json
"""

from __future__ import annotations

import argparse
import os

import torch

from recurformer.data import load_documents, token_sequences
from recurformer.evaluate import lookup_task, make_options
from recurformer.files import write_json_atomic
from recurformer.loading import load_model
from recurformer.recipe import RECIPES
from recurformer.train import has_checkpoint, objective_for, train

from benchmarks.common import RESULTS, TEXTS, TRAIN

LM = RECIPES["mixers"].lm  # the lm stage of run's recipe for the mixers without a tail


def perplexities(model, tokenizer) -> dict[str, float]:
    """Held-out and out-of-domain perplexity, sized as in `recurformer run`."""
    task, _ = lookup_task("ppl")
    return {label: task.evaluate(model.eval(), tokenizer, make_options(
        task, {"data": [str(path)], "context": 2048, "max_tokens": 16384}))["ppl"] for label, path in TEXTS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps of 8 x 512 tokens (the lm stage's)")
    parser.add_argument("--lr", type=float, default=LM.lr, help="peak learning rate (the lm stage's)")
    parser.add_argument("--work", default="runs/trained-original", help="checkpoints (a re-run resumes)")
    parser.add_argument("--out", default=str(RESULTS / "trained-original.json"))
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model, tokenizer, _ = load_model("smollm2-135m")
    teacher, _, _ = load_model("smollm2-135m")
    before = perplexities(model, tokenizer)
    print("original", before, flush=True)
    config = LM.train_config("lm", args.steps, seed=0, lr=args.lr)
    sequences = token_sequences(tokenizer, load_documents(TRAIN), config.seq_len, seed=0)
    resume = has_checkpoint(args.work)
    summary = train(model, objective_for(config, model, teacher), sequences, config, args.work, resume=resume)
    after = perplexities(model, tokenizer)
    print("trained original", after, flush=True)
    write_json_atomic(args.out, {
        "recipe": "LoRA r8 (merged) on cross-entropy + KL to the frozen original, the lm stage of recurformer run",
        "steps": args.steps, "tokens": args.steps * config.batch_size * config.seq_len, "lr": args.lr,
        "train_data": [p.name for p in TRAIN], "ppl_context": 2048, "ppl_tokens": 16384,
        "original": before, "trained_original": after,
        "ratio": {label: after[label] / before[label] for label in TEXTS},
        "train_minutes": round(summary["elapsed_s"] / 60, 2),
    })
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
