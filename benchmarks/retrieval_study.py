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

    python benchmarks/retrieval_study.py                # the full study (< 2 h on 2 cores)
    python benchmarks/retrieval_study.py --part headline  # beta 0 and the headline rows only
    python benchmarks/retrieval_study.py --estimate     # pending units and measured time per unit
    python benchmarks/retrieval_study.py --report-only  # results.json, README.md and plots from finished units
    python benchmarks/retrieval_study.py --quick --out /tmp/q --work /tmp/q/work  # pipeline check

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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as transformers_logging

import recurformer  # noqa: F401  (registers the recurformer model type with the Auto classes)
from recurformer.bench import cache_bytes
from recurformer.config import MIXER_KINDS, ConfigError, MixerConfig, ReplacementSpec
from recurformer.files import atomic_directory, write_json_atomic, write_text_atomic
from recurformer.report import plot_head_heatmap, save_figure
from recurformer.scoring import HeadScores, analyze, make_scorer, select_heads, select_layers
from recurformer.surgery import convert
from recurformer.tasks import align_predictions, hashhop_tokens, mqar_tokens, score_hashhop_tokens, score_mqar
from recurformer.train import LMObjective, TrainConfig, TransferObjective, train

import matplotlib.pyplot as plt  # noqa: E402  (after recurformer.report, which selects the headless backend)
import matplotlib.ticker  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SELECTORS = ("recency", "random", "inverse", "layer")
PARTS = ("all", "headline")
EVAL_SEED = 1_000_000  # + scale: held out from every training seed (training uses seed * 10 + k)


# ---------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class MQAR:
    """Multi-query associative recall; at `scale` s: s x the tokens and s x the pairs.

    [ours] Positions between queries hold PAD, not Zoology's random fillers: with a
    vocabulary this small (Zoology's is 8192) a random filler often repeats a key with
    another token after it, and the most recent `key -> next token` is then a wrong answer.
    """

    seq_len: int
    kv_pairs: int
    vocab_size: int
    warm_start: str | None = None  # a task whose base model (same seed) this one's training starts from
    name: str = "mqar"

    def make(self, num: int, scale: int, seed: int) -> dict[str, Tensor]:
        """`{"input_ids", "labels"}` `[num, seq_len * scale]`."""
        return mqar_tokens(num, self.seq_len * scale, self.kv_pairs * scale, self.vocab_size, seed=seed,
                           random_non_queries=False)

    def score(self, predictions: Tensor, labels: Tensor) -> dict:
        return score_mqar(predictions, labels)

    def describe(self) -> str:
        return f"MQAR, {self.kv_pairs} key-value pairs in {self.seq_len} tokens, vocabulary {self.vocab_size}"


@dataclass(frozen=True)
class HashHop:
    """Token HashHop with chain of thought (each hop is written out, so each answer token is
    one lookup); at `scale` s: s x the chains and s x the queries, hence s x the tokens."""

    n_chains: int
    hops: int
    queries: int
    vocab_size: int
    warm_start: str | None = None
    name: str = "hashhop"

    @property
    def seq_len(self) -> int:
        return self.n_chains * self.hops * 3 + self.queries * (2 + self.hops)

    def make(self, num: int, scale: int, seed: int) -> dict[str, Tensor]:
        """`{"input_ids", "labels"}` `[num, seq_len * scale]`."""
        return hashhop_tokens(num, self.n_chains * scale, self.hops, self.vocab_size, seed=seed, cot=True,
                              num_queries=self.queries * scale)

    def score(self, predictions: Tensor, labels: Tensor) -> dict:
        return score_hashhop_tokens(predictions, labels)

    def describe(self) -> str:
        return (f"HashHop (chain of thought), {self.n_chains} chains of {self.hops} hops, {self.queries} queries, "
                f"{self.seq_len} tokens, vocabulary {self.vocab_size}")


def warm_started_tasks(hashhop: HashHop, mqar: MQAR) -> tuple:
    """[ours] HashHop first, then MQAR starting from the HashHop model of the same seed.

    From a random init our MQAR models settled into a solution without retrieval: answer
    with a value of the context that has not been asked yet (about 34% with 8 pairs, the
    accuracy of that guess; measured for learning rates 1e-3 to 1e-2, batch sizes 16 to 64,
    up to 3000 steps, with and without fillers, tied embeddings or biases). HashHop, whose
    keys and values share one vocabulary, offers no such shortcut, and its models learn
    retrieval after a plateau; MQAR then only has to learn its format.
    """
    return hashhop, replace(mqar, warm_start=hashhop.name)


