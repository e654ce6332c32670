"""Scorers: each ranks KV groups from `HeadScores` and says what must be measured first.

A scorer's `needs` tells `analyze_text` what to measure besides the head statistics that
every analysis measures: nothing more (`recency`, `inverse`; `random` does not even read
them), or the groups' ablation costs (`ablation.py`), in one round or in every greedy round,
on the calibration text, on the retrieval probe's answers (`retrieval_probe.py`), or on both.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import ClassVar

from ..ablation import AblationConfig
from ..config import ConfigError
from .head_scores import HeadScores

Ranking = dict[tuple[int, int], float]  # (layer, kv_head) -> score; the highest is replaced first


@dataclass(frozen=True)
class Needs:
    """What a scorer needs measured besides the head statistics: `ablation`, each group's
    windowing cost; `greedy`, in all of `AblationConfig.ablation_rounds` rounds, not one;
    `probes`, whose NLL makes each cost: `text` (the calibration text), `retrieval`, or both."""

    ablation: bool = False
    greedy: bool = False
    probes: tuple[str, ...] = ("text",)

    def measurement(self, config: AblationConfig) -> AblationConfig | None:
        """The ablation `analyze_text` measures: None, one round, or `config`'s rounds."""
        if not self.ablation:
            return None
        return config if self.greedy else replace(config, ablation_rounds=1)


@dataclass(frozen=True)
class Scorer:
    """Ranks KV groups: the higher a group's score, the earlier it is replaced. `seed` seeds
    the scorers that draw."""

    seed: int = 0
    name: ClassVar[str] = ""
    needs: ClassVar[Needs] = Needs()

    def score(self, scores: HeadScores) -> Ranking:
        raise NotImplementedError


class RecencyScorer(Scorer):
    """[paper] The most recency-aware groups first (mean RR of the group's query heads)."""

    name = "recency"

    def score(self, scores: HeadScores) -> Ranking:
        return scores.group_values()


class InverseScorer(Scorer):
    """Control: the least recency-aware groups first."""

    name = "inverse"

    def score(self, scores: HeadScores) -> Ranking:
        return {g: -v for g, v in scores.group_values().items()}


class RandomScorer(Scorer):
    """Control: a seeded random order."""

    name = "random"

    def score(self, scores: HeadScores) -> Ranking:
        rng = random.Random(self.seed)
        return {g: rng.random() for g in scores.group_values()}


class MeasuredScorer(Scorer):
    """Ranks by a group statistic that `analyze_text` measured (`statistic`), the lowest
    first; scores without it are refused with `missing`."""

    statistic: ClassVar[str] = ""
    missing: ClassVar[str] = ""

    def score(self, scores: HeadScores) -> Ranking:
        if self.statistic not in scores.groups:
            raise ConfigError(self.missing)
        return {g: -v for g, v in scores.group_values(self.statistic).items()}


class AblationScorer(MeasuredScorer):
    """[ours] The groups whose windowing alone costs the least NLL first (`ablation.py`)."""

    name, statistic = "ablation", "ablation"
    needs = Needs(ablation=True)
    missing = ("these scores have no ablation costs; make them with "
               "`recurformer analyze ... --scorer ablation`, or choose --scorer recency")


class RetrievalAblationScorer(MeasuredScorer):
    """[ours] The groups whose windowing alone costs the answers of a key-value retrieval
    probe the least first (`retrieval_probe.py`; after Retrieval-Aware Distillation's ranking)."""

    name, statistic = "ablation-retrieval", "ablation_retrieval"
    needs = Needs(ablation=True, probes=("retrieval",))
    missing = ("these scores have no retrieval ablation costs; make them with "
               "`recurformer analyze ... --scorer ablation-retrieval`")


class JointAblationScorer(Scorer):
    """[ours] The groups cheap on both probes first: ranked by the sum of a group's ranks by
    its text and by its retrieval ablation cost (ties: the text cost decides). Ranks, not
    costs, are added: the two costs are NLLs of different tokens, on different scales."""

    name = "ablation-joint"
    needs = Needs(ablation=True, probes=("text", "retrieval"))

    def score(self, scores: HeadScores) -> Ranking:
        if not {"ablation", "ablation_retrieval"} <= set(scores.groups):
            raise ConfigError("these scores have no text and retrieval ablation costs; make them with "
                              "`recurformer analyze ... --scorer ablation-joint`")
        text, retrieval = scores.group_values("ablation"), scores.group_values("ablation_retrieval")
        rank = {name: {g: i for i, g in enumerate(sorted(costs, key=costs.get))}
                for name, costs in (("text", text), ("retrieval", retrieval))}
        return {g: -(rank["text"][g] + rank["retrieval"][g] + text[g] / (1 + abs(text[g])) / 2) for g in text}


class GreedyAblationScorer(MeasuredScorer):
    """[ours] The order of the greedy ablation rounds (`ablation.py`): each round's cheapest
    groups, measured with the earlier rounds' groups windowed, first."""

    name, statistic = "ablation-greedy", "ablation_order"
    needs = Needs(ablation=True, greedy=True)
    missing = ("these scores have no greedy ablation order; make them with "
               "`recurformer analyze ... --scorer ablation-greedy`")


SCORERS: dict[str, type[Scorer]] = {s.name: s for s in (RecencyScorer, InverseScorer, RandomScorer, AblationScorer,
                                                         GreedyAblationScorer, RetrievalAblationScorer,
                                                         JointAblationScorer)}


def make_scorer(name: str, seed: int = 0) -> Scorer:
    if name not in SCORERS:
        raise ConfigError(f"scorer: unknown {name!r}; choose one of {', '.join(SCORERS)}")
    return SCORERS[name](seed)
