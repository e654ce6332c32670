"""`--task shared-context`: one long context, many facts, many questions (docs/tasks.md).

Each context (held-out real text with `needles` facts, `tasks/shared_context.py`) is
prefilled once; `questions` of its facts are then asked, greedy, exact match, in two modes
(`evaluate/conversation.py`): *multi-request* (each question from a copy of the prefilled
cache) and *multi-turn* (questions and the model's own answers appended in turn). For every
answer also the gold value's mean log-probability (teacher-forced) and whether the greedy
first token is the gold's. The headline is the multi-request exact match; its 90% interval
resamples whole contexts (`evaluate/bootstrap.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..cache import CACHE_ARGUMENT
from ..config import option, parse_choices, require
from ..corpus_sources import shared_corpora, shown_corpora
from ..data import DataError, load_documents
from ..device import model_device
from ..tasks.ruler import Sources
from ..tasks.shared_context import FORMATS, KINDS, SharedContext, generate_shared_contexts, is_exact
from .bootstrap import interval
from .conversation import EXTRA_TOKENS, MODES, ask
from .registry import Task, register
from .ruler import digest, eos_ids

HAYSTACK_CORPORA = ("wikitext-2-raw-test.txt",)  # held-out text: never trained on
BEST_FORMAT = "plain"  # docs/results/shared-context-prompts.md
NEEDLES = 8  # the most at which the original answers >= 75% at 4K (docs/results/shared-context-prompts.md)
DEPTH_BINS = ("0-1/3", "1/3-2/3", "2/3-1")


def parse_modes(text: str) -> tuple[str, ...]:
    """'multi-request,multi-turn' -> ('multi-request', 'multi-turn'), checked."""
    return parse_choices(text, "--modes", MODES)


@dataclass(frozen=True)
class ContextIds:
    """One context as token ids: what every row, ours or a peer's, reads."""

    context: list[int]
    questions: list[list[int]]  # each asked needle's question as the first turn after the context
    later: list[list[int]]  # the same as a later turn
    golds: list[list[int]]  # each asked needle's value, with its leading space


def context_ids(tokenizer, problem: SharedContext) -> ContextIds:
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    return ContextIds(tokenizer.encode(problem.context), [encode(q) for q in problem.questions],
                      [encode(q) for q in problem.later_questions], [encode(a) for a in problem.answers])


def conversation_length(ids: ContextIds) -> int:
    """Positions a multi-turn conversation may reach: the context, every turn, the longest answers."""
    return len(ids.context) + sum(len(q) + len(g) + EXTRA_TOKENS for q, g in zip(ids.later, ids.golds))


def ends_answer(tokenizer):
    """[ours] An answer is one line: it ends at its first line break."""
    return lambda ids: "\n" in tokenizer.decode(ids, skip_special_tokens=True).lstrip()


def depth_bin(depth: float) -> str:
    return DEPTH_BINS[min(int(depth * 3), 2)]


def value_start(tokenizer, gold: list[int]) -> int:
    """The first of a gold answer's tokens that holds a character of the value (SmolLM2 writes
    " 4827193" as a bare space token and then the digits: the space says nothing)."""
    return next(i for i, token in enumerate(gold) if tokenizer.decode([token]).strip())


