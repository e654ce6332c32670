"""[ours] How `recurformer run` trains a converted model: the recipes, in one place.

A run trains in two stages (docs/training.md): `transfer` (each layer's mixer learns to
reproduce the outputs of the heads it replaced, the rest of the model frozen) and `lm`
(end to end through the frozen model). A `Recipe` says, for each stage, what trains, on
which loss, on sequences of which length, at which peak learning rate, and how the time
budget is shared between the stages. Each mixer kind names its recipe (`Mixer.recipe`);
the pipeline, the benchmarks that train like `run` and the run's report all read it here.

| recipe | kinds | transfer | lm |
|---|---|---|---|
| `mixers` | mamba, window | mixers, 5e-3, 8 x 512 tokens | mixers + LoRA, cross-entropy + KL, 1e-3 |
| `mamba2` | mamba2 | as `mixers` | as `mixers` at 2e-4 (1e-3 diverges: docs/mixers.md) |
| `tail` | window+mamba, window+linear | the tail only, 5e-3, 4 x 1,024 tokens | the tail only, on the KL alone, 1e-3 |
| `tail-mamba2` | window+mamba2 | as `tail` | as `tail` at 2e-4; this and every `tail-mamba2-*` recipe: a quarter of the sequences with facts and questions |
| `tail-mamba2-q` | (`run --recipe`) a tail kind | as `tail` | the tail and the kept heads' query projections, 2e-4 |
| `tail-mamba2-long` | (`run --recipe`) a tail kind | as `tail` on 1 x 4,096 tokens | as `tail-mamba2` on 1 x 4,096 tokens |
| `tail-mamba2-long-q` | (`run --recipe`) a tail kind | as `tail-mamba2-long` | as `tail-mamba2-q` on 1 x 4,096 tokens |
| `tail-mamba2-long-lm` | (`run --recipe`) a tail kind | as `tail` (4 x 1,024 tokens, the 4,096-token sequences cut in four) | as `tail-mamba2-long` |
| (none) | a kind with nothing to train | `run` refuses the kind (`Mixer.recipe = None`) | |

The tail recipes train only what sees beyond the window (`Mixer.tail_parameters`: the
recurrent branch and its gate): the window keeps the replaced heads' own weights, so the
model starts as the training-free `window` and the KL to the original is all it learns from,
which recovers the original rather than adapting to the training text. Their sequences are
several times the window long, with as many tokens per step as the other recipes. The
`-q` and `-long` recipes are the options of issue 44 for retrieval (measured in
docs/results/long-context.md): the kept heads' queries may adapt to the loss of their
neighbours, and a sequence as long as the evaluated context holds facts as far back as the
evaluation asks for them (`-long-lm`: in the `lm` stage only; within the budget it answered
as many questions as the 1,024-token recipe). `run --recipe` picks one instead of the kind's
own; `run --retrieval-share` another share of retrieval sequences than the recipe's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from torch import Tensor

from .config import require
from .mixers import MIXERS
from .train import TrainConfig

STAGES = ("transfer", "lm")
# A step is computed in micro-batches of about this many tokens: the activations kept for the
# backward pass, not the step's tokens, set the peak memory (docs/training.md, "Memory").
MICRO_BATCH_TOKENS = 1024
CHECKPOINT_EVERY = 5


def micro_batches(batch_size: int, seq_len: int) -> int:
    """Micro-batches per step: about `MICRO_BATCH_TOKENS` tokens each, dividing the batch."""
    return math.gcd(batch_size, max(1, batch_size * seq_len // MICRO_BATCH_TOKENS))


@dataclass(frozen=True)
class StageRecipe:
    """One stage of a recipe: what trains (`TrainConfig.trainable`), on what loss, on batches
    of `batch_size` sequences of `seq_len` tokens, at peak learning rate `lr`."""

    lr: float
    trainable: str
    seq_len: int
    batch_size: int
    distill_weight: float = 0.0  # lm: weight of the KL to the original
    ce_weight: float = 1.0  # lm: weight of the next-token cross-entropy

    def train_config(self, stage: str, steps: int, seed: int, lr: float | None = None) -> TrainConfig:
        """The `TrainConfig` of `steps` optimizer steps of this stage (`lr`: instead of the recipe's)."""
        grad_accum = micro_batches(self.batch_size, self.seq_len)
        extra = dict(distill_weight=self.distill_weight, ce_weight=self.ce_weight) if stage == "lm" else {}
        return TrainConfig(stage=stage, steps=steps, seq_len=self.seq_len, batch_size=self.batch_size,
                           grad_accum=grad_accum, lr=self.lr if lr is None else lr, trainable=self.trainable,
                           checkpoint_every=CHECKPOINT_EVERY, seed=seed, **extra)


@dataclass(frozen=True)
class Recipe:
    """Both stages of a run's training, the share of the time budget the first one gets, and
    the sentence the run's report says about them."""

    name: str
    summary: str
    transfer: StageRecipe
    lm: StageRecipe
    quick_seq_len: int  # `run --quick`: both stages on 2 sequences of this many tokens
    transfer_share: float = 0.35
    retrieval_share: float = 0.0  # share of training sequences with facts and questions (`run --retrieval-share`)
    # the (transfer, lm) steps the recipe's documented numbers were measured with; a time budget
    # that buys fewer is said to (`run`'s plan and report)
    measured_steps: tuple[int, int] | None = None

    def __post_init__(self):
        short, long = sorted((self.transfer.seq_len, self.lm.seq_len))
        if long % short:
            raise ValueError(f"recipe {self.name}: the stages' sequence lengths {short} and {long} must divide")

    def stage(self, name: str) -> StageRecipe:
        return {"transfer": self.transfer, "lm": self.lm}[name]

    @property
    def learning_rates(self) -> tuple[float, float]:
        """(transfer, lm) peak learning rates."""
        return self.transfer.lr, self.lm.lr

    @property
    def sequence_length(self) -> int:
        """The training sequences' length: the longer stage's. Both stages read the same
        sequences; the shorter stage reads each cut into pieces of its length (`stage_rows`)."""
        return max(self.transfer.seq_len, self.lm.seq_len)

    def stage_rows(self, name: str, rows: Tensor) -> Tensor:
        """`rows` `[N, sequence_length]` (sequences, or their loss weights) as stage `name`
        reads them: `[N * sequence_length // seq_len, seq_len]`, each row cut in consecutive pieces."""
        return rows.reshape(-1, self.stage(name).seq_len)

    def quick(self) -> "Recipe":
        """The same recipe at tiny sizes (`run --quick`: a smoke test), on plain text: a tiny
        sequence has no room for a fact and its question."""
        tiny = dict(seq_len=self.quick_seq_len, batch_size=2)
        return replace(self, transfer=replace(self.transfer, **tiny), lm=replace(self.lm, **tiny), retrieval_share=0.0)


_MIXERS_TEXT = ("The `transfer` stage trains each layer's mixer to reproduce the outputs of the heads it replaced (mean "
                "squared error, the rest of the model frozen); the `lm` stage trains the mixers and LoRA adapters on "
                "next-token loss plus the KL divergence to the original model's predictions.")
_TAIL_TEXT = ("The tail recipe: the window keeps the heads' own projections, and only the recurrent tail and its gate "
              "train. The `transfer` stage trains each layer's mixer to reproduce the outputs of the heads it replaced "
              "(mean squared error on sequences longer than the window, the rest of the model frozen); the `lm` stage "
              "trains the tails end to end on the KL divergence to the original model's predictions alone, which "
              "recovers the original instead of adapting to the training text.")

_Q_TEXT = (" The kept heads' query projections train too, so that the heads that still attend to every token can "
           "learn to find what the replaced heads found.")
_LONG_TEXT = " Both stages train on sequences of 4,096 tokens, as long as the evaluated context."
_RETRIEVAL_TEXT = (" A quarter of the training sequences carry facts inserted into their text and questions about "
                   "them later on (`run --retrieval-share`), which the original answers and the converted model learns to "
                   "answer like it.")
_LONG_LM_TEXT = (" The `lm` stage trains on sequences of 4,096 tokens, as long as the evaluated context; the "
                 "`transfer` stage reads them cut into 1,024-token pieces.")

_MIXERS = Recipe("mixers", _MIXERS_TEXT,
                 transfer=StageRecipe(lr=5e-3, trainable="mixers", seq_len=512, batch_size=8),
                 lm=StageRecipe(lr=1e-3, trainable="mixers+lora", seq_len=512, batch_size=8, distill_weight=1.0),
                 quick_seq_len=64)
_TAIL = Recipe("tail", _TAIL_TEXT,
               transfer=StageRecipe(lr=5e-3, trainable="tail", seq_len=1024, batch_size=4),
               lm=StageRecipe(lr=1e-3, trainable="tail", seq_len=1024, batch_size=4, distill_weight=1.0, ce_weight=0.0),
               quick_seq_len=96)

# window+mamba2's recipes: the lm stage at mamba2's rate, a quarter of the sequences with facts and
# questions (measured: docs/training.md, "Retrieval in the training data")
_TAIL_MAMBA2 = replace(_TAIL, summary=_TAIL_TEXT + _RETRIEVAL_TEXT, lm=replace(_TAIL.lm, lr=2e-4), retrieval_share=0.25)

RECIPES: dict[str, Recipe] = {r.name: r for r in (
    _MIXERS,
    replace(_MIXERS, name="mamba2", lm=replace(_MIXERS.lm, lr=2e-4)),
    _TAIL,
    # the README's and docs/where-it-wins.md's retrieval figures: 55 + 32 steps (docs/training.md)
    replace(_TAIL_MAMBA2, name="tail-mamba2", measured_steps=(55, 32)),
    replace(_TAIL_MAMBA2, name="tail-mamba2-q", summary=_TAIL_TEXT + _Q_TEXT + _RETRIEVAL_TEXT,
            lm=replace(_TAIL_MAMBA2.lm, trainable="tail+q")),
    replace(_TAIL_MAMBA2, name="tail-mamba2-long", summary=_TAIL_TEXT + _LONG_TEXT + _RETRIEVAL_TEXT,
            transfer=replace(_TAIL.transfer, seq_len=4096, batch_size=1),
            lm=replace(_TAIL_MAMBA2.lm, seq_len=4096, batch_size=1)),
    replace(_TAIL_MAMBA2, name="tail-mamba2-long-q", summary=_TAIL_TEXT + _Q_TEXT + _LONG_TEXT + _RETRIEVAL_TEXT,
            transfer=replace(_TAIL.transfer, seq_len=4096, batch_size=1),
            lm=replace(_TAIL_MAMBA2.lm, seq_len=4096, batch_size=1, trainable="tail+q")),
    replace(_TAIL_MAMBA2, name="tail-mamba2-long-lm", summary=_TAIL_TEXT + _LONG_LM_TEXT + _RETRIEVAL_TEXT,
            lm=replace(_TAIL_MAMBA2.lm, seq_len=4096, batch_size=1)),
)}


def _trains_tails(recipe: Recipe) -> bool:
    return any(recipe.stage(stage).trainable.startswith("tail") for stage in STAGES)


def recipe_for(kind: str, name: str | None = None) -> Recipe:
    """The recipe `run` trains a conversion to mixer `kind` with: `name` (`run --recipe`),
    else the kind's own (`Mixer.recipe`). One-line errors for a kind with nothing to train,
    an unknown name, and a tail recipe for a kind without a tail."""
    own = MIXERS[kind].recipe
    require(own is not None, f"--mixer {kind} has no parameters to train, so `run` cannot train it; "
                             "use `recurformer convert` and `recurformer eval`")
    if name is None:
        return RECIPES[own]
    require(name in RECIPES, f"--recipe: unknown {name!r}; choose one of {', '.join(RECIPES)}")
    recipe = RECIPES[name]
    require(not _trains_tails(recipe) or _trains_tails(RECIPES[own]),
            f"--recipe {name} trains the tails of window+ kinds, and --mixer {kind} has none")
    return recipe

