"""The training loop shared by both stages: accelerate-based, resumable, atomic checkpoints.

Launch it as a plain process, or with `torchrun --nproc_per_node N` / `accelerate launch`
for data parallelism (DDP; FSDP through an accelerate config) without code changes.

Determinism: the data order is a function of `(seed, step)` only, so a checkpoint needs
just the step number besides the model, optimizer, scheduler and RNG states; a resumed
run reaches bit-identical parameters on CPU. A global batch of `batch_size` sequences is
split into equal contiguous shards, one per process, and each shard into `grad_accum`
micro-batches: every token has the same weight whatever the number of processes.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import set_seed
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..checks import DamagedFileError, check_pickle, check_safetensors, read_json_object
from ..config import ConfigError, option, require
from ..device import DEVICE_HELP, model_device, resolve_device, synchronize
from ..errors import RecurformerError
from ..files import replace_directory, write_json_atomic, write_text_atomic

try:  # the numpy types of accelerate's RNG states, which its own loader allows (accelerate >= 1.3)
    from accelerate.utils.other import TORCH_SAFE_GLOBALS
except ImportError:
    TORCH_SAFE_GLOBALS = []

STAGES = ("transfer", "lm")
TRAINABLE_SETS = ("mixers", "mixers+lora", "tail", "tail+q", "all")
PRECISIONS = ("auto", "no", "bf16")
CHECKPOINT = "checkpoint"
STATE = "trainer_state.json"  # in the checkpoint: the step, the elapsed time and the config
LOG = "train_log.jsonl"
SUMMARY = "train_summary.json"


def has_checkpoint(out_dir: str | Path) -> bool:
    """Whether a training stage writing into `out_dir` left a complete checkpoint to resume from."""
    return (Path(out_dir) / CHECKPOINT / STATE).is_file()


class TrainingDiverged(RecurformerError, RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


@dataclass
class TrainConfig:
    """Hyper-parameters of one training stage; `--flag` names in errors match the CLI."""

    stage: str = option("transfer", "transfer (mixers imitate the replaced heads) | lm (next-token loss)")
    steps: int | None = option(None, "optimizer steps (or give --tokens)")
    tokens: int | None = option(None, "training tokens, instead of --steps: steps = ceil(tokens / (batch * seq-len))")
    seq_len: int = option(512, "tokens per training sequence")
    batch_size: int = option(8, "sequences per optimizer step, over all processes")
    grad_accum: int = option(1, "micro-batches per optimizer step")
    lr: float = option(1e-3, "peak learning rate")
    min_lr_ratio: float = option(0.1, "the cosine schedule decays to lr * this")
    warmup: float = option(0.05, "linear warmup, as a fraction of the steps")
    weight_decay: float = option(0.0, "AdamW weight decay (not on biases, norms, A_log, D)")
    clip: float = option(1.0, "gradient norm clip")
    trainable: str = option("mixers", " | ".join(TRAINABLE_SETS) + " (transfer: mixers or tail)")
    distill_weight: float = option(0.0, "lm stage: weight of the KL divergence to the original model")
    distill_temperature: float = option(1.0, "lm stage: temperature of that KL")
    ce_weight: float = option(1.0, "lm stage: weight of the next-token cross-entropy (0: KL to the original only)")
    lora_rank: int = option(8, "lm stage: rank of the LoRA adapters (mixers+lora)")
    precision: str = option("auto", "auto (bf16 where bf16 matmuls are fast) | no | bf16")
    device: str = option("auto", DEVICE_HELP)
    checkpoint_every: int = option(50, "steps between checkpoints")
    seed: int = option(0, "seeds the data order and the initialization")

    def __post_init__(self) -> None:
        require(self.stage in STAGES, f"--stage: unknown {self.stage!r}; choose one of {', '.join(STAGES)}")
        require((self.steps is None) != (self.tokens is None), "give exactly one of --steps and --tokens")
        require(self.steps is None or self.steps >= 1, f"--steps must be >= 1, got {self.steps}")
        require(self.tokens is None or self.tokens >= 1, f"--tokens must be >= 1, got {self.tokens}")
        require(self.seq_len >= 2, f"--seq-len must be >= 2, got {self.seq_len}")
        require(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        require(self.grad_accum >= 1, f"--grad-accum must be >= 1, got {self.grad_accum}")
        require(self.lr > 0 and math.isfinite(self.lr), f"--lr must be a positive number, got {self.lr}")
        require(0 <= self.min_lr_ratio <= 1, f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        require(0 <= self.warmup < 1, f"--warmup must be in [0, 1), got {self.warmup}")
        require(self.clip > 0, f"--clip must be > 0, got {self.clip}")
        require(self.trainable in TRAINABLE_SETS, f"--trainable: unknown {self.trainable!r}; choose one of {', '.join(TRAINABLE_SETS)}")
        require(self.stage == "lm" or self.trainable in ("mixers", "tail"),
                f"--trainable {self.trainable} applies to --stage lm; the transfer stage trains the mixers (mixers or tail) only")
        require(self.distill_weight >= 0, f"--distill-weight must be >= 0, got {self.distill_weight}")
        require(self.distill_temperature > 0, f"--distill-temperature must be > 0, got {self.distill_temperature}")
        require(self.ce_weight >= 0, f"--ce-weight must be >= 0, got {self.ce_weight}")
        require(self.ce_weight > 0 or self.distill_weight > 0 or self.stage == "transfer",
                "--ce-weight 0 needs --distill-weight > 0: the loss would be zero")
        require(self.lora_rank >= 1, f"--lora-rank must be >= 1, got {self.lora_rank}")
        require(self.precision in PRECISIONS, f"--precision: unknown {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        resolve_device(self.device)
        require(self.checkpoint_every >= 1, f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")

    @property
    def total_steps(self) -> int:
        if self.steps is not None:
            return self.steps
        return math.ceil(self.tokens / (self.batch_size * self.seq_len))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Objective(Protocol):
    """A training stage: what trains, and the loss of a micro-batch."""

    def prepare(self, model: nn.Module) -> nn.Module:
        """Freeze and wrap as the stage needs; return the module to optimize."""

    def loss(self, module: nn.Module, input_ids: Tensor, labels: Tensor | None = None,
             weights: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        """Mean loss of `input_ids` `[b, T]` and extra metrics to log. `labels` `[b, T]`
        (HF convention, -100 = not scored) is given only when `train` received labels, and
        `weights` `[b, T]` (each position's weight in the mean) only when it received weights."""

    def finish(self, module: nn.Module) -> nn.Module:
        """The model to save after training (e.g. LoRA merged)."""


def global_batch(step: int, num_sequences: int, batch_size: int, seed: int) -> Tensor:
    """Indices `[batch_size]` of the sequences of `step`: epochs of seeded permutations."""
    first = step * batch_size
    rows = []
    while len(rows) < batch_size:
        epoch, offset = divmod(first + len(rows), num_sequences)
        order = torch.randperm(num_sequences, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        rows.extend(order[offset:offset + batch_size - len(rows)].tolist())
    return torch.tensor(rows)


def lr_factor(step: int, total: int, warmup: float, min_ratio: float) -> float:
    """Linear warmup over `warmup * total` steps, then cosine down to `min_ratio`."""
    warm = max(1, round(warmup * total)) if warmup > 0 else 0
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases, norms, and Mamba's A_log and D (as in Mamba)."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        plain = p.dim() < 2 or name.endswith(("A_log", ".D", "bias"))
        (no_decay if plain else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _cpu_has_amx() -> bool:
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def resolve_precision(choice: str, device: str = "auto") -> str:
    """`auto`: bf16 autocast where bf16 matmuls are fast (CUDA with bf16, CPUs with AMX,
    where we measured 6.4x the fp32 matmul rate), else fp32; on `device`."""
    if choice != "auto":
        return choice
    if resolve_device(device).type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    return "bf16" if _cpu_has_amx() else "no"


def _accelerator(precision: str, device: str = "auto") -> Accelerator:
    """An Accelerator in `precision`. accelerate keeps one state per process and refuses a
    second precision in it, but one process may train several times in different
    precisions (a study, a test session): a single-process state made for another
    precision is dropped first (accelerate's `_reset_state`); a distributed one never is.
    The schedule is stepped per optimizer step, whatever the number of processes
    (accelerate would otherwise step it once per process)."""
    state = AcceleratorState._shared_state
    if state and state.get("_mixed_precision") != precision and PartialState().num_processes == 1:
        AcceleratorState._reset_state()
    return Accelerator(mixed_precision=precision, cpu=resolve_device(device).type == "cpu",
                       step_scheduler_with_optimizer=False)


def seconds_per_step(model: nn.Module, make_objective, sequences: Tensor, config: TrainConfig) -> float:
    """Measured seconds of one optimizer step of `config` in a single process.

    Runs forward + backward of one sequence twice on a copy of `model` (so the model and
    its trainable set stay untouched) under the same precision as `train`, and scales the
    second, warm time by `batch_size` (the cost is linear in the sequences at these sizes,
    and one sequence keeps the probe cheap). `make_objective(copy)` builds
    the stage's objective for the copy.
    """
    trial = copy.deepcopy(model)
    objective = make_objective(trial)
    module = objective.prepare(trial)
    micro = sequences[:1].to(model_device(trial))
    bf16 = resolve_precision(config.precision, config.device) == "bf16"
    seconds = 0.0
    for _ in range(2):
        start = time.perf_counter()
        with torch.autocast(micro.device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, _ = objective.loss(module, micro)
        loss.backward()
        synchronize(micro.device)
        seconds = time.perf_counter() - start
    objective.finish(module)
    return seconds * config.batch_size


def train(
    model: nn.Module,
    objective: Objective,
    sequences: Tensor,
    config: TrainConfig,
    out_dir: str | Path,
    resume: bool = False,
    progress: bool = True,
    labels: Tensor | None = None,
    weights: Tensor | None = None,
) -> dict[str, Any]:
    """Train `model` in place on `sequences` `[N, seq_len]`; checkpoints and logs in `out_dir`.

    `labels` `[N, seq_len]` (HF convention, -100 = not scored), if given, go with their
    sequences to `objective.loss`: task data whose loss counts only the answer tokens.
    `weights` `[N, seq_len]`, if given, go with them too: each position's weight in the loss
    (the `lm` stage's; e.g. more on the answers of retrieval sequences).

    Returns the summary (also written to `out_dir/train_summary.json`; `precision` is what
    `config.precision` resolved to on this machine: `bf16` or `no`). The trained model is
    `objective.finish(...)` of the unwrapped module; saving it is the caller's job.
    """
    out_dir = Path(out_dir)
    precision = resolve_precision(config.precision, config.device)
    accelerator = _accelerator(precision, config.device)
    world, rank = accelerator.num_processes, accelerator.process_index
    per_process = config.batch_size // world
    require(per_process * world == config.batch_size, f"--batch-size {config.batch_size} is not divisible by {world} processes")
    micro = per_process // config.grad_accum
    require(micro * config.grad_accum == per_process, f"--batch-size {config.batch_size} / {world} processes is not divisible by --grad-accum {config.grad_accum}")
    require(len(sequences) >= 1 and sequences.shape[1] == config.seq_len, "training sequences do not match --seq-len")
    require(labels is None or labels.shape == sequences.shape,
             f"labels {None if labels is None else tuple(labels.shape)} do not match sequences {tuple(sequences.shape)}")
    require(weights is None or config.stage == "lm", "position weights apply to the lm stage's loss only")
    require(weights is None or weights.shape == sequences.shape,
            f"weights {None if weights is None else tuple(weights.shape)} do not match sequences {tuple(sequences.shape)}")

    set_seed(config.seed)
    module = objective.prepare(model)
    # a mixer without parameters, or without a tail (window), leaves nothing to train
    require(any(p.requires_grad for p in module.parameters()),
            f"--trainable {config.trainable}: this model has no such parameters, nothing to train")
    optimizer = torch.optim.AdamW(_param_groups(module, config.weight_decay), lr=config.lr, betas=(0.9, 0.95), eps=1e-8)
    total = config.total_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total, config.warmup, config.min_lr_ratio)
    )
    module, optimizer, scheduler = accelerator.prepare(module, optimizer, scheduler)
    if getattr(objective, "teacher", None) is not None:  # the original runs beside the student
        objective.teacher.to(accelerator.device)

    checkpoint = out_dir / CHECKPOINT
    start_step, elapsed_before = 0, 0.0
    if resume:
        state = check_checkpoint(checkpoint)
        if state["config"] != config.to_dict():
            changed = sorted(k for k in state["config"] if state["config"][k] != config.to_dict().get(k))
            raise ConfigError(f"--resume: the checkpoint was made with other settings ({', '.join(changed)})")
        accelerator.load_state(str(checkpoint))
        start_step, elapsed_before = state["step"], state["elapsed"]
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        _truncate_log(out_dir / LOG, start_step)

    saved = start_step  # the step of the checkpoint on disk (0: none)
    tokens_per_step = config.batch_size * config.seq_len
    bar = tqdm(total=total, initial=start_step, desc=f"train {config.stage}", unit="step",
               disable=not (progress and accelerator.is_main_process))
    started = time.monotonic()
    last_loss = float("nan")
    for step in range(start_step, total):
        rows = global_batch(step, len(sequences), config.batch_size, config.seed)
        mine = rows[rank * per_process:(rank + 1) * per_process]
        shard = sequences[mine]
        shard_labels = None if labels is None else labels[mine]
        shard_weights = None if weights is None else weights[mine]
        step_loss = torch.zeros((), device=accelerator.device)
        metrics: dict[str, float] = {}
        for i in range(config.grad_accum):
            part = slice(i * micro, (i + 1) * micro)
            batch = shard[part].to(accelerator.device)
            # Objectives without a labels argument (e.g. transfer) keep working when none are given.
            extra_args = () if shard_labels is None else (shard_labels[part].to(accelerator.device),)
            extra_kwargs = {} if shard_weights is None else {"weights": shard_weights[part].to(accelerator.device)}
            sync = i == config.grad_accum - 1
            with (nullcontext() if sync else accelerator.no_sync(module)), accelerator.autocast():
                loss, extra = objective.loss(module, batch, *extra_args, **extra_kwargs)
                accelerator.backward(loss / config.grad_accum)
            step_loss += loss.detach() / config.grad_accum
            for k, v in extra.items():
                metrics[k] = metrics.get(k, 0.0) + v / config.grad_accum
        step_loss = accelerator.reduce(step_loss, reduction="mean")
        grad_norm = accelerator.clip_grad_norm_(module.parameters(), config.clip)
        # a NaN loss, or a NaN gradient that would make the weights (and the next checkpoint) NaN
        for name, value in (("loss", step_loss), ("gradient norm", grad_norm)):
            if not torch.isfinite(torch.as_tensor(value)):
                kept = (f"the last good checkpoint, to resume from, is {checkpoint} (step {saved})" if saved
                        else "no checkpoint was written yet")
                raise TrainingDiverged(f"{name} became {float(value)} at step {step}; stopped, {kept}")
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        done = step + 1
        elapsed = elapsed_before + time.monotonic() - started
        last_loss = step_loss.item()
        record = {
            "step": done, "loss": last_loss, "lr": scheduler.get_last_lr()[0], "grad_norm": float(grad_norm),
            "tokens": done * tokens_per_step, "elapsed_s": round(elapsed, 3),
            "tokens_per_s": (done - start_step) * tokens_per_step / max(time.monotonic() - started, 1e-9), **metrics,
        }
        if accelerator.is_main_process:
            with open(out_dir / LOG, "a") as log:
                log.write(json.dumps(record) + "\n")
        bar.set_postfix(loss=f"{last_loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
        bar.update(1)
        if done % config.checkpoint_every == 0 or done == total:
            _save_checkpoint(accelerator, checkpoint, {"step": done, "elapsed": elapsed, "config": config.to_dict()})
            saved = done
    bar.close()

    summary = {
        "stage": config.stage, "steps": total, "tokens": total * tokens_per_step,
        "final_loss": last_loss if start_step < total else _last_logged_loss(out_dir / LOG),
        "elapsed_s": round(elapsed_before + time.monotonic() - started, 3),
        "processes": world, "precision": precision, "config": config.to_dict(),
    }
    accelerator.wait_for_everyone()
    objective.finish(accelerator.unwrap_model(module))
    if accelerator.is_main_process:
        write_json_atomic(out_dir / SUMMARY, summary)
    accelerator.end_training()
    return summary


def made_by_train(out_dir: str | Path) -> bool:
    """Whether `out_dir` holds a training stage's log or checkpoint: a folder that `train`
    made before output folders carried a marker (`outputs.MARKER`)."""
    out_dir = Path(out_dir)
    return (out_dir / LOG).is_file() or has_checkpoint(out_dir)


def check_checkpoint(checkpoint: Path) -> dict:
    """The training state of the checkpoint folder `checkpoint`, after checking every file
    that resuming reads: `trainer_state.json`, the model's safetensors header, and the
    optimizer, scheduler and RNG pickles through torch's weights-only unpickler (a pickle
    that is not plain tensors is refused without running it)."""
    if not has_checkpoint(checkpoint.parent):
        raise ConfigError(f"--resume: no checkpoint in {checkpoint.parent}")
    state = read_json_object(checkpoint / STATE, "training state")
    if not (isinstance(state.get("step"), int) and isinstance(state.get("elapsed"), (int, float))
            and isinstance(state.get("config"), dict)):
        raise DamagedFileError(f"training state {checkpoint / STATE}: lacks step, elapsed or config")
    for path in sorted(checkpoint.iterdir()):
        if path.suffix == ".safetensors":
            check_safetensors(path)
        elif path.suffix in (".bin", ".pkl", ".pt"):
            check_pickle(path, TORCH_SAFE_GLOBALS)
    return state


def _save_checkpoint(accelerator: Accelerator, checkpoint: Path, state: dict) -> None:
    """Write the checkpoint beside the old one, then swap: an interruption keeps the old."""
    staging = checkpoint.with_name(f".{checkpoint.name}.partial")
    if accelerator.is_main_process and staging.exists():
        shutil.rmtree(staging)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))
    if accelerator.is_main_process:
        write_json_atomic(staging / STATE, state)
        replace_directory(staging, checkpoint)
    accelerator.wait_for_everyone()


def _truncate_log(path: Path, step: int) -> None:
    """Keep the log lines up to `step` (a resumed run rewrites what came after). A last line
    cut short by an interruption is a step after the checkpoint's, and goes too; a damaged
    line before it is an error naming the log."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line]
    kept = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise DamagedFileError(f"training log {path}: line {number} is not valid JSON") from None
        if record.get("step", step + 1) <= step:
            kept.append(line)
    write_text_atomic(path, "".join(line + "\n" for line in kept))


def _last_logged_loss(path: Path) -> float:
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1])["loss"] if lines else float("nan")