def score_context(tokenizer, problem: SharedContext, golds: list[list[int]],
                  answered: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Each mode's answers of one context as records: the needle, the completion, `exact`, and
    from the value's first token on (`value_start`), `logprob` (the mean gold log-probability)
    and `first` (is the first such token the greedy one)."""
    out = {}
    for mode, answers in answered.items():
        out[mode] = []
        for index, gold, answer in zip(problem.asked, golds, answers):
            needle, start = problem.needles[index], value_start(tokenizer, gold)
            completion = tokenizer.decode(answer["answer"], skip_special_tokens=True)
            out[mode].append({"kind": needle.kind, "depth": round(needle.depth, 4), "value": needle.value,
                              "completion": completion, "exact": is_exact(completion, needle.value),
                              "logprob": sum(answer["logprobs"][start:]) / len(gold[start:]),
                              "first": answer["argmax"][start]})
    return out


def summarize(contexts: list[dict[str, list[dict]]]) -> dict:
    """Per mode: exact match, first-token match (0-100) and mean gold log-probability, each with
    its 90% interval over contexts, and exact match by kind and by depth."""
    summary = {}
    for mode in contexts[0]:
        by_context = [c[mode] for c in contexts]
        entry = {}
        for measure, scale in (("exact", 100.0), ("first", 100.0), ("logprob", 1.0)):
            mean, low, high = interval([[[scale * float(r[measure]) for r in records] for records in by_context]])
            entry[measure] = {"mean": mean, "low": low, "high": high}
        records = [r for c in by_context for r in c]
        for name, groups in (("by_kind", {k: [r for r in records if r["kind"] == k] for k in KINDS}),
                             ("by_depth", {b: [r for r in records if depth_bin(r["depth"]) == b] for b in DEPTH_BINS})):
            entry[name] = {k: {"n": len(rs), "exact": 100 * sum(r["exact"] for r in rs) / len(rs)}
                           for k, rs in groups.items() if rs}
        summary[mode] = entry
    return summary


@torch.no_grad()
def answer_contexts(model, tokenizer, problems: list[SharedContext], modes: tuple[str, ...],
                    progress: bool = True) -> list[dict[str, list[dict]]]:
    """Each context prefilled once, then its questions in each mode, scored."""
    eos, stop, out = eos_ids(model, tokenizer), ends_answer(tokenizer), []
    model.eval()
    for problem in tqdm(problems, desc="shared-context", unit="context", disable=not progress):
        ids = context_ids(tokenizer, problem)
        prefill = model(input_ids=torch.tensor([ids.context], device=model_device(model)), use_cache=True,
                        logits_to_keep=1)
        answered = ask(model, prefill[CACHE_ARGUMENT], len(ids.context), ids.questions, ids.later, ids.golds, eos,
                       stop, modes, cache_key=CACHE_ARGUMENT)
        out.append(score_context(tokenizer, problem, ids.golds, answered))
    return out


def shared_problems(tokenizer, data: list[str], contexts: int, tokens: int, needles: int, questions: int, seed: int,
                    fmt: str) -> list[SharedContext]:
    try:
        return generate_shared_contexts(tokenizer, Sources.from_text("\n".join(load_documents(data))), contexts,
                                        tokens, needles, questions, seed=seed, fmt=fmt)
    except ValueError as error:
        raise DataError(f"--task shared-context: {error}") from None


@dataclass(frozen=True)
class SharedContextOptions:
    data: list[str] = option(help="real text for the contexts (.txt or .jsonl; held-out: never trained on)",
                             metavar="FILE", factory=lambda: shared_corpora(HAYSTACK_CORPORA),
                             shown=shown_corpora(HAYSTACK_CORPORA))
    context: int = option(4096, "tokens of each context (the questions come after it)")
    contexts: int = option(40, "contexts, each prefilled once (40: a headline interval of about +/- 4 points)")
    needles: int = option(NEEDLES, "facts in each context")
    questions: int | None = option(None, "facts asked per context (default: every one)")
    seed: int = option(0, "seeds the facts, their places and the text windows")
    format: str = option(BEST_FORMAT, f"prompt format: {', '.join(FORMATS)} (docs/tasks.md)")
    modes: str = option(",".join(MODES), f"comma-separated: {', '.join(MODES)}")

    def __post_init__(self) -> None:
        require(bool(self.data), "--task shared-context needs --data FILE (no shared corpora found)")
        require(self.context >= 1, f"--context must be >= 1, got {self.context}")
        require(self.contexts >= 1, f"--contexts must be >= 1, got {self.contexts}")
        require(self.needles >= 1, f"--needles must be >= 1, got {self.needles}")
        require(self.questions is None or 1 <= self.questions <= self.needles,
                f"--questions must be between 1 and --needles ({self.needles}), got {self.questions}")
        require(self.format in FORMATS, f"--format: unknown {self.format!r}; choose one of {', '.join(FORMATS)}")
        parse_modes(self.modes)


def check(options: SharedContextOptions, config, tokenizer=None) -> None:
    """Before any work (the contexts take minutes to make at 100K tokens): a context of
    `--context` tokens and its question turns, each at least a token of question, one of
    answer and `EXTRA_TOKENS`, within the model's positions (`config`: its text config).
    `evaluate` checks the conversations' exact length once they are made."""
    limit = config.max_position_embeddings
    questions = options.questions or options.needles
    require(options.context + questions * (2 + EXTRA_TOKENS) <= limit,
            f"--context {options.context} and {questions} question turns reach more positions than the model allows "
            f"({limit:,}); ask fewer --questions or a shorter --context")


def evaluate(model, tokenizer, options: SharedContextOptions) -> dict:
    modes = parse_modes(options.modes)
    questions = options.questions or options.needles
    check(options, model.config.get_text_config())
    problems = shared_problems(tokenizer, options.data, options.contexts, options.context, options.needles, questions,
                               options.seed, options.format)
    limit = model.config.get_text_config().max_position_embeddings
    longest = max(conversation_length(context_ids(tokenizer, p)) for p in problems)
    require(longest <= limit, f"--context {options.context} and {questions} question turns reach {longest:,} "
            f"positions, more than the model allows ({limit:,}); ask fewer --questions or a shorter --context")
    contexts = answer_contexts(model, tokenizer, problems, modes)
    summary = summarize(contexts)
    return {"context": options.context, "contexts": options.contexts, "needles": options.needles,
            "questions": questions, "format": options.format, "seed": options.seed, "digest": digest(problems),
            "headline": summary["multi-request"]["exact"]["mean"] if "multi-request" in summary else None,
            "modes": summary, "records": contexts}


register(Task(
    name="shared-context", summary="one context of held-out text with many facts, many questions from copies of "
                                   "its cache or in one conversation; exact match, gold log-probability (docs/tasks.md)",
    options=SharedContextOptions, evaluate=evaluate, check=check, report_order=17,
))
