"""Intervals that respect a clustered design: resample whole contexts (and trainings).

Questions about one context are not independent (a compression that loses the middle of a
context loses every needle there), so the unit resampled is the context. A row measured on
several trainings of the same recipe (`S` seeds) also resamples the trainings, so that its
interval holds the draw of the training as well as that of the problems. Two rows that read
the same contexts are compared *paired*: one draw of contexts serves both, the trainings of
each row are drawn on their own.
"""

from __future__ import annotations

import numpy as np

DRAWS = 2000
LEVEL = 0.9


def _per_context(scores) -> np.ndarray:
    """`[S, C]` per-context means of `scores[s][c][q]`: trainings x contexts x questions (the
    number of questions may differ between contexts)."""
    return np.asarray([[np.mean(questions) for questions in training] for training in scores], dtype=float)


def _draws(per_context: np.ndarray, contexts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The row's mean under each draw of contexts `[D, C]`, its trainings drawn with replacement."""
    seeds = rng.integers(0, per_context.shape[0], size=(contexts.shape[0], per_context.shape[0]))
    by_seed = per_context[:, contexts]  # [S, D, C]
    means = by_seed.mean(axis=2)  # [S, D]
    return np.take_along_axis(means.T, seeds, axis=1).mean(axis=1)


def mean(scores) -> float:
    """The mean of `scores[s][c][q]` over trainings and contexts (each context weighs alike):
    `interval`'s first value, without the resampling."""
    return float(_per_context(scores).mean())


def interval(scores, draws: int = DRAWS, seed: int = 0, level: float = LEVEL) -> tuple[float, float, float]:
    """(mean, low, high) of `scores[s][c][q]`: the mean over trainings and contexts and its percentile
    interval."""
    per_context = _per_context(scores)
    rng = np.random.default_rng(seed)
    contexts = rng.integers(0, per_context.shape[1], size=(draws, per_context.shape[1]))
    values = _draws(per_context, contexts, rng)
    tail = (1 - level) / 2
    return float(per_context.mean()), float(np.quantile(values, tail)), float(np.quantile(values, 1 - tail))


def paired_interval(a, b, draws: int = DRAWS, seed: int = 0, level: float = LEVEL) -> tuple[float, float, float]:
    """(mean of a - mean of b, low, high): rows `a` and `b` on the same contexts, in the same order."""
    pa, pb = _per_context(a), _per_context(b)
    if pa.shape[1] != pb.shape[1]:
        raise ValueError(f"the rows read {pa.shape[1]} and {pb.shape[1]} contexts; a paired interval needs the same")
    rng = np.random.default_rng(seed)
    contexts = rng.integers(0, pa.shape[1], size=(draws, pa.shape[1]))
    values = _draws(pa, contexts, rng) - _draws(pb, contexts, rng)
    tail = (1 - level) / 2
    return float(pa.mean() - pb.mean()), float(np.quantile(values, tail)), float(np.quantile(values, 1 - tail))