# ---------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Study:
    """Everything that decides the numbers. Validated up front; see `full()` and `quick()`."""

    tasks: tuple
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    batch_size: int
    base_max_steps: int
    base_check_every: int
    base_solved: float  # validation accuracy at which a base model counts as solving its task
    base_lr: float
    continual_batch_size: int
    transfer_steps: int
    transfer_lr: float
    lm_steps: int
    lm_lr: float
    analyze_sequences: int
    recency_window: int  # w of the recency ratio RR, in tokens
    mixer_window: int  # tokens seen by the `window` mixer
    eval_examples: int
    scales: tuple[int, ...]
    betas: tuple[float, ...]
    mixers: tuple[str, ...]
    seeds: tuple[int, ...]
    headline_beta: float
    headline_selectors: tuple[str, ...]
    tolerance: float  # accuracy drop (absolute) that counts as "broken" in the conclusions
    margin: float  # accuracy difference (absolute) below which two variants count as level

    def __post_init__(self) -> None:
        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        require(self.heads % self.kv_heads == 0, f"--heads {self.heads} is not a multiple of kv heads {self.kv_heads}")
        require(all(0.0 <= b <= 1.0 for b in self.betas), f"--betas must be in [0, 1], got {list(self.betas)}")
        require(0.0 < self.headline_beta < 1.0, f"headline beta must be in (0, 1), got {self.headline_beta}")
        require(self.headline_beta in self.betas, f"headline beta {self.headline_beta} is not among --betas {list(self.betas)}")
        unknown = [m for m in self.mixers if m not in MIXER_KINDS]
        require(not unknown, f"--mixers: {', '.join(unknown)} not available in this recurformer (have: {', '.join(MIXER_KINDS)})")
        require(bool(self.mixers), "--mixers: give at least one mixer")
        require(bool(self.seeds) and len(set(self.seeds)) == len(self.seeds), f"--seeds must be distinct, got {list(self.seeds)}")
        require(all(0 <= s < 100 for s in self.seeds), f"--seeds must be in [0, 100), got {list(self.seeds)}")
        require(self.base_check_every % 10 == 0 and 1 <= self.base_max_steps < 10_000,
                "base_check_every must be a multiple of 10 and base_max_steps in [1, 10000) (see data_seed)")
        require(self.scales[0] == 1 and list(self.scales) == sorted(set(self.scales)), f"scales must start at 1 and grow, got {self.scales}")
        require(all(s in SELECTORS for s in self.headline_selectors), f"headline selectors must be among {SELECTORS}")
        names = [t.name for t in self.tasks]
        for i, task in enumerate(self.tasks):
            require(task.warm_start is None or task.warm_start in names[:i],
                    f"--tasks: {task.name} starts from the {task.warm_start} model; select {task.warm_start} too")

    @classmethod
    def full(cls, mixers: tuple[str, ...], seeds: tuple[int, ...] = (0, 1, 2)) -> "Study":
        return cls(
            tasks=warm_started_tasks(HashHop(n_chains=8, hops=2, queries=4, vocab_size=128), MQAR(seq_len=64, kv_pairs=8, vocab_size=128)),
            hidden=128, layers=4, heads=4, kv_heads=2, intermediate=256, batch_size=64,
            base_max_steps=3000, base_check_every=100, base_solved=0.97, base_lr=3e-3,
            continual_batch_size=32, transfer_steps=100, transfer_lr=3e-3, lm_steps=150, lm_lr=1e-3,
            analyze_sequences=64, recency_window=4, mixer_window=8, eval_examples=512, scales=(1, 2, 4),
            betas=(0.0, 0.25, 0.5, 0.75, 1.0), mixers=mixers, seeds=seeds, headline_beta=0.5,
            headline_selectors=("recency", "random", "layer"), tolerance=0.05, margin=0.01,
        )

    @classmethod
    def quick(cls, mixers: tuple[str, ...]) -> "Study":
        """A pipeline check: every kind of unit and output, at toy sizes; the numbers mean nothing."""
        return cls(
            tasks=warm_started_tasks(HashHop(n_chains=2, hops=2, queries=1, vocab_size=32), MQAR(seq_len=16, kv_pairs=2, vocab_size=32)),
            hidden=32, layers=2, heads=4, kv_heads=2, intermediate=32, batch_size=8,
            base_max_steps=4, base_check_every=10, base_solved=0.97, base_lr=3e-3,
            continual_batch_size=8, transfer_steps=2, transfer_lr=3e-3, lm_steps=2, lm_lr=1e-3,
            analyze_sequences=4, recency_window=4, mixer_window=4, eval_examples=16, scales=(1, 2, 4),
            betas=(0.0, 0.5, 1.0), mixers=mixers, seeds=(0, 1), headline_beta=0.5,
            headline_selectors=("recency", "layer"), tolerance=0.05, margin=0.01,
        )

    def to_dict(self) -> dict:
        data = asdict(self)
        data["tasks"] = [{"name": t.name, "seq_len": t.seq_len, **asdict(t)} for t in self.tasks]
        return data

    def unit_settings(self, task) -> dict:
        """The settings `task`'s finished units depend on (the others only decide which units exist)."""
        grid = {"tasks", "betas", "mixers", "seeds", "headline_beta", "headline_selectors", "tolerance", "margin"}
        settings = {k: v for k, v in self.to_dict().items() if k not in grid}
        source = next((t for t in self.tasks if t.name == task.warm_start), None)
        tasks = {"task": {"seq_len": task.seq_len, **asdict(task)}}
        if source is not None:  # the base model depends on the one it starts from
            tasks["warm_start_task"] = {"seq_len": source.seq_len, **asdict(source)}
        return json.loads(json.dumps({**settings, **tasks}))

    def only(self, names: list[str]) -> "Study":
        """The same study restricted to the tasks in `names`."""
        known = [t.name for t in self.tasks]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise ConfigError(f"--tasks: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(known)}")
        return replace(self, tasks=tuple(t for t in self.tasks if t.name in names))


