"""One training stage from start to saved model: the objective its config asks for, the
loop, and the trained model saved beside the stage's logs."""

from __future__ import annotations

from pathlib import Path

from torch import Tensor, nn

from ..loading import save_model_files
from .lm import LMObjective
from .loop import TrainConfig, train
from .transfer import TransferObjective


def needs_teacher(config: TrainConfig) -> bool:
    """Whether the stage needs the original model: the transfer stage imitates it, the lm
    stage distils from it when `distill_weight > 0`."""
    return config.stage == "transfer" or config.distill_weight > 0


def objective_for(config: TrainConfig, student: nn.Module, teacher: nn.Module | None):
    """The stage's objective for `student` (`teacher`: the original model, or None)."""
    if config.stage == "transfer":
        return TransferObjective(teacher, student, config.trainable)
    return LMObjective(config.trainable, teacher, config.distill_weight, config.distill_temperature, config.lora_rank,
                       config.ce_weight)


def train_stage(
    student: nn.Module, tokenizer, teacher: nn.Module | None, sequences: Tensor, config: TrainConfig,
    out_dir: str | Path, resume: bool = False, progress: bool = True, weights: Tensor | None = None,
) -> dict:
    """Train `student` in place on `sequences` `[N, seq_len]`, then save it and `tokenizer`
    into `out_dir` beside its checkpoint and logs; returns the training summary. `weights`
    `[N, seq_len]`: each position's weight in the `lm` stage's loss (`train`). The stage is
    added to the model's `config.training`, which its model card lists."""
    summary = train(student, objective_for(config, student, teacher), sequences, config, out_dir, resume=resume,
                    progress=progress, weights=weights)
    stage = {"stage": summary["stage"], "steps": summary["steps"], "tokens": summary["tokens"],
             "trainable": config.trainable}
    student.config.training = [*(getattr(student.config, "training", None) or []), stage]
    save_model_files(student, tokenizer, out_dir)
    return summary
