"""`--task ruler`: RULER-style long-context tasks (needles, variable chains, word counts) in
real held-out text, answered greedily after the context is prefilled, scored as RULER scores
them (the generators and the scorer are in `tasks/ruler.py`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from tqdm.auto import tqdm

from ..config import ConfigError, option, require
from ..corpus_sources import shared_corpora, shown_corpora
from ..data import DataError, load_documents
from ..metrics import BASELINE, Metric, Row, per_model
from ..tasks.ruler import FORMATS, TASKS, RulerProblem, Sources, generate_ruler, parse_tasks, score_ruler, summarize
from .generation import prefilled_answer
from .registry import RunSettings, Task, register

HAYSTACK_CORPORA = ("wikitext-2-raw-test.txt",)  # held-out text: never trained on
# The best of FORMATS on SmolLM2-135M-Instruct at 4K tokens (docs/results/long-context.md, "Format check"):
# `oneshot` led at 2K (docs/results/ruler-prompts.md), but at 4K the model copies its example's answer.
BEST_FORMAT = "plain"


def check_tasks(text: str) -> str:
    """`--tasks`: 'all' or comma-separated RULER task names."""
    try:
        parse_tasks(text)
    except ValueError as error:
        raise ConfigError(f"--tasks: {error}") from None
    return text


def ruler_problems(tokenizer, data: list[str], tasks: tuple[str, ...], context: int, problems: int, seed: int,
                   fmt: str) -> list[RulerProblem]:
    """The problem set: `problems` per task, prompts of at most `context` tokens, haystacks from `data`."""
    try:
        return generate_ruler(tokenizer, Sources.from_text("\n".join(load_documents(data))), tasks, context,
                              problems, seed=seed, fmt=fmt)
    except ValueError as error:
        raise DataError(f"--task ruler: {error}") from None


def problem_ids(tokenizer, problem: RulerProblem) -> tuple[list[int], list[int]]:
    """(context ids, question ids), each tokenized alone, as kvpress's pipeline tokenizes them."""
    return tokenizer.encode(problem.context), tokenizer.encode(problem.question, add_special_tokens=False)


def digest(problems: list) -> str:
    """A short fingerprint of a problem set (dataclasses: RULER problems, shared contexts):
    results on different sets are not compared."""
    return hashlib.sha256(json.dumps([asdict(p) for p in problems]).encode()).hexdigest()[:16]


def ends_answer(tokenizer):
    """[ours] An answer ends at a blank line: every task's answer is one line (or a list on
    consecutive lines), and what follows a blank line is the model going on by itself."""
    return lambda ids: "\n\n" in tokenizer.decode(ids, skip_special_tokens=True).strip()