def check_work_dir(study: Study, work: Path, record: bool) -> None:
    """Refuse a task directory whose `settings.json` holds other unit settings (skipping its
    finished units would mix two studies); with `record`, write the settings of a new one."""
    for task in study.tasks:
        path, settings = work / task.name / "settings.json", study.unit_settings(task)
        if not path.exists():
            if record:
                write_json_atomic(path, settings)
            continue
        recorded = json.loads(path.read_text())
        changed = sorted(k for k in settings.keys() | recorded.keys() if settings.get(k) != recorded.get(k))
        if changed:
            raise ConfigError(f"{path.parent} holds units made with other settings ({', '.join(changed)}); use another --work")


@dataclass(frozen=True)
class Variant:
    """What is replaced: `selector` in SELECTORS, `none` (beta 0) or `all` (beta 1)."""

    selector: str
    mixer: str
    beta: float

    @property
    def name(self) -> str:
        if self.selector == "none":
            return "none-b0.00"
        return f"{self.mixer}-{self.selector}-b{self.beta:.2f}"


@dataclass(frozen=True)
class Unit:
    """One resumable piece of work: `kind` in base, variant, eval; done when `path` exists.
    `home` is the directory of its (task, seed): `base/`, `variants/<name>/`, `evals/<name>.json`."""

    kind: str
    task: object
    seed: int
    variant: Variant | None
    home: Path

    @property
    def path(self) -> Path:
        if self.kind == "base":
            return self.home / "base"
        name = "original" if self.variant is None else self.variant.name
        return self.home / "variants" / name if self.kind == "variant" else self.home / "evals" / f"{name}.json"

    @property
    def label(self) -> str:
        what = "base model" if self.kind == "base" else (self.variant.name if self.variant else "original")
        return f"{self.kind} {self.task.name} s{self.seed} {what}"

    @property
    def timing_kind(self) -> str:
        """Units whose cost differs get their own estimate (a mixer trains at its own speed)."""
        if self.kind == "variant":
            return f"variant:{self.variant.mixer if self.variant.selector != 'none' else 'none'}"
        return self.kind


def variants(study: Study, seed: int, part: str) -> list[Variant]:
    """The grid for `seed`: everything for the first seed (part `all`), the headline rows
    (beta 0 and the headline selectors at the headline beta) otherwise."""
    out = [Variant("none", "none", 0.0)] if 0.0 in study.betas else []
    full = part == "all" and seed == study.seeds[0]
    for beta in study.betas:
        for mixer in study.mixers:
            if beta == 1.0 and full:
                out.append(Variant("all", mixer, 1.0))
            elif 0.0 < beta < 1.0:
                chosen = SELECTORS if full else (study.headline_selectors if beta == study.headline_beta else ())
                out += [Variant(s, mixer, beta) for s in chosen]
    return out


