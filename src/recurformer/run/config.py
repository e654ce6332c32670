"""What decides a run's results: `RunConfig` (stored in `run.json`, made from `run`'s flags)
and the sizes of the stages' work (`Sizes`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..ablation import AblationConfig
from ..bench import BenchConfig
from ..config import ConfigError, option, require
from ..corpus_sources import shared_corpora, shown_corpora
from ..device import DEVICE_HELP, resolve_device
from ..data import DATA_ENV, EVAL_CORPORA, OUT_OF_DOMAIN_CORPORA, TRAIN_CORPORA, not_found
from ..loading import check_convertible
from ..mixers import MIXER_KINDS, MixerConfig, parse_ssd_state, parse_window, resolve_for_model
from ..recipe import Recipe, recipe_for
from ..scoring import SCORERS, AnalysisConfig, SelectionConfig

MAX_BUDGET_MINUTES = 525_600  # a year: a larger budget is a typo (and inf would overflow the step counts)
DEFAULT_BUDGET_MINUTES = 25.0  # the training time of a recipe that has no measured steps
MAX_ANSWER_WEIGHT = 1000  # the answers are ~1% of a retrieval sequence: more would leave the text unweighted


def _pair(convert: Callable[[str], Any], what: str, example: str) -> Callable[[str], tuple]:
    """A parser for `TRANSFER,LM`: two values read by `convert`."""

    def parse(text: str) -> tuple:
        try:
            transfer, lm = (convert(part) for part in text.split(","))
        except ValueError:
            raise ConfigError(f"expected TRANSFER,LM {what} such as {example}, got {text!r}") from None
        return transfer, lm

    return parse


@dataclass
class RunConfig:
    """Everything that determines a run's results; `run.json` stores it.

    `quick` replaces every size by a tiny one (a smoke test: its numbers mean nothing).
    """

    model: str = option("smollm2-135m", "a local Hugging Face model directory, a known name, or a Hugging Face id "
                        "org/name (docs/models.md)")
    data: list[str] = option(help=f"training and head-scoring text (the shared corpora, in ${DATA_ENV} or "
                             "../shared/data)", metavar="FILE", factory=lambda: shared_corpora(TRAIN_CORPORA),
                             shown=shown_corpora(TRAIN_CORPORA))
    eval_data: list[str] = option(help="held-out text for perplexity and the long-range tasks", metavar="FILE",
                                  factory=lambda: shared_corpora(EVAL_CORPORA), shown=shown_corpora(EVAL_CORPORA))
    ood_data: list[str] = option(help="out-of-domain text for perplexity and agreement (another domain than "
                                 "--data, evaluation only)", metavar="FILE",
                                 factory=lambda: shared_corpora(OUT_OF_DOMAIN_CORPORA),
                                 shown=shown_corpora(OUT_OF_DOMAIN_CORPORA))
    beta: float = option(SelectionConfig.beta, "fraction of KV groups to replace")
    mixer: str = option(MixerConfig.kind, "mixer kind (docs/mixers.md; the paper's: mamba)",
                        choices=lambda: MIXER_KINDS)
    window: int | str | None = option(None, "window mixers: tokens each query attends back (default: auto, the "
                                      "default cache budget for the model's heads: docs/mixers.md)",
                                      parse=parse_window, metavar="W")
    sinks: int | None = option(None, f"window mixers: first tokens every query also attends (default "
                               f"{MixerConfig.sinks})")
    ssd_state: int | str | None = option(None, "mamba2 kinds: state size per head (default: auto, head_dim / 4 for "
                                         "window+mamba2, head_dim for mamba2)", parse=parse_ssd_state, metavar="N")
    scorer: str = option(SelectionConfig.scorer, "which groups go first: " + " | ".join(SCORERS))
    budget_minutes: float | None = option(None, "bound the training time instead: train the steps these minutes of "
                                          "both stages buy on this machine (default: the recipe's measured steps, "
                                          f"55 + 32 for window+mamba2; {DEFAULT_BUDGET_MINUTES:g} minutes for a recipe "
                                          "without them)")
    steps: tuple[int, int] | None = option(None, "train exactly these optimizer steps (default: the recipe's "
                                           "measured steps; equal-token comparisons)", metavar="TRANSFER,LM",
                                           parse=_pair(int, "step counts", "40,16"))
    lr: tuple[float, float] | None = option(None, "learning rates of the two stages (default: the mixer's "
                                            "recipe, docs/training.md)", metavar="TRANSFER,LM",
                                            parse=_pair(float, "learning rates", "5e-3,1e-3"))
    recipe_name: str | None = option(None, "how to train: a recipe of recipe.py (default: the mixer kind's own; "
                                     "docs/training.md)", flag="--recipe", metavar="NAME")
    retrieval_share: float | None = option(None, "the share of training sequences that carry facts and questions "
                                           "(default: the recipe's, 0.25 for window+mamba2, 0 for the other kinds "
                                           "and with --quick; docs/training.md, \"Retrieval in the training data\")")
    answer_weight: float = option(1.0, "lm stage: the weight in the loss of each position that predicts an answer's value "
                                  "in a retrieval sequence (1: like every other position)")
    quick: bool = option(False, "tiny sizes everywhere: a smoke test, numbers not meaningful")
    seed: int = option(SelectionConfig.seed, "data order, random scorer, task problems")
    device: str = option("auto", DEVICE_HELP + "; where the stages run (a run may continue on another device)")

    def __post_init__(self) -> None:
        resolve_device(self.device)
        check_convertible(self.model)
        require(bool(self.data), "no training data: pass --data FILE...")
        require(bool(self.eval_data), "no evaluation data: pass --eval-data FILE...")
        require(bool(self.ood_data), "no out-of-domain evaluation data: pass --ood-data FILE...")
        training = {str(Path(p).resolve()) for p in self.data}
        for flag, paths in (("--eval-data", self.eval_data), ("--ood-data", self.ood_data)):
            overlap = training & {str(Path(p).resolve()) for p in paths}
            if overlap:
                raise ConfigError(f"{flag} must be held out, but {min(overlap)} is also in --data")
        SelectionConfig(self.beta, self.scorer, self.seed)
        require(self.beta > 0, "--beta 0 replaces no KV group: run needs a beta in (0, 1]")
        self.mixer_config()
        recipe_for(self.mixer, self.recipe_name)  # a kind with nothing to train is refused here, before any work
        if self.budget_minutes is not None:
            require(self.budget_minutes > 0, f"--budget-minutes must be > 0, got {self.budget_minutes}")
            require(self.budget_minutes <= MAX_BUDGET_MINUTES,
                    f"--budget-minutes must be at most {MAX_BUDGET_MINUTES:,} (a year), got {self.budget_minutes}")
            require(self.steps is None, "--steps and --budget-minutes both fix the training steps: give one")
        if self.steps is not None:
            require(len(self.steps) == 2 and all(isinstance(n, int) and n >= 1 for n in self.steps),
                    f"--steps must be two positive integers TRANSFER,LM, got {self.steps}")
            self.steps = tuple(self.steps)
        if self.lr is not None:
            require(len(self.lr) == 2 and all(0 < x < 1 for x in self.lr),
                    f"--lr must be two learning rates in (0, 1) TRANSFER,LM, got {self.lr}")
            self.lr = tuple(self.lr)
        if self.retrieval_share is None:
            self.retrieval_share = self.recipe.retrieval_share
        require(isinstance(self.retrieval_share, (int, float)) and 0 <= self.retrieval_share <= 1,
                f"--retrieval-share must be in [0, 1], got {self.retrieval_share}")
        require(isinstance(self.answer_weight, (int, float)) and 1 <= self.answer_weight <= MAX_ANSWER_WEIGHT,
                f"--answer-weight must be in [1, {MAX_ANSWER_WEIGHT}], got {self.answer_weight}")
        require(self.answer_weight == 1 or self.retrieval_share > 0,
                "--answer-weight weighs the answers of retrieval sequences: it needs --retrieval-share > 0")
        for path in [*self.data, *self.eval_data, *self.ood_data]:
            if not Path(path).is_file():
                raise not_found(path)

    def mixer_config(self) -> MixerConfig:
        """The mixer of the conversion: `mixer` with `window`, `sinks` and `ssd_state` where
        given (an error for a kind that does not read them), else the library's defaults."""
        return MixerConfig.from_flags(self.mixer, window=self.window, sinks=self.sinks, ssd_state=self.ssd_state)

    def for_model(self, text_config) -> "RunConfig":
        """This configuration with the mixer's `auto` shape (window, tail state) decided for the
        model `text_config` describes (`mixers/shape.py`), as `run.json` records it and the
        report states it."""
        mixer = resolve_for_model(self.mixer_config(), text_config)
        return replace(self, **{name: getattr(mixer, name) for name in ("window", "ssd_state") if mixer.reads(name)})

    @property
    def recipe(self) -> Recipe:
        """How the run trains: the mixer kind's recipe (`recipe.py`), at tiny sizes when `quick`."""
        recipe = recipe_for(self.mixer, self.recipe_name)
        return recipe.quick() if self.quick else recipe

    @property
    def training_budget(self) -> float | None:
        """Minutes of training that `plan` turns into steps: `--budget-minutes`, else for a
        recipe without measured steps `DEFAULT_BUDGET_MINUTES`; None where the steps are fixed
        (`--steps`, or the recipe's measured ones)."""
        if self.steps is not None:
            return None
        if self.budget_minutes is not None:
            return self.budget_minutes
        return None if self.recipe.measured_steps is not None else DEFAULT_BUDGET_MINUTES

    @property
    def training_steps(self) -> tuple[int, int] | None:
        """(transfer, lm) steps fixed before any timing: `--steps`, else the recipe's measured
        steps where no budget is given; None where a budget decides them."""
        if self.steps is not None:
            return self.steps
        return None if self.training_budget is not None else self.recipe.measured_steps

    @property
    def learning_rates(self) -> tuple[float, float]:
        """(transfer, lm): the given ones, else the recipe's."""
        return self.lr or self.recipe.learning_rates

    @property
    def selection(self) -> SelectionConfig:
        return SelectionConfig(self.beta, self.scorer, self.seed)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["data"] = [str(Path(p).resolve()) for p in self.data]
        data["eval_data"] = [str(Path(p).resolve()) for p in self.eval_data]
        data["ood_data"] = [str(Path(p).resolve()) for p in self.ood_data]
        data["steps"] = None if self.steps is None else list(self.steps)
        data["lr"] = None if self.lr is None else list(self.lr)
        del data["device"]  # where it runs, not what it is: not part of the run's identity
        return data


@dataclass(frozen=True)
class Sizes:
    """The sizes of the stages' work other than training (the recipe sizes that), for a full
    run or the tiny `quick` one; the evaluation tasks size themselves (`Task.run_options`)."""

    analysis: AnalysisConfig = AnalysisConfig(sequences=16, seq_len=1024)
    ablation: AblationConfig = AblationConfig()  # read only with the ablation scorers
    bench: BenchConfig = BenchConfig(contexts=(512, 2048, 4096), decode_steps=32)
    fixed_steps: int | None = None  # quick: skip the timing and train this many steps

    @classmethod
    def of(cls, config: RunConfig) -> "Sizes":
        if not config.quick:
            return cls()
        return replace(cls(), analysis=AnalysisConfig(sequences=2, seq_len=128),
                       # 256 tokens: the retrieval probe's 4 needles and questions fit with text around them
                       ablation=AblationConfig(ablation_sequences=1, ablation_seq_len=256, ablation_from=128),
                       bench=BenchConfig(contexts=(64, 128), decode_steps=4), fixed_steps=2)
