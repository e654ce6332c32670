"""Retrieval study: which KV groups can become recurrent, and what is lost.

Small Llama models are trained from scratch on token-level retrieval tasks (MQAR and
HashHop, `recurformer.tasks`) until they solve them. Each is scored with `analyze` on task
sequences and converted at several `beta` with three group scorers (recency, random,
inverse) and a between-layer hybrid (whole layers, ranked by mean recency), for each
mixer. Every variant gets the same continual training (transfer stage, then an lm stage
on the task's answer tokens), then is evaluated on held-out problems at the training
length and at 2x and 4x longer contexts, with its cache measured after a forward pass.

Resumable: every unit of work (a trained base model with its head scores, a converted and
trained variant, an evaluation) is written atomically into `--work` and skipped when it
exists. At the end, `results.json`, `README.md` and plots are written into `--out`.

    python -m benchmarks.retrieval.study                # the full study (< 2 h on 2 cores)
    python -m benchmarks.retrieval.study --part headline  # beta 0 and the headline rows only
    python -m benchmarks.retrieval.study --estimate     # pending units and measured time per unit
    python -m benchmarks.retrieval.study --report-only  # results.json, README.md and plots from finished units
    python -m benchmarks.retrieval.study --quick --out /tmp/q --work /tmp/q/work  # pipeline check

Decisions ([ours], see docs/results/retrieval/README.md): longer contexts keep the
training density (2x the tokens hold 2x the pairs or chains), so a fixed-size state must
hold 2x more; the lm stage trains all weights (the same for every variant, beta 0 too);
`beta = 0` and `beta = 1` do not depend on the scorer and are run once.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as transformers_logging

import recurformer  # noqa: F401  (registers the recurformer model type with the Auto classes)
from recurformer.bench import cache_bytes
from recurformer.config import ConfigError, ReplacementSpec
from recurformer.files import atomic_directory, write_json_atomic
from recurformer.mixers import MIXER_KINDS, MixerConfig
from recurformer.scoring import HeadScores, analyze, make_scorer, select_heads, select_layers
from recurformer.surgery import convert
from recurformer.tasks import align_predictions
from recurformer.train import LMObjective, TrainConfig, TransferObjective, train

from benchmarks.common import ROOT
from benchmarks.retrieval.design import EVAL_SEED, PARTS, Study, Unit, Variant, check_work_dir, data_seed, plan
from benchmarks.retrieval.report import write_report


# ---------------------------------------------------------------------------- units


def base_config(study: Study, task) -> LlamaConfig:
    """A Llama (rotary positions) whose position table covers the longest evaluation.

    [ours] With q/k/v/o biases (Llama's `attention_bias`): the setting our calibration runs
    learned the tasks with; the surgery carries biases over like any other weight.
    """
    config = LlamaConfig(
        vocab_size=task.vocab_size, hidden_size=study.hidden, intermediate_size=study.intermediate,
        num_hidden_layers=study.layers, num_attention_heads=study.heads, num_key_value_heads=study.kv_heads,
        max_position_embeddings=task.seq_len * max(study.scales), attention_bias=True,
    )
    config._attn_implementation = "sdpa"
    return config


def stage_config(study: Study, task, stage: str, steps: int, lr: float, seed: int) -> TrainConfig:
    """fp32 ([ours]: bf16 autocast is slower than fp32 for matrices this small, measured),
    one checkpoint at the end (a unit is redone whole if interrupted)."""
    return TrainConfig(
        stage=stage, steps=steps, seq_len=task.seq_len, batch_size=study.continual_batch_size, lr=lr,
        weight_decay=0.1 if stage == "lm" else 0.0, trainable="all" if stage == "lm" else "mixers",
        precision="no", checkpoint_every=steps, seed=seed,
    )


def train_on_task(model, objective, data: dict[str, Tensor], config: TrainConfig, out: Path) -> dict:
    """One `train` stage; the loss counts the answer tokens only when the objective is lm."""
    labels = data["labels"] if config.stage == "lm" else None
    summary = train(model, objective, data["input_ids"], config, out, progress=False, labels=labels)
    shutil.rmtree(out / "checkpoint", ignore_errors=True)  # the unit is the model, not a resumable run
    return summary


def run_base(study: Study, unit: Unit, out: Path) -> dict:
    """Train a base model on its task until it solves it, then score its heads on task sequences."""
    task, seed = unit.task, unit.seed
    torch.manual_seed(seed)
    model = LlamaForCausalLM(base_config(study, task))
    if task.warm_start:
        source = unit.home.parent.parent / task.warm_start / f"s{seed}" / "base" / "model"
        model.load_state_dict(LlamaForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict())
    record = train_until_solved(model, task, study, seed, out / "train_log.jsonl")
    model.eval().save_pretrained(out / "model")
    sequences = task.make(study.analyze_sequences, 1, data_seed(seed, "analysis"))["input_ids"]
    scores = analyze(model, sequences, window=study.recency_window, windows=(study.recency_window,), batch_size=16,
                     model_name=f"{task.name}-s{seed}", progress=False)
    scores.save(out / "scores.json")
    return {**record, "parameters": sum(p.numel() for p in model.parameters()),
            "accuracy_x1": evaluate_accuracy(model, task, study, 1)["accuracy"]}


def train_until_solved(model, task, study: Study, seed: int, log: Path) -> dict:
    """[ours] AdamW (betas 0.9/0.95, weight decay 0.1, clip 1), linear warmup then a constant
    lr, loss on answer tokens; every `base_check_every` steps the accuracy on held-out
    validation problems is measured and training stops once it reaches `base_solved` (or at
    `base_max_steps`). Retrieval appears suddenly after a plateau of unpredictable length
    (measured on HashHop: one run jumped from 6% to 96% between steps 300 and 400, another
    with a shorter cosine schedule was still at 7% at step 600), so a fixed schedule either
    wastes time or stops on the plateau. Returns steps, final loss and validation accuracy.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=study.base_lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, study.base_check_every // 2)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    validation = task.make(study.eval_examples, 1, data_seed(seed, "validation"))
    started, step, accuracy, loss = time.monotonic(), 0, 0.0, float("nan")
    while step < study.base_max_steps and accuracy < study.base_solved:
        steps = min(study.base_check_every, study.base_max_steps - step)
        data = task.make(steps * study.batch_size, 1, data_seed(seed, "base") * 1000 + step)
        model.train()
        for ids, labels in zip(data["input_ids"].split(study.batch_size), data["labels"].split(study.batch_size)):
            loss = model(input_ids=ids, labels=labels, use_cache=False).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
        accuracy = task.score(predict(model, validation), validation["labels"])["accuracy"]
        with open(log, "a") as handle:
            handle.write(json.dumps({"step": step, "loss": loss.item(), "validation_accuracy": accuracy,
                                     "elapsed_s": round(time.monotonic() - started, 1)}) + "\n")
    return {"steps": step, "final_loss": loss.item(), "validation_accuracy": accuracy, "solved": accuracy >= study.base_solved}


def select(scores: HeadScores, variant: Variant, seed: int) -> ReplacementSpec:
    """The groups `variant` replaces; `layer` ranks whole layers by their mean recency."""
    if variant.selector == "none":
        return ReplacementSpec.empty(scores.num_layers, scores.num_kv_heads)
    if variant.selector == "layer":
        return select_layers(scores, variant.beta, make_scorer("recency"))
    scorer = make_scorer("recency" if variant.selector == "all" else variant.selector, seed)
    return select_heads(scores, variant.beta, scorer)


def mixer_config(study: Study, kind: str) -> MixerConfig:
    """Mixer defaults, except the window mixer's span (a study setting) and its sinks.

    [ours] No attention sinks for the window mixer: these models have no BOS token, and
    the first tokens of a problem are task content (MQAR's first pairs), which sinks
    would let the mixer look up forever.
    """
    if kind == "window":
        return MixerConfig(kind="window", window=study.mixer_window, sinks=0)
    return MixerConfig(kind="mamba" if kind == "none" else kind)


def run_variant(study: Study, unit: Unit, out: Path, base, scores: HeadScores) -> dict:
    """Convert `base`, then the same continual training for every variant: transfer (skipped
    when nothing is replaced), then lm on the task's answers with all weights trainable."""
    task, seed, variant = unit.task, unit.seed, unit.variant
    spec = select(scores, variant, seed)
    student = convert(base, spec, mixer_config(study, variant.mixer), init="reuse", seed=seed)
    data = task.make(max(study.transfer_steps, study.lm_steps) * study.continual_batch_size, 1, data_seed(seed, "continual"))
    recency = scores.group_values()
    record = {"groups": len(spec.groups), "fraction": spec.fraction, "spec": spec.to_dict(),
              "replaced_recency": statistics.fmean(recency[g] for g in spec.groups) if spec.groups else None,
              "accuracy_converted": evaluate_accuracy(student, task, study, 1)["accuracy"], "accuracy_transfer": None}
    if spec.groups:
        config = stage_config(study, task, "transfer", study.transfer_steps, study.transfer_lr, seed)
        record["transfer"] = train_on_task(student, TransferObjective(base, student), data, config, out / "transfer")
        record["accuracy_transfer"] = evaluate_accuracy(student, task, study, 1)["accuracy"]
    config = stage_config(study, task, "lm", study.lm_steps, study.lm_lr, seed)
    record["lm"] = train_on_task(student, LMObjective("all"), data, config, out / "lm")
    student.eval().save_pretrained(out / "model")
    return record


@torch.no_grad()
def predict(model, data: dict[str, Tensor], batch_size: int = 64) -> Tensor:
    """Greedy next-token guesses `[N, T]` aligned with `data["labels"]` (teacher forcing)."""
    model.eval()
    return torch.cat([
        align_predictions(model(ids, use_cache=False).logits, labels)
        for ids, labels in zip(data["input_ids"].split(batch_size), data["labels"].split(batch_size))
    ])


def evaluate_accuracy(model, task, study: Study, scale: int) -> dict:
    """The task's scores on `eval_examples` held-out problems at `scale` x the training length."""
    data = task.make(study.eval_examples, scale, EVAL_SEED + scale)
    return task.score(predict(model, data), data["labels"])


@torch.no_grad()
def cache_footprint(model, task, scale: int) -> dict:
    """Cache bytes after a forward over one problem of `scale` x the training length."""
    ids = task.make(1, scale, EVAL_SEED + scale)["input_ids"]
    out = model(ids, use_cache=True)
    kv, _, state = cache_bytes(out.past_key_values)
    return {"tokens": ids.shape[1], "kv_bytes": kv, "state_bytes": state, "bytes": kv + state}


def run_eval(study: Study, unit: Unit, model) -> dict:
    """Accuracy and cache at every scale."""
    record = {}
    for scale in study.scales:
        scores = evaluate_accuracy(model, unit.task, study, scale)
        record[f"x{scale}"] = {**scores, "cache": cache_footprint(model, unit.task, scale)}
    return record


# ---------------------------------------------------------------------------- running


class Models:
    """The base model and head scores of one (task, seed), loaded once and kept."""

    def __init__(self) -> None:
        self.key = None

    def get(self, unit: Unit, base_dir: Path):
        if self.key != (unit.task.name, unit.seed):
            self.model = LlamaForCausalLM.from_pretrained(base_dir / "model", dtype=torch.float32).eval()
            self.scores = HeadScores.load(base_dir / "scores.json")
            self.key = (unit.task.name, unit.seed)
        return self.model, self.scores


def run_unit(study: Study, unit: Unit, models: Models) -> None:
    """Do `unit` and write its result atomically, with its wall time."""
    started = time.monotonic()
    base_dir = unit.home / "base"
    if unit.kind == "base":
        with atomic_directory(unit.path) as out:
            record = run_base(study, unit, out)
            write_json_atomic(out / "unit.json", {**record, "elapsed_s": time.monotonic() - started})
    elif unit.kind == "variant":
        base, scores = models.get(unit, base_dir)
        with atomic_directory(unit.path) as out:
            record = run_variant(study, unit, out, base, scores)
            write_json_atomic(out / "unit.json", {**record, "elapsed_s": time.monotonic() - started})
    else:
        if unit.variant is None:
            model = models.get(unit, base_dir)[0]
        else:
            variant_dir = Unit("variant", unit.task, unit.seed, unit.variant, unit.home).path
            model = AutoModelForCausalLM.from_pretrained(variant_dir / "model", dtype=torch.float32)
        record = run_eval(study, unit, model)
        write_json_atomic(unit.path, {**record, "elapsed_s": time.monotonic() - started})


def elapsed(unit: Unit) -> float:
    """The measured wall time of a finished unit."""
    path = unit.path / "unit.json" if unit.kind != "eval" else unit.path
    return json.loads(path.read_text())["elapsed_s"]


def estimate(units: list[Unit]) -> list[str]:
    """Pending units per kind and the time they need at the mean measured time of their kind."""
    done, pending = {}, {}
    for unit in units:
        if unit.path.exists():
            done.setdefault(unit.timing_kind, []).append(elapsed(unit))
        else:
            pending[unit.timing_kind] = pending.get(unit.timing_kind, 0) + 1
    lines, total, unknown = [], 0.0, []
    for kind in sorted(set(done) | set(pending)):
        times, count = done.get(kind, []), pending.get(kind, 0)
        mean = statistics.fmean(times) if times else None
        measured = f"{mean:.1f} s/unit measured over {len(times)}" if mean is not None else "not measured yet"
        lines.append(f"  {kind:16s} {len(times):3d} done, {count:3d} pending, {measured}")
        if count and mean is None:
            unknown.append(kind)
        total += count * (mean or 0.0)
    tail = f" (+ unmeasured: {', '.join(unknown)})" if unknown else ""
    spent = sum(sum(times) for times in done.values())
    lines.append(f"  spent so far: {spent / 60:.1f} min; estimated remaining: {total / 60:.1f} min{tail}; "
                 f"estimated whole plan: {(spent + total) / 60:.1f} min")
    return lines



# ---------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="toy sizes: checks the pipeline in well under a minute")
    parser.add_argument("--part", choices=PARTS, default="all", help="headline: beta 0 and the headline rows only")
    parser.add_argument("--tasks", default="mqar,hashhop", help="comma-separated task names")
    parser.add_argument("--mixers", default="mamba,window", help=f"comma-separated, from {', '.join(MIXER_KINDS)}")
    parser.add_argument("--seeds", type=int, default=3, help="number of seeds (0..n-1); the first runs the whole grid")
    parser.add_argument("--out", default=None, help="results directory (default docs/results/retrieval; quick: runs/retrieval-quick)")
    parser.add_argument("--work", default=None, help="units directory (default runs/retrieval; quick: runs/retrieval-quick/work)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default 2, the machines' cores; --quick: 1, its matrices are too small to share)")
    parser.add_argument("--estimate", action="store_true", help="print pending units and the time they need; run nothing")
    parser.add_argument("--report-only", action="store_true", help="write the results and README from finished units; run nothing")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.seeds < 1:
            raise ConfigError(f"--seeds must be >= 1, got {args.seeds}")
        if args.threads is not None and args.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {args.threads}")
        mixers = tuple(m for m in args.mixers.split(",") if m)
        study = Study.quick(mixers) if args.quick else Study.full(mixers, tuple(range(args.seeds)))
        study = study.only([t for t in args.tasks.split(",") if t])
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    default = ROOT / "runs" / ("retrieval-quick" if args.quick else "retrieval")
    out = Path(args.out) if args.out else (default if args.quick else ROOT / "docs" / "results" / "retrieval")
    work = Path(args.work) if args.work else (default / "work" if args.quick else default)
    units = plan(study, work, args.part)
    try:
        check_work_dir(study, work, record=not (args.estimate or args.report_only))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.estimate:
        print("\n".join([f"{len(units)} units in {work}:"] + estimate(units)))
        return 0
    if args.report_only:
        results = write_report(study, units, out)
        print(f"{len(results['rows'])} result rows; wrote {out / 'README.md'}")
        return 0
    torch.set_num_threads(args.threads or (1 if args.quick else 2))
    transformers_logging.disable_progress_bar()  # one bar for the study, not one per saved or loaded model
    started, ran = time.monotonic(), 0
    models = Models()
    bar = tqdm(units, desc="retrieval study", unit="unit")
    for unit in bar:
        if unit.path.exists():
            continue
        bar.set_postfix_str(unit.label)
        run_unit(study, unit, models)
        ran += 1
    results = write_report(study, units, out)
    print(f"{ran} units run in {(time.monotonic() - started) / 60:.1f} min, {len(results['rows'])} result rows; "
          f"wrote {out / 'README.md'}")
    print("\n".join(estimate(units)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