def plan(study: Study, work: Path, part: str) -> list[Unit]:
    """Every unit in dependency order: base model, its evaluation, then each variant and its evaluation."""
    units = []
    for task in study.tasks:
        for seed in study.seeds:
            home = work / task.name / f"s{seed}"
            units.append(Unit("base", task, seed, None, home))
            units.append(Unit("eval", task, seed, None, home))
            for variant in variants(study, seed, part):
                units.append(Unit("variant", task, seed, variant, home))
                units.append(Unit("eval", task, seed, variant, home))
    return units


def data_seed(seed: int, purpose: str) -> int:
    """Problem streams per model seed and purpose: `10 * seed + k`. Base training draws each
    round from `1000 * data_seed(seed, "base") + step` = `10000 * seed + step`, a multiple of
    10 (rounds are multiples of 10 steps) below the next seed's, while the other purposes
    end in k = 1..3; evaluation uses EVAL_SEED + scale. With seeds below 100 and fewer than
    10000 steps, no two streams share a seed."""
    return seed * 10 + {"base": 0, "analysis": 1, "continual": 2, "validation": 3}[purpose]


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
        return select_layers(scores, variant.beta)
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
    kv, state = cache_bytes(out.past_key_values)
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


# ---------------------------------------------------------------------------- results


def collect(study: Study, units: list[Unit]) -> dict:
    """Flat rows from finished units (documented in the README); unfinished ones are left out."""
    rows, bases = [], []
    for unit in units:
        if unit.kind == "base" and unit.path.exists():
            record = json.loads((unit.path / "unit.json").read_text())
            scores = HeadScores.load(unit.path / "scores.json")
            recency = list(scores.group_values().values())
            bases.append({"task": unit.task.name, "seed": unit.seed, **record, "group_recency_min": min(recency),
                          "group_recency_max": max(recency),
                          "uniform_recency": uniform_recency(scores.seq_len, scores.window)})
        if unit.kind != "eval" or not unit.path.exists():
            continue
        result = json.loads(unit.path.read_text())
        variant = unit.variant
        row = {"task": unit.task.name, "seed": unit.seed,
               "variant": "original" if variant is None else variant.name,
               "selector": "original" if variant is None else variant.selector,
               "mixer": "-" if variant is None or variant.selector == "none" else variant.mixer,
               "beta": 0.0 if variant is None else variant.beta, "groups": 0, "fraction": 0.0, "replaced": []}
        if variant is not None:
            record = json.loads((Unit("variant", unit.task, unit.seed, variant, unit.home).path / "unit.json").read_text())
            row.update(groups=record["groups"], fraction=record["fraction"], replaced=record["spec"]["groups"],
                       replaced_recency=record["replaced_recency"],
                       accuracy_converted=record["accuracy_converted"], accuracy_transfer=record["accuracy_transfer"],
                       train_s=record["elapsed_s"])
        for scale in study.scales:
            at = result[f"x{scale}"]
            row[f"accuracy_x{scale}"] = at["accuracy"]
            row[f"example_accuracy_x{scale}"] = at["example_accuracy"]
            row[f"cache_bytes_x{scale}"] = at["cache"]["bytes"]
            row[f"tokens_x{scale}"] = at["cache"]["tokens"]
        first = result["x1"]["cache"]
        row["kv_bytes_per_token"] = first["kv_bytes"] / first["tokens"]
        row["state_bytes"] = first["state_bytes"]
        rows.append(row)
    return {"format": "recurformer-retrieval-study/1", "study": study.to_dict(), "base_models": bases, "rows": rows,
            "written": time.strftime("%Y-%m-%d %H:%M")}


def uniform_recency(length: int, window: int) -> float:
    """RR of a head attending uniformly to its causal prefix: the floor a "recent" head must beat."""
    return statistics.fmean(min(i, window) / i for i in range(1, length + 1))


