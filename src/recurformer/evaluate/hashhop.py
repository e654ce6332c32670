"""`--task hashhop`: multi-hop retrieval over random hashes, answered by greedy generation
(the generator and scorer are in `tasks/hashhop.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError, option, require
from ..metrics import Metric, Row, per_model
from ..tasks.hashhop import generate_hashhop, score_hashhop
from .generation import greedy_completions
from .registry import RunSettings, Task, register


def hashhop_accuracy(
    model, tokenizer, num_problems: int = 20, hops: int = 2, target_tokens: int = 512, cot: bool = False,
    shots: int = 1, seed: int = 0, batch_size: int = 4, progress: bool = True,
) -> dict:
    """Greedy completions of HashHop prompts sized to `target_tokens`, scored by exact match."""
    problems = hashhop_problems(tokenizer, num_problems, hops, target_tokens, cot, shots, seed)
    answer_tokens = max(len(tokenizer.encode(" " + p.answer, add_special_tokens=False)) for p in problems)
    predictions = greedy_completions(model, tokenizer, [p.prompt for p in problems], answer_tokens + 2, batch_size,
                                     desc="hashhop", progress=progress)
    scores = score_hashhop(predictions, problems)
    return {"task": "hashhop", "hops": hops, "target_tokens": target_tokens, "cot": cot, "shots": shots,
            "n_chains_mean": sum(p.n_chains for p in problems) / len(problems), **scores}


def hashhop_problems(tokenizer, num_problems: int, hops: int, target_tokens: int, cot: bool = False, shots: int = 1,
                     seed: int = 0):
    """The problems, sizes the tokenizer cannot meet a one-line error."""
    try:
        return generate_hashhop(num_problems, hops=hops, target_tokens=target_tokens, tokenizer=tokenizer, cot=cot,
                                seed=seed, shots=shots)
    except ValueError as error:  # sizes the tokenizer cannot meet: one line, as passkey does
        raise ConfigError(f"--task hashhop: {error}") from None


@dataclass(frozen=True)
class HashHopOptions:
    problems: int = option(20, "number of problems")
    context: int = option(1024, "prompt tokens per problem")
    hops: int = option(2, "hops per query")
    seed: int = option(0, "seeds the problems")
    batch_size: int = option(4, "problems per generation batch")

    def __post_init__(self) -> None:
        require(self.problems >= 1, f"--problems must be >= 1, got {self.problems}")
        require(self.hops >= 1, f"--hops must be >= 1, got {self.hops}")
        require(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")


def check(options: HashHopOptions, config, tokenizer=None) -> None:
    """Before any work, with `tokenizer`: a prompt of `--context` tokens holds the fewest
    chains (made for the first problem alone: the others are the same size)."""
    if tokenizer is not None:
        hashhop_problems(tokenizer(), 1, options.hops, options.context, seed=options.seed)


def evaluate(model, tokenizer, options: HashHopOptions) -> dict:
    return hashhop_accuracy(model, tokenizer, num_problems=options.problems, hops=options.hops,
                            target_tokens=options.context, seed=options.seed, batch_size=options.batch_size)


def run_options(settings: RunSettings) -> dict[str, HashHopOptions]:
    if settings.quick:
        return {"hashhop": HashHopOptions(problems=2, context=160, hops=1, seed=settings.seed)}
    return {"hashhop": HashHopOptions(problems=24, context=256, hops=1, seed=settings.seed)}


register(Task(
    name="hashhop", summary="HashHop retrieval by generation, exact match (docs/tasks.md)",
    options=HashHopOptions, evaluate=evaluate, check=check, report_order=10, run_options=run_options,
    metrics=(
        *per_model("hashhop", "exact_match", "HashHop exact match", ("original", "final"), fmt="{:.0%}", better="higher"),
        Metric("hashhop_problems", "HashHop problems", lambda r: r.result("hashhop", "original")["n"]),
        Metric("hashhop_context", "HashHop prompt tokens", lambda r: r.result("hashhop", "original")["target_tokens"],
               unit="tokens"),
    ),
    rows=(Row("HashHop, 1 hop, exact match ({hashhop_problems} problems, ~{hashhop_context} tokens)",
              "hashhop_original", "hashhop_final", None),),
))
