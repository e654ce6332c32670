"""What the benchmark scripts share: where the repository, its results and the corpora are.

The corpora are the shared text files in `$RECURFORMER_DATA`, else `../shared/data` beside
the repository, in the roles `recurformer.data` gives them. (`peers/kvpress_eval.py` runs in
an environment without recurformer and finds the results folder itself.)
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

from recurformer.config import ConfigError, ReplacementSpec
from recurformer.data import DATA_ENV, EVAL_CORPORA, OUT_OF_DOMAIN_CORPORA, TRAIN_CORPORA

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
DATA = Path(os.environ.get(DATA_ENV, ROOT.parent / "shared" / "data"))

TRAIN = [DATA / name for name in TRAIN_CORPORA]
HELD_OUT = DATA / EVAL_CORPORA[0]
OUT_OF_DOMAIN = DATA / OUT_OF_DOMAIN_CORPORA[0]
TEXTS = {"heldout": HELD_OUT, "ood": OUT_OF_DOMAIN}  # the two evaluation texts, as the results name them


def random_spec(config, beta: float, seed: int = 0) -> ReplacementSpec:
    """`beta` of the KV groups, drawn at random with `seed`."""
    groups = [(l, h) for l in range(config.num_hidden_layers) for h in range(config.num_key_value_heads)]
    random.Random(seed).shuffle(groups)
    return ReplacementSpec(config.num_hidden_layers, config.num_key_value_heads,
                           groups[: math.floor(beta * len(groups) + 0.5)])


def budget_fractions(text: str) -> list[float]:
    """`--budgets` ("0.5,0.25"): fractions of the original's cache, a one-line error otherwise
    (each is checked to lie in (0, 1] where it is used)."""
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"--budgets: {text!r} is not a comma-separated list of fractions of the original's cache") from None
