"""Tail-training study for the window+* mixers on SmolLM2-135M (docs/mixers.md, "Measured").

One call converts the model (one mixer kind, beta, window, sinks), optionally trains it with
the tail recipe (transfer stage on the tail, then KL-only distillation; docs/training.md),
measures perplexity on 2,048-token windows of held-out and out-of-domain text, and appends
one JSON line to `--out`:

    python -m benchmarks.quality.tail_study --kind window --window 64 --out runs/tail/study.jsonl
    python -m benchmarks.quality.tail_study --kind window+mamba2 --transfer-steps 30 --lm-steps 12 --out ...

`--tail evicted` replaces the recurrent branch of window+mamba2 by one that reads only the
tokens older than the window (full forward only, no decoding: the experiment behind the
choice of reading every token). `--kind original` measures the unconverted model.
Runs with one torch thread, as the shared 2-core machine asks.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from recurformer import HeadScores, MixerConfig, convert, make_scorer, select_heads
from recurformer.data import load_documents, token_sequences, tokenize_documents
from recurformer.mixers import Mamba2Mixer, window_recurrent
from recurformer.ops.ssd import ssd
from recurformer.hub import resolve_model
from recurformer.recipe import RECIPES
from recurformer.train import LMObjective, TrainConfig, TransferObjective, train

from benchmarks.common import RESULTS, TEXTS, TRAIN

SCORES = RESULTS / "smollm2-135m-scores.json"
TAIL = RECIPES["tail"]  # the study's defaults: run's tail recipe


class EvictedTailMamba2(Mamba2Mixer):
    """Mamba-2 that reads only tokens at least `window` steps old: the output at t is the
    ordinary state at t - window, decayed to t and read by the query of t,

        y_t = C_t exp(a_{t-w+1} + ... + a_t) S_{t-w},

    computed as one SSD call whose query at s is C_{s+w} times that decay, shifted by w.
    Full forward only (the study's training and perplexity need nothing else)."""

    def forward(self, x, state=None, attention_mask=None, position_embeddings=None):
        if state is not None or (attention_mask is not None and not bool(attention_mask.all())):
            raise NotImplementedError("the evicted-tail experiment supports an unpadded full forward only")
        batch, length = x.shape[:2]
        w = self.config.window
        z, xs, dt, B, C, _ = self.scan_inputs(x)
        dt, C = dt.float(), C.float()
        y = torch.zeros(batch, length, self.n_heads, self.head_dim, dtype=torch.float32, device=x.device)
        if length > w:
            a = (dt * self.A.float()).double()
            ahead = F.pad(a.cumsum(1), (0, 0, 1, 0))  # ahead[s] = a_1 + ... + a_s
            decay = torch.exp((ahead[:, w + 1:] - ahead[:, 1:length - w + 1]).clamp_min(-80.0)).float()  # [B, T - w, H]
            queries = C[:, w:] * decay[..., None]
            with torch.autocast(x.device.type, enabled=False):
                late = ssd(xs[:, : length - w].float(), dt[:, : length - w], self.A.float(), B[:, : length - w].float(), queries,
                           None, chunk_size=self.config.ssd_chunk)
            y[:, w:] = late
        return self._output(y.to(z.dtype), z)


def load_teacher():
    directory = resolve_model("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(directory)


BUCKETS = ((1, 64), (64, 256), (256, 1024), (1024, 2048))


@torch.no_grad()
def evaluate(model, tokenizer, tokens: int, context: int) -> tuple[dict, dict]:
    """Perplexity of each evaluation text over non-overlapping windows of `context` tokens
    (as `evaluate.perplexity` with stride = context), and by the scored token's position
    in its window (BUCKETS, [first, last) positions)."""
    results, by_position = {}, {}
    for name, file in TEXTS.items():
        ids = torch.tensor(tokenize_documents(tokenizer, load_documents([file])))[:tokens]
        nll = torch.zeros(context)
        count = torch.zeros(context)
        for start in range(0, len(ids) - 1, context):
            window = ids[start:start + context]
            logits = model(window[None], use_cache=False).logits[0, :-1].float()
            losses = F.cross_entropy(logits, window[1:], reduction="none")
            nll[1:len(window)] += losses
            count[1:len(window)] += 1
        results[name] = torch.exp(nll.sum() / count.sum()).item()
        by_position[name] = {f"{a}-{b}": torch.exp(nll[a:b].sum() / count[a:b].sum()).item()
                             for a, b in BUCKETS if a < context}
    return results, by_position


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", required=True, help="original, window, window+mamba, window+mamba2, window+linear, mamba, mamba2")
    p.add_argument("--beta", type=float, default=0.75)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--ssd-state", default="head_dim")
    p.add_argument("--feature-dim", default="head_dim")
    p.add_argument("--tail", choices=("all", "evicted"), default="all")
    p.add_argument("--transfer-steps", type=int, default=0)
    p.add_argument("--lm-steps", type=int, default=0)
    p.add_argument("--unfreeze-steps", type=int, default=0, help="lm steps on all mixer weights (window too) after the tail")
    p.add_argument("--seq-len", type=int, default=TAIL.transfer.seq_len)
    p.add_argument("--batch", type=int, default=TAIL.transfer.batch_size)
    p.add_argument("--transfer-lr", type=float, default=TAIL.transfer.lr)
    p.add_argument("--lm-lr", type=float, default=TAIL.lm.lr)
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--label", default="")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    started = time.monotonic()

    teacher, tokenizer = load_teacher()
    record = {k: v for k, v in vars(args).items() if k != "out"}
    if args.kind == "original":
        model = teacher
    else:
        if args.tail == "evicted":
            if args.kind != "window+mamba2":
                raise SystemExit("--tail evicted is implemented for window+mamba2 only")
            window_recurrent.WindowMamba2Mixer.branch = EvictedTailMamba2
        ssd_state = args.ssd_state if args.ssd_state == "head_dim" else int(args.ssd_state)
        feature_dim = args.feature_dim if args.feature_dim == "head_dim" else int(args.feature_dim)
        config = MixerConfig(kind=args.kind, window=args.window, sinks=args.sinks, ssd_state=ssd_state, feature_dim=feature_dim)
        spec = select_heads(HeadScores.load(SCORES), beta=args.beta, scorer=make_scorer("recency"))
        model = convert(teacher, spec, config, init="reuse")
        record["groups"] = len(spec.groups)
        out_dir = Path(args.out).parent / f"train-{os.getpid()}"
        sequences = token_sequences(tokenizer, load_documents(TRAIN), args.seq_len, seed=0)
        tail = "tail" if args.kind.startswith("window+") else "mixers"
        stages = []
        if args.transfer_steps:
            stages.append(("transfer", args.transfer_steps, args.transfer_lr, tail, TransferObjective(teacher, model, tail)))
        if args.lm_steps:
            stages.append(("lm", args.lm_steps, args.lm_lr, tail, LMObjective(tail, teacher, 1.0, ce_weight=0.0)))
        if args.unfreeze_steps:
            stages.append(("lm", args.unfreeze_steps, args.lm_lr, "mixers", LMObjective("mixers", teacher, 1.0, ce_weight=0.0)))
        for i, (stage, steps, lr, trainable, objective) in enumerate(stages):
            config = TrainConfig(stage=stage, steps=steps, seq_len=args.seq_len, batch_size=args.batch, lr=lr,
                                 trainable=trainable, distill_weight=1.0 if stage == "lm" else 0.0,
                                 ce_weight=0.0 if stage == "lm" else 1.0, checkpoint_every=10**6)
            summary = train(model, objective, sequences, config, out_dir / f"{i}-{stage}", progress=False)
            log = [json.loads(line) for line in (out_dir / f"{i}-{stage}" / "train_log.jsonl").read_text().splitlines()]
            record[f"stage{i}"] = {"stage": stage, "trainable": trainable, "steps": steps, "lr": lr,
                                   "elapsed_s": summary["elapsed_s"], "first": log[0], "last": log[-1]}
        model.eval()
        gates = [p.abs().mean().item() for n, p in model.named_parameters() if n.endswith(".mixer.gate")]
        if gates:
            record["gate_abs_mean"] = sum(gates) / len(gates)
    record["train_s"] = round(time.monotonic() - started, 1)
    record["ppl"], record["ppl_by_position"] = evaluate(model, tokenizer, args.eval_tokens, args.context)
    record["total_s"] = round(time.monotonic() - started, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
