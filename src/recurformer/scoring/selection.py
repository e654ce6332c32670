"""Which KV groups to replace: the top `beta` fraction under a scorer, by group or by layer."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ReplacementSpec, groups_to_replace, option
from .head_scores import HeadScores
from .scorers import SCORERS, Needs, Scorer, make_scorer


def check_beta(beta: float) -> None:
    """The one-line error for a `beta` outside [0, 1]."""
    groups_to_replace(1, beta)


@dataclass(frozen=True)
class SelectionConfig:
    """Which KV groups to replace: the top `beta` fraction under `scorer`. [ours] The default
    is `ablation`, the cheapest groups to window first: trained and training-free, it keeps
    more than `recency` at beta 0.75 and beyond 1K tokens (docs/results/analysis.md)."""

    beta: float = option(0.5, "fraction of KV groups to replace, in [0, 1]")
    scorer: str = option("ablation", "which groups go first: " + " | ".join(SCORERS))
    seed: int = option(0, "seeds the random scorer and the text sample")

    def __post_init__(self) -> None:
        check_beta(self.beta)
        make_scorer(self.scorer, self.seed)

    @property
    def needs(self) -> Needs:
        """What `scorer` needs measured before it ranks (`scorers.Needs`)."""
        return SCORERS[self.scorer].needs

    def select(self, scores: HeadScores) -> ReplacementSpec:
        return select_heads(scores, self.beta, make_scorer(self.scorer, self.seed))


def select_heads(scores: HeadScores, beta: float, scorer: Scorer | None = None) -> ReplacementSpec:
    """The global top-`beta` fraction of KV groups under `scorer` (default: `SelectionConfig`'s,
    `ablation`, which needs scores made with it; the paper's is `make_scorer("recency")`).

    Ties are broken by (layer, kv_head), so the choice is deterministic.
    """
    scorer = scorer or make_scorer(SelectionConfig.scorer)
    ranked = scorer.score(scores)
    count = groups_to_replace(len(ranked), beta)
    chosen = sorted(ranked, key=lambda g: (-ranked[g], g))[:count]
    return ReplacementSpec(
        scores.num_layers, scores.num_kv_heads, chosen,
        source={"model": scores.model, "scorer": scorer.name, "beta": beta, "metric": scores.metric},
    )


def select_layers(scores: HeadScores, beta: float, scorer: Scorer | None = None) -> ReplacementSpec:
    """[ours] The between-layer alternative (Jamba/Samba style): whole layers are replaced.

    Layers are ranked by the mean score of their KV groups under `scorer` (default, as
    `select_heads`: `SelectionConfig`'s) and the top `floor(beta * layers + 1/2)` go, every group of each. This is
    `groups_to_replace` rounded to whole layers, so `spec.fraction` can differ from `beta`
    when `beta * groups` is not a multiple of the groups per layer; report the fraction.
    Ties are broken by layer index.
    """
    scorer = scorer or make_scorer(SelectionConfig.scorer)
    ranked = scorer.score(scores)
    per_layer = {l: sum(ranked[(l, g)] for g in range(scores.num_kv_heads)) / scores.num_kv_heads
                 for l in range(scores.num_layers)}
    count = groups_to_replace(scores.num_layers, beta)
    layers = sorted(per_layer, key=lambda l: (-per_layer[l], l))[:count]
    return ReplacementSpec(
        scores.num_layers, scores.num_kv_heads, [(l, g) for l in layers for g in range(scores.num_kv_heads)],
        source={"model": scores.model, "scorer": scorer.name, "beta": beta, "metric": scores.metric, "unit": "layer"},
    )
