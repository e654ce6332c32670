"""Continual training: the `transfer` stage (layer-local, mixers fit the replaced heads)
and the `lm` stage (end-to-end next-token loss, optional distillation)."""

from .lm import LMObjective
from .loop import (CHECKPOINT, TrainConfig, TrainingDiverged, check_checkpoint, has_checkpoint, made_by_train,
                   seconds_per_step, train)
from .stage import needs_teacher, objective_for, train_stage
from .transfer import TransferObjective

__all__ = [
    "CHECKPOINT",
    "LMObjective",
    "TrainConfig",
    "TrainingDiverged",
    "TransferObjective",
    "check_checkpoint",
    "has_checkpoint",
    "made_by_train",
    "needs_teacher",
    "objective_for",
    "seconds_per_step",
    "train",
    "train_stage",
]