def eos_ids(model, tokenizer) -> set[int]:
    """The ids that end generation: the tokenizer's EOS and the model's (e.g. the chat turn's end)."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return {i for i in ids if i is not None}


def answer_problems(model, tokenizer, problems: list[RulerProblem], cache_factory=None, compress=None,
                    progress: bool = True) -> list[dict]:
    """Each problem answered greedily after its context is prefilled (a fresh cache from
    `cache_factory()` each, None: the model's own; `compress`: see `prefilled_answer`) and scored."""
    eos, stop, records = eos_ids(model, tokenizer), ends_answer(tokenizer), []
    for problem in tqdm(problems, desc="ruler", unit="problem", disable=not progress):
        context, question = problem_ids(tokenizer, problem)
        ids = prefilled_answer(model, context, question, problem.max_new_tokens, eos,
                               cache=None if cache_factory is None else cache_factory(), compress=compress, stop=stop)
        completion = tokenizer.decode(ids, skip_special_tokens=True)
        records.append({"task": problem.task, "answers": list(problem.answers), "completion": completion,
                        "score": score_ruler(completion, problem.answers)})
    return records


@dataclass(frozen=True)
class RulerOptions:
    data: list[str] = option(help="real text for the haystacks (.txt or .jsonl; held-out: never trained on)",
                             metavar="FILE", factory=lambda: shared_corpora(HAYSTACK_CORPORA),
                             shown=shown_corpora(HAYSTACK_CORPORA))
    context: int = option(4096, "prompt tokens per problem (context + question)")
    tasks: str = option("all", f"comma-separated RULER tasks, or all: {', '.join(TASKS)}", parse=check_tasks)
    problems: int = option(5, "problems per task")
    seed: int = option(0, "seeds the keys, values, depths and haystack windows")
    format: str = option(BEST_FORMAT, f"prompt format: {', '.join(FORMATS)} (docs/tasks.md)")

    def __post_init__(self) -> None:
        require(bool(self.data), "--task ruler needs --data FILE (no shared corpora found)")
        require(self.problems >= 1, f"--problems must be >= 1, got {self.problems}")
        require(self.context >= 1, f"--context must be >= 1, got {self.context}")
        require(self.format in FORMATS, f"--format: unknown {self.format!r}; choose one of {', '.join(FORMATS)}")
        check_tasks(self.tasks)


def check(options: RulerOptions, config, tokenizer=None) -> None:
    """Before any work: prompts and answers the model's positions (`config`: its text config) hold."""
    limit = config.max_position_embeddings
    longest = max(TASKS[name].max_new_tokens for name in parse_tasks(options.tasks))
    require(options.context + longest <= limit, f"--context {options.context} (+ up to {longest} generated tokens) "
            f"is longer than the model allows ({limit} positions)")


def evaluate(model, tokenizer, options: RulerOptions) -> dict:
    tasks = parse_tasks(options.tasks)
    check(options, model.config.get_text_config())
    problems = ruler_problems(tokenizer, options.data, tasks, options.context, options.problems, options.seed,
                              options.format)
    records = answer_problems(model, tokenizer, problems)
    return {"context": options.context, "format": options.format, "seed": options.seed, "problems": options.problems,
            "digest": digest(problems), **summarize(records), "records": records}


# [ours] `run`'s mix: three needle tasks the original SmolLM2-135M does at 4K but not
# perfectly (60 / 80 / 40 of 100, docs/results/long-context.md), so none saturates
RUN_TASKS = "niah_single_2,niah_multikey_1,niah_multiquery"
RUN_PROBLEMS = 4


def run_options(settings: RunSettings) -> dict[str, RulerOptions]:
    """The mix at 4K tokens in the held-out text (quick: one problem each at 384)."""
    sizes = dict(context=384, problems=1) if settings.quick else dict(context=4096, problems=RUN_PROBLEMS)
    return {"ruler": RulerOptions(data=list(settings.eval_data), tasks=RUN_TASKS, seed=settings.seed, **sizes)}


RUN_MODELS = ("original", "final", BASELINE)

register(Task(
    name="ruler", summary="RULER-style needles, variable tracking and word counts in held-out text, greedy "
                          "generation after a prefill, RULER's string match (docs/tasks.md)",
    options=RulerOptions, evaluate=evaluate, check=check, report_order=16, run_options=run_options,
    run_models=RUN_MODELS,
    metrics=(
        *per_model("ruler", "mean", "RULER mix, mean string match (0-100)", RUN_MODELS, fmt="{:.1f}", better="higher"),
        Metric("ruler_problems", "RULER mix: problems per task", lambda r: r.result("ruler", "original")["problems"]),
        Metric("ruler_tasks", "RULER mix: tasks", lambda r: len(r.result("ruler", "original")["tasks"])),
        Metric("ruler_context", "RULER mix: prompt tokens", lambda r: r.result("ruler", "original")["context"], "{:,}",
               unit="tokens"),
    ),
    rows=(Row("RULER mix in held-out text, string match 0-100 ({ruler_tasks} needle tasks x {ruler_problems} "
              "problems, {ruler_context} tokens)", "ruler_original", "ruler_final", None, baseline="ruler_baseline"),),
))
