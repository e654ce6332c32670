"""`--task passkey`: a 5-digit key hidden at several depths of real text, retrieved by greedy
generation, exact match (the generator and scorer are in `tasks/passkey.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError, option, require
from ..corpus_sources import shared_corpora, shown_corpora
from ..data import DataError, load_documents, tokenize_documents
from ..tasks.passkey import FORMATS, generate_passkey, score_passkey
from .generation import greedy_completions
from .registry import Task, register

HAYSTACK_CORPORA = ("tinyshakespeare.txt",)
BEST_FORMAT = "oneshot"  # the best of FORMATS on SmolLM2-135M-Instruct (docs/results/passkey-prompts.md)


def parse_depths(text: str) -> tuple[float, ...]:
    """'0.1,0.5,0.9' -> (0.1, 0.5, 0.9)."""
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--depths: expected comma-separated fractions such as 0.1,0.5,0.9, got {text!r}") from None


def passkey_accuracy(model, tokenizer, haystack: list[int], context: int, depths: tuple[float, ...], problems: int,
                     seed: int = 0, fmt: str = BEST_FORMAT, batch_size: int = 4, progress: bool = True) -> dict:
    """Greedy completions of passkey prompts of `context` tokens, `problems` per depth, scored by exact match."""
    try:
        cases = generate_passkey(tokenizer, haystack, context, depths, problems, seed=seed, fmt=fmt)
    except ValueError as error:
        raise DataError(f"--task passkey: {error}") from None
    completions = greedy_completions(model, tokenizer, [case.prompt for case in cases], 8, batch_size,
                                     desc="passkey", progress=progress)
    return {"format": fmt, "context": context, "depths": list(depths), "problems": problems,
            **score_passkey(completions, cases)}


@dataclass(frozen=True)
class PasskeyOptions:
    data: list[str] = option(help="haystack text (.txt or .jsonl; real text, not filler)", metavar="FILE",
                             factory=lambda: shared_corpora(HAYSTACK_CORPORA),
                             shown=shown_corpora(HAYSTACK_CORPORA))
    context: int = option(1024, "prompt tokens per problem")
    depths: tuple[float, ...] = option((0.1, 0.3, 0.5, 0.7, 0.9), "where the key sits: fractions of the haystack "
                                       "before it", metavar="D,D,...", parse=parse_depths)
    problems: int = option(5, "problems per depth")
    seed: int = option(0, "seeds the keys and the haystack windows")
    format: str = option(BEST_FORMAT, f"prompt format: {', '.join(FORMATS)} (docs/tasks.md)")
    batch_size: int = option(4, "problems per generation batch")

    def __post_init__(self) -> None:
        require(bool(self.data), "--task passkey needs --data FILE (no shared corpora found)")
        require(bool(self.depths) and all(0.0 <= d <= 1.0 for d in self.depths),
                f"--depths must be fractions in [0, 1], got {self.depths}")
        require(self.problems >= 1, f"--problems must be >= 1, got {self.problems}")
        require(self.format in FORMATS, f"--format: unknown {self.format!r}; choose one of {', '.join(FORMATS)}")
        require(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")


def check(options: PasskeyOptions, config, tokenizer=None) -> None:
    """Before any work: prompts and answers the model's positions (`config`: its text config) hold."""
    limit = config.max_position_embeddings
    require(options.context + 8 <= limit, f"--context {options.context} (+ 8 generated tokens) is longer than the "
            f"model allows ({limit} positions)")


def evaluate(model, tokenizer, options: PasskeyOptions) -> dict:
    check(options, model.config.get_text_config())
    haystack = tokenize_documents(tokenizer, load_documents(options.data))
    return passkey_accuracy(model, tokenizer, haystack, options.context, options.depths, options.problems,
                            seed=options.seed, fmt=options.format, batch_size=options.batch_size)


register(Task(
    name="passkey", summary="a 5-digit key hidden in real text, greedy generation, exact match (docs/tasks.md)",
    options=PasskeyOptions, evaluate=evaluate, check=check, report_order=15,
))
