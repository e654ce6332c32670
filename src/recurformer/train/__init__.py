"""Continual training: the `transfer` stage (layer-local, mixers fit the replaced heads)
and the `lm` stage (end-to-end next-token loss, optional distillation)."""

from .loop import TrainConfig, TrainingDiverged, seconds_per_step, train
from .lm import LMObjective
from .transfer import TransferObjective

__all__ = ["LMObjective", "TrainConfig", "TrainingDiverged", "seconds_per_step", "TransferObjective", "train"]
