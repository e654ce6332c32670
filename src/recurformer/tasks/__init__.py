"""Seeded synthetic retrieval tasks: HashHop (text and token form) and MQAR (token form).

Leaf modules: they import nothing else from recurformer. Formats, vocabularies, seeding and
scoring are described in `docs/tasks.md`.
"""

from recurformer.tasks.hashhop import (
    HashHopProblem,
    generate_hashhop,
    hashhop_tokens,
    score_hashhop,
    score_hashhop_tokens,
)
from recurformer.tasks.mqar import align_predictions, mqar_tokens, score_mqar

__all__ = [
    "HashHopProblem",
    "align_predictions",
    "generate_hashhop",
    "hashhop_tokens",
    "mqar_tokens",
    "score_hashhop",
    "score_hashhop_tokens",
    "score_mqar",
]