def summarize(rows: list[dict], scales: tuple[int, ...]) -> list[dict]:
    """Rows grouped by (task, variant) over seeds: mean and sample std of each accuracy."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["task"], row["variant"]), []).append(row)
    out = []
    for (task, name), members in groups.items():
        first = members[0]
        entry = {k: first[k] for k in ("task", "variant", "selector", "mixer", "beta", "groups", "fraction",
                                       "kv_bytes_per_token", "state_bytes")}
        entry["seeds"] = sorted(r["seed"] for r in members)
        entry["replaced"] = [r["replaced"] for r in sorted(members, key=lambda r: r["seed"])]
        for key in ("replaced_recency", "accuracy_transfer"):
            values = [r[key] for r in members if r.get(key) is not None]
            entry[key] = statistics.fmean(values) if values else None
        for scale in scales:
            values = [r[f"accuracy_x{scale}"] for r in members]
            entry[f"mean_x{scale}"] = statistics.fmean(values)
            entry[f"std_x{scale}"] = statistics.stdev(values) if len(values) > 1 else None
            entry[f"cache_bytes_x{scale}"] = first[f"cache_bytes_x{scale}"]
        out.append(entry)
    return out


ORDER = {"original": 0, "none": 1, "recency": 2, "random": 3, "inverse": 4, "layer": 5, "all": 6}


def sort_key(entry: dict) -> tuple:
    return (entry["beta"], entry["mixer"], ORDER[entry["selector"]])


def cell(entry: dict, scale: int) -> str:
    mean, std = entry[f"mean_x{scale}"], entry[f"std_x{scale}"]
    return f"{mean:.3f}" if std is None else f"{mean:.3f} ± {std:.3f}"


def table(entries: list[dict], scales: tuple[int, ...]) -> list[str]:
    head = ["selection", "mixer", "beta", "groups (fraction)", "RR of replaced", "1x after transfer"]
    head += [f"accuracy {s}x" for s in scales]
    head += ["KV B/token", "state B", f"cache B at {scales[-1]}x", "seeds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in sorted(entries, key=sort_key):
        lines.append("| " + " | ".join([
            e["selector"], e["mixer"], f"{e['beta']:.2f}", f"{e['groups']} ({e['fraction']:.2f})",
            "-" if e["replaced_recency"] is None else f"{e['replaced_recency']:.3f}",
            "-" if e["accuracy_transfer"] is None else f"{e['accuracy_transfer']:.3f}",
            *[cell(e, s) for s in scales], f"{e['kv_bytes_per_token']:.0f}", f"{e['state_bytes']:,}",
            f"{e[f'cache_bytes_x{scales[-1]}']:,}", ",".join(map(str, e["seeds"])),
        ]) + " |")
    return lines


def find(entries: list[dict], task: str, selector: str, mixer: str, beta: float) -> dict | None:
    return next((e for e in entries if e["task"] == task and e["selector"] == selector
                 and e["mixer"] in (mixer, "-") and e["beta"] == beta), None)


def paired(entries: list[dict], task: str, mixer: str, other: str) -> list[tuple[dict, dict]]:
    """(recency entry, `other` entry) at every partial beta where both exist."""
    betas = sorted({e["beta"] for e in entries if e["task"] == task and e["mixer"] == mixer and 0 < e["beta"] < 1})
    pairs = [(find(entries, task, "recency", mixer, b), find(entries, task, other, mixer, b)) for b in betas]
    return [(r, o) for r, o in pairs if r and o]


def tally(pairs: list[tuple[dict, dict]], scale: int, margin: float) -> str:
    """How often recency is ahead or behind by more than `margin`, level, or replaced the very
    same groups; and the mean gap over the pairs that replaced different groups."""
    same = [r["replaced"] == o["replaced"] for r, o in pairs]
    gaps = [r[f"mean_x{scale}"] - o[f"mean_x{scale}"] for (r, o), s in zip(pairs, same) if not s]
    text = (f"ahead {sum(g > margin for g in gaps)}, behind {sum(g < -margin for g in gaps)}, "
            f"level (within {margin}) {sum(abs(g) <= margin for g in gaps)}")
    if any(same):
        text += f", same groups replaced {sum(same)}"
    return text + (f" (mean gap {statistics.fmean(gaps):+.3f})" if gaps else "")


def comparison(study: Study, entries: list[dict], task: str, mixer: str, other: str) -> str | None:
    """Recency selection against `other` at each partial beta: who is ahead at 1x and at the
    longest length, whether the caches are equal, and whether the headline gap exceeds the spread."""
    top = study.scales[-1]
    pairs = paired(entries, task, mixer, other)
    if not pairs:
        return None
    detail = "; ".join(f"beta {r['beta']:.2f}: {r['mean_x1']:.3f} vs {o['mean_x1']:.3f} at 1x, "
                       f"{r[f'mean_x{top}']:.3f} vs {o[f'mean_x{top}']:.3f} at {top}x" for r, o in pairs)
    # The window mixer's state holds per-layer bookkeeping (slot positions), so spreading the
    # same groups over other layers changes its size by a few bytes: that still counts as equal.
    unequal = [f"beta {r['beta']:.2f}: {r['cache_bytes_x1']:,} vs {o['cache_bytes_x1']:,} B" for r, o in pairs
               if abs(r["cache_bytes_x1"] - o["cache_bytes_x1"]) > 0.01 * r["cache_bytes_x1"]]
    cache = "equal cache (within 1%)" if not unequal else "cache not equal (" + ", ".join(unequal) + ")"
    text = (f"over {len(pairs)} betas at {cache}, recency is at 1x {tally(pairs, 1, study.margin)}; "
            f"at {top}x {tally(pairs, top, study.margin)}. "
            f"{detail}")
    for r, o in pairs:
        if r["beta"] == study.headline_beta and r["std_x1"] is not None and o["std_x1"] is not None:
            for scale in (1, top):
                gap, spread = r[f"mean_x{scale}"] - o[f"mean_x{scale}"], r[f"std_x{scale}"] + o[f"std_x{scale}"]
                text += (f". Over {len(r['seeds'])} seeds at beta {r['beta']:.2f}, the {scale}x gap {gap:+.3f} is "
                         f"{'larger' if abs(gap) > spread else 'not larger'} than the two standard deviations summed "
                         f"({spread:.3f})")
    return text


def overall(study: Study, entries: list[dict]) -> list[str]:
    """One line per control: recency against it over every task, mixer and partial beta."""
    top, lines = study.scales[-1], []
    for other in ("random", "inverse", "layer"):
        pairs = [p for t in study.tasks for m in study.mixers for p in paired(entries, t.name, m, other)]
        if pairs:
            what = "whole layers ranked by recency" if other == "layer" else f"{other} selection"
            lines.append(f"- **Recency-selected groups vs {what}**, over {len(pairs)} (task, mixer, beta) cells: at 1x "
                         f"{tally(pairs, 1, study.margin)}; at {top}x {tally(pairs, top, study.margin)}.")
    return lines


def conclusions(study: Study, entries: list[dict]) -> list[str]:
    """Plain statements computed from the numbers: nothing here is typed in."""
    lines, top = [], study.scales[-1]
    for task in study.tasks:
        name = task.name
        reference = find(entries, name, "none", "-", 0.0)
        original = find(entries, name, "original", "-", 0.0)
        if original:
            lines.append(f"- **{name}, the original model**: {cell(original, 1)} at 1x, {cell(original, top)} at "
                         f"{top}x (its length generalization bounds every variant's).")
        if reference is None:
            continue
        for mixer in study.mixers:
            for other in ("random", "inverse", "layer"):
                text = comparison(study, entries, name, mixer, other)
                what = "whole layers ranked by recency (between-layer)" if other == "layer" else f"{other} selection"
                if text:
                    lines.append(f"- **{name}, {mixer}: recency-selected groups vs {what}**: {text}.")
            kept = sorted((e for e in entries if e["task"] == name and e["mixer"] == mixer and e["selector"] in ("recency", "all")),
                          key=sort_key)
            if kept:
                floor = reference["mean_x1"] - study.tolerance
                within = ", ".join(f"{e['beta']:.2f}" for e in kept if e["mean_x1"] >= floor)
                below = ", ".join(f"{e['beta']:.2f}" for e in kept if e["mean_x1"] < floor)
                verdict = (f"fine at beta {within or 'none of those tested'}; "
                           + (f"broken at beta {below}" if below else "broken at none of the betas tested"))
                lines.append(f"- **{name}, {mixer}: where recency selection breaks** (1x, more than {study.tolerance:.2f} "
                             f"below the beta-0 model's {reference['mean_x1']:.3f} after the same training): {verdict}.")
            full = find(entries, name, "all", mixer, 1.0)
            if full:
                lines.append(f"- **{name}, {mixer} in every group (beta 1)**: {cell(full, 1)} at 1x, {cell(full, top)} at "
                             f"{top}x, against {cell(reference, 1)} and {cell(reference, top)} for beta 0.")
    return lines


def pareto_plot(study: Study, entries: list[dict], path: Path) -> None:
    """Accuracy against cache bytes, one panel per task and length; the front is drawn."""
    scales = study.scales
    figure, axes = plt.subplots(len(study.tasks), len(scales), figsize=(4.2 * len(scales), 3.6 * len(study.tasks)),
                                squeeze=False)
    colors = {"original": "black", "none": "gray", "recency": "tab:blue", "random": "tab:orange",
              "inverse": "tab:red", "layer": "tab:green", "all": "tab:purple"}
    markers = {"-": "*", "mamba": "o", "window": "s"}
    for row, task in enumerate(study.tasks):
        mine = [e for e in entries if e["task"] == task.name]
        for col, scale in enumerate(scales):
            axis = axes[row][col]
            for e in mine:  # `layer` hollow and larger: it often replaced the same groups as `recency`
                hollow = e["selector"] == "layer"
                axis.scatter(e[f"cache_bytes_x{scale}"], e[f"mean_x{scale}"], marker=markers.get(e["mixer"], "^"),
                             s=60 if e["mixer"] == "-" or hollow else 30, alpha=0.85,
                             facecolors="none" if hollow else colors[e["selector"]], edgecolors=colors[e["selector"]])
            front, best = [], -1.0
            for e in sorted(mine, key=lambda e: (e[f"cache_bytes_x{scale}"], -e[f"mean_x{scale}"])):
                if e[f"mean_x{scale}"] > best:
                    best = e[f"mean_x{scale}"]
                    front.append((e[f"cache_bytes_x{scale}"], best))
            if front:
                axis.step(*zip(*front), where="post", color="black", linewidth=0.8, alpha=0.6)
            axis.set_xscale("log")
            axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            axis.set_ylim(-0.03, 1.03)
            axis.set_title(f"{task.name}, {scale}x training length ({task.seq_len * scale} tokens)", fontsize=9)
            axis.set_xlabel("cache bytes (KV + state), batch 1")
            axis.set_ylabel("answer accuracy")
    handles = [plt.Line2D([], [], color=c, marker="o", linestyle="", label=s, markerfacecolor="none" if s == "layer" else c)
               for s, c in colors.items()]
    handles += [plt.Line2D([], [], color="gray", marker=m, linestyle="", label=f"mixer {k}") for k, m in markers.items() if k != "-"]
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, bbox_to_anchor=(0.5, -0.02))
    figure.tight_layout(rect=(0, 0.04, 1, 1))
    save_figure(figure, path)


def render_readme(results: dict, study: Study, figures: list[str], complete: bool, reading: str | None = None) -> str:
    """README.md from results.json: setup, tables, plots, seeds and the computed conclusions,
    then `reading` (the hand-written interpretation kept in `reading.md` beside it) if given."""
    scales = study.scales
    entries = summarize(results["rows"], scales)
    s = results["study"]
    lines = ["# Retrieval study: which heads can go, and what is lost", "",
             f"Generated by `benchmarks/retrieval_study.py` from `results.json` ({results['written']}). "
             + ("All planned units are finished." if complete else "**Partial: some planned units have not run yet**; "
                "run the script again to finish them."), "",
             "## Setup", "",
             f"- Base models: Llama architecture (rotary positions), {s['layers']} layers, hidden {s['hidden']}, "
             f"{s['heads']} query heads in {s['kv_heads']} KV groups per layer ({s['layers'] * s['kv_heads']} groups), "
             f"MLP {s['intermediate']}, q/k/v/o biases, trained from scratch on fresh problems, batch {s['batch_size']}, "
             f"lr {s['base_lr']} (warmup, then constant), loss on answer tokens only, until the accuracy on held-out "
             f"validation problems reaches {s['base_solved']} (checked every {s['base_check_every']} steps, at most "
             f"{s['base_max_steps']} steps)."]
    for task in study.tasks:
        start = f" Training starts from the `{task.warm_start}` model of the same seed." if task.warm_start else ""
        lines.append(f"- Task `{task.name}`: {task.describe()}. At k x the length, k x the pairs/chains/queries.{start}")
    lines += [
        f"- Heads scored with `recurformer.scoring.analyze` on {s['analyze_sequences']} task sequences, recency window "
        f"w = {s['recency_window']} tokens. Selections: `recency` (paper), `random`, `inverse` (least recent first), "
        "`layer` (whole layers, ranked by the mean recency of their groups; Jamba/Samba-style between-layer hybrid). "
        "`none` is beta 0 (no replacement), `all` is beta 1 (a fully recurrent model for mamba).",
        f"- Mixers: {', '.join(f'`{m}`' for m in study.mixers)}"
        + (f" (window mixer span {s['mixer_window']} tokens)" if "window" in study.mixers else "") + ".",
        f"- Continual training, identical for every variant: transfer stage {s['transfer_steps']} steps (lr "
        f"{s['transfer_lr']}; skipped at beta 0, nothing to transfer), then lm stage {s['lm_steps']} steps (lr "
        f"{s['lm_lr']}, all weights trainable, loss on answer tokens), batch {s['continual_batch_size']}.",
        f"- Evaluation: {s['eval_examples']} held-out problems (seed {EVAL_SEED} + scale) at {', '.join(f'{k}x' for k in scales)} "
        "the training length; accuracy over answer tokens. Cache bytes measured from the model's cache "
        "(`HybridCache.nbytes()`; a `DynamicCache` for the original) after a forward over one problem, fp32.",
        f"- Seeds: {', '.join(map(str, s['seeds']))}. The first seed runs the whole grid; the others rerun, from a new "
        f"base model, beta 0 and the headline rows ({', '.join(s['headline_selectors'])} at beta {s['headline_beta']}). "
        "Accuracy cells show the mean ± sample standard deviation over the seeds listed in the row.",
        "- Columns: `RR of replaced` is the mean recency ratio of the replaced groups (what the scorer chose); "
        "`1x after transfer` is the accuracy after the transfer stage alone (only the mixers trained, to imitate the "
        "replaced heads; the rest frozen): which heads can go without the others adapting. The accuracy columns are "
        "after the whole continual training. `KV B/token` and `state B` are measured at 1x; the last cache column "
        "is the total at the longest length.",
        "", "## Base models", "",
        "| task | seed | parameters | steps | solved | validation accuracy | test accuracy 1x | group RR min - max | minutes |",
        "|---|---|---|---|---|---|---|---|---|"]
    for b in results["base_models"]:
        lines.append(f"| {b['task']} | {b['seed']} | {b['parameters']:,} | {b['steps']} | {'yes' if b['solved'] else '**no**'} | "
                     f"{b['validation_accuracy']:.3f} | {b['accuracy_x1']:.3f} | "
                     f"{b['group_recency_min']:.3f} - {b['group_recency_max']:.3f} | {b['elapsed_s'] / 60:.1f} |")
    floors = {b["task"]: b["uniform_recency"] for b in results["base_models"]}
    if floors:
        lines += ["", "A head attending uniformly over its prefix has RR = "
                  + ", ".join(f"{v:.3f} on {k}" for k, v in floors.items())
                  + f" (w = {s['recency_window']}): groups near that value are not recency aware in the paper's sense."]
    for task in study.tasks:
        mine = [e for e in entries if e["task"] == task.name]
        if mine:
            lines += ["", f"## {task.name}", ""] + table(mine, scales)
    lines += ["", "## Accuracy against cache size", ""] + [f"![{f}]({f})" for f in figures]
    lines += ["", "## Conclusions (computed from the table)", ""] + overall(study, entries)
    lines += conclusions(study, entries) or ["- No results yet."]
    if reading:
        lines += ["", "## What it means", "", "(Hand-written from the numbers above; kept in `reading.md`.)", "",
                  reading.strip()]
    lines += ["", "## Files", "",
              "- `results.json`: `rows`, one per (task, seed, variant): `accuracy_x{k}`, `example_accuracy_x{k}`, "
              "`cache_bytes_x{k}` and `tokens_x{k}` per scale k, `kv_bytes_per_token`, `state_bytes`, `groups`, "
              "`fraction` (replaced groups / all groups; the actual fraction for `layer`), `replaced` ([layer, kv_head] "
              "pairs), `replaced_recency` (mean RR of "
              "the replaced groups), `accuracy_converted` and "
              "`accuracy_transfer` (1x, right after surgery and after the transfer stage), `train_s`; "
              "`base_models`; `study` (every setting).",
              "- `pareto.png`: accuracy against cache bytes; `heads-<task>.png`: recency ratio per head of the "
              "first seed's base model, X on the groups replaced by recency at the headline beta."]
    return "\n".join(lines) + "\n"


def write_report(study: Study, units: list[Unit], out: Path) -> dict:
    results = collect(study, units)
    write_json_atomic(out / "results.json", results)
    entries = summarize(results["rows"], study.scales)
    figures = []
    if entries:
        pareto_plot(study, entries, out / "pareto.png")
        figures.append("pareto.png")
    for task in study.tasks:
        home = next(u.home for u in units if u.task == task and u.seed == study.seeds[0])
        scores_path = home / "base" / "scores.json"
        if scores_path.exists():
            scores = HeadScores.load(scores_path)
            plot_head_heatmap(scores, out / f"heads-{task.name}.png", select_heads(scores, study.headline_beta))
            figures.append(f"heads-{task.name}.png")
    complete = all(u.path.exists() for u in units)
    reading = (out / "reading.md").read_text() if (out / "reading.md").is_file() else None
    write_text_atomic(out / "README.md", render_readme(results, study, figures, complete, reading))
    return results


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
