"""RULER-style long-context tasks: needles, variable chains and word counts in a sized prompt.

The synthetic tasks of RULER (Hsieh et al., 2024, "RULER: What's the Real Context Size of
Your Long-Context Language Models?"), generated here, offline, by our own code: nine of its
thirteen tasks (the two QA tasks need SQuAD / HotpotQA, and two of the three multi-key
variants are left out). Each problem is a *context* (instruction and haystack: the part a
KV-cache compression may compress) and a *question* (the question and the start of the
answer, fed after the context, uncompressed, as kvpress's pipeline does), sized together to
at most `context` tokens; the completion is scored as RULER scores these tasks
(`score_ruler`: the fraction of the expected strings found in it, case-insensitive).

Tasks (`TASKS`; RULER's names, its instructions and questions):
- `niah_single_1/2/3`: one needle "One of the special magic numbers for KEY is: VALUE." in
  repeated noise sentences (1), or in real text (2, 3); the value is a 7-digit number (1, 2)
  or a UUID (3). The key is two words joined by a hyphen.
- `niah_multikey_1`: four needles with four keys in real text, one key asked.
- `niah_multivalue`: four needles with the same key and four values, all asked.
- `niah_multiquery`: four needles with four keys in real text, all four keys asked.
- `vt`: variable tracking: a chain "VAR A = 12345.", "VAR B = VAR A.", ... of 4 hops in noise;
  every variable that holds the value is asked.
- `cwe`: a numbered list of words, 10 of them 30 times each (at 4K tokens; fewer below), the
  others 3 times; the 10 common ones are asked.
- `fwe`: coded words whose counts follow a Zipf law (exponent 2) separated by "....", the 3
  most frequent asked.

[ours] Where RULER is silent or uses data we do not have: the real text is any text given
(`Sources`: its sentences, in order, from a seeded start, wrapping around at the end),
RULER's Paul Graham essays being unavailable offline; key words and the common/uncommon
words come from that text's own vocabulary (lowercase alphabetic words of 4-10 letters)
instead of the `wonderwords` lists; coded words are random 5-letter strings with counts
`floor(C / rank^2)` (deterministic, so the top 3 never tie); needles sit at seeded random
depths (fractions of the haystack), a variable chain in order at sorted random depths;
the answer lengths (`max_new_tokens`) are each task's answer plus a margin.

Formats (`FORMATS`), searched on the original model by `benchmarks/long_context/ruler_prompts.py`:
`plain` is RULER's template as plain text; `chat` puts instruction, haystack and question in
the user turn of the tokenizer's chat template and starts the assistant's turn with the
answer's start; `oneshot` puts a solved example of the same task (other keys, the example an eighth of the
prompt, a quarter or a half if the task does not fit) before the plain prompt.
"""

from __future__ import annotations

import random
import re
import string
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
FORMATS = ("plain", "chat", "oneshot")
EXAMPLE_SHARE = 8  # `oneshot`'s solved example is 1/8 of the prompt, or 1/4 or 1/2 if that is too small


class NoRoom(ValueError):
    """The prompt's budget does not leave room for a haystack."""


@dataclass(frozen=True)
class Sources:
    """What the generators draw from: real text cut into sentences, and its vocabulary."""

    sentences: tuple[str, ...]
    words: tuple[str, ...]

    @classmethod
    def from_text(cls, text: str) -> Sources:
        sentences = tuple(s for s in (part.strip() for part in re.split(r"(?<=[.!?])\s+|\n+", text)) if s)
        words = tuple(sorted(set(re.findall(r"(?<!\w)[a-z]{4,10}(?!\w)", text))))
        return cls(sentences, words)


@dataclass(frozen=True)
class RulerProblem:
    task: str
    context: str  # instruction + haystack: what a cache compression may compress
    question: str  # fed after the context, uncompressed; ends with the answer's start
    answers: tuple[str, ...]  # each must appear in the completion
    max_new_tokens: int
    tokens: int  # the prompt's target length (context + question at most this)


@dataclass(frozen=True)
class Draw:
    """A problem's random choices, made once, whatever the haystack's size turns out to be."""

    keys: tuple[str, ...]
    values: tuple[str, ...]
    depths: tuple[float, ...]  # where each needle goes, as a fraction of the haystack
    start: int  # the first sentence of the real text
    seed: int  # for the shuffles that depend on the size
    query: tuple[str, ...]  # the keys (or value) asked for
    answers: tuple[str, ...]


class Ruler(ABC):
    """One task: its instruction, how it draws a problem, builds a haystack of `n` units
    (sentences, noise lines, list items or word counts), asks and expects."""

    instruction: str
    max_new_tokens: int

    @abstractmethod
    def draw(self, rng: random.Random, sources: Sources) -> Draw: ...

    @abstractmethod
    def haystack(self, draw: Draw, n: int, sources: Sources) -> str: ...

    @abstractmethod
    def question(self, draw: Draw) -> str: ...

    @abstractmethod
    def answer_start(self, draw: Draw) -> str: ...

    def max_units(self, sources: Sources, budget: int) -> int:
        """An upper bound of `n` for a prompt of `budget` tokens (every unit is at least a token)."""
        return budget

    def sized(self, budget: int) -> Ruler:
        """The task as a prompt of `budget` tokens asks it."""
        return self


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _uuid(rng: random.Random) -> str:
    hexa = "".join(rng.choice("0123456789abcdef") for _ in range(32))
    return f"{hexa[:8]}-{hexa[8:12]}-4{hexa[13:16]}-{rng.choice('89ab')}{hexa[17:20]}-{hexa[20:]}"


def _key(rng: random.Random, sources: Sources) -> str:
    return f"{rng.choice(sources.words)}-{rng.choice(sources.words)}"


def _insert(units: list[str], items: list[str], depths: tuple[float, ...]) -> list[str]:
    """`units` with `items[i]` inserted at fraction `depths[i]` of them (ties keep item order)."""
    slots = sorted(range(len(items)), key=lambda i: (round(depths[i] * len(units)), i))
    out, placed = [], 0
    for index, unit in enumerate(units + [None]):
        while placed < len(slots) and round(depths[slots[placed]] * len(units)) == index:
            out.append(items[slots[placed]])
            placed += 1
        if unit is not None:
            out.append(unit)
    return out


def _essay(sources: Sources, start: int, n: int) -> list[str]:
    """`n` sentences of the real text from `start`, wrapping around at its end."""
    count = len(sources.sentences)
    return [sources.sentences[(start + i) % count] for i in range(n)]


@dataclass(frozen=True)
class Niah(Ruler):
    """Needles "One of the special magic {kind} for {key} is: {value}." in a haystack."""

    haystack_kind: str  # "noise" or "essay"
    value_kind: str  # "number" or "uuid"
    keys: int = 1
    values: int = 1
    queries: int = 1
    max_new_tokens: int = 32

    @property
    def kind(self) -> str:
        return "numbers" if self.value_kind == "number" else "uuids"

    @property
    def instruction(self) -> str:
        return (f"Some special magic {self.kind} are hidden within the following text. Make sure to memorize it. "
                f"I will quiz you about the {self.kind} afterwards.")

    def draw(self, rng: random.Random, sources: Sources) -> Draw:
        keys: list[str] = []
        while len(keys) < self.keys:
            key = _key(rng, sources)
            keys += [key] if key not in keys else []
        pairs = [(key, _number(rng, 7) if self.value_kind == "number" else _uuid(rng))
                 for key in keys for _ in range(self.values)]
        depths = tuple(rng.random() for _ in pairs)
        asked = tuple(rng.sample(keys, self.queries))
        return Draw(keys=tuple(k for k, _ in pairs), values=tuple(v for _, v in pairs), depths=depths,
                    start=rng.randrange(len(sources.sentences)), seed=rng.randrange(2**31), query=asked,
                    answers=tuple(v for k, v in pairs if k in asked))

    def needle(self, key: str, value: str) -> str:
        return f"One of the special magic {self.kind} for {key} is: {value}."

    def haystack(self, draw: Draw, n: int, sources: Sources) -> str:
        units = [NOISE] * n if self.haystack_kind == "noise" else _essay(sources, draw.start, n)
        needles = [self.needle(k, v) for k, v in zip(draw.keys, draw.values)]
        return " ".join(_insert(units, needles, draw.depths))

    def max_units(self, sources: Sources, budget: int) -> int:
        return budget if self.haystack_kind == "noise" else min(budget, len(sources.sentences))

    def _asked(self, draw: Draw) -> str:
        keys = list(draw.query)
        return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + f", and {keys[-1]}"

    def question(self, draw: Draw) -> str:
        return f"What are all the special magic {self.kind} for {self._asked(draw)} mentioned in the provided text?"

    def answer_start(self, draw: Draw) -> str:
        return f"The special magic {self.kind} for {self._asked(draw)} mentioned in the provided text are"


@dataclass(frozen=True)
class VariableTracking(Ruler):
    hops: int = 4
    max_new_tokens: int = 30
    instruction: str = "Memorize and track the chain(s) of variable assignment hidden in the following text."

    def draw(self, rng: random.Random, sources: Sources) -> Draw:
        names: list[str] = []
        while len(names) < self.hops + 1:
            name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
            names += [name] if name not in names else []
        value = _number(rng, 5)
        return Draw(keys=tuple(names), values=(value,), depths=tuple(sorted(rng.random() for _ in names)), start=0,
                    seed=rng.randrange(2**31), query=(value,), answers=tuple(names))

    def haystack(self, draw: Draw, n: int, sources: Sources) -> str:
        chain = [f"VAR {draw.keys[0]} = {draw.values[0]}."]
        chain += [f"VAR {name} = VAR {before}." for before, name in zip(draw.keys, draw.keys[1:])]
        return " ".join(_insert([NOISE] * n, chain, draw.depths))

    def question(self, draw: Draw) -> str:
        return f"Question: Find all variables that are assigned the value {draw.values[0]} in the text above."

    def answer_start(self, draw: Draw) -> str:
        return (f"Answer: According to the chain(s) of variable assignment in the text above, {len(draw.keys)} "
                f"variables are assigned the value {draw.values[0]}, they are:")


@dataclass(frozen=True)
class CommonWords(Ruler):
    """A numbered list: `common` words `common_count` times each, the `n` others `rare_count` times."""

    common: int = 10
    common_count: int = 30
    rare_count: int = 3
    max_new_tokens: int = 64
    instruction: str = ("Below is a numbered list of words. In these words, some appear more often than others. "
                        "Memorize the ones that appear most often.")

    def draw(self, rng: random.Random, sources: Sources) -> Draw:
        if len(sources.words) < 2 * self.common:
            raise ValueError(f"the text has {len(sources.words)} distinct words, too few for a word list")
        words = rng.sample(sources.words, len(sources.words))  # all of them, shuffled: the first are the common ones
        return Draw(keys=tuple(words), values=(), depths=(), start=0, seed=rng.randrange(2**31), query=(),
                    answers=tuple(words[:self.common]))

    def haystack(self, draw: Draw, n: int, sources: Sources) -> str:
        items = [w for w in draw.keys[:self.common] for _ in range(self.common_count)]
        items += [w for w in draw.keys[self.common:self.common + n] for _ in range(self.rare_count)]
        random.Random(f"{draw.seed}-{n}").shuffle(items)
        return " ".join(f"{i + 1}. {word}" for i, word in enumerate(items))

    def max_units(self, sources: Sources, budget: int) -> int:
        return min(budget, len(sources.words) - self.common)

    def sized(self, budget: int) -> Ruler:
        """[ours] Below 4K tokens the common words' count shrinks with the length (30 at 4K, as
        RULER's), so that the list fits and they stay more common than the others."""
        return replace(self, common_count=max(self.rare_count + 1, min(self.common_count, round(
            self.common_count * budget / 4096))))

    def question(self, draw: Draw) -> str:
        return f"Question: What are the {self.common} most common words in the above list?"

    def answer_start(self, draw: Draw) -> str:
        return f"Answer: The top {self.common} words that appear most often in the list are:"


@dataclass(frozen=True)
class FrequentWords(Ruler):
    """Coded words, the word of rank r appearing `floor(n / r^alpha)` times, shuffled."""

    alpha: float = 2.0
    top: int = 3
    vocabulary: int = 64
    max_new_tokens: int = 32
    instruction: str = ("Read the following coded text and track the frequency of each coded word. Find the three "
                        "most frequently appeared coded words.")

    def draw(self, rng: random.Random, sources: Sources) -> Draw:
        words: list[str] = []
        while len(words) < self.vocabulary:
            word = "".join(rng.choice(string.ascii_lowercase) for _ in range(5))
            words += [word] if word not in words else []
        return Draw(keys=tuple(words), values=(), depths=(), start=0, seed=rng.randrange(2**31), query=(),
                    answers=tuple(words[:self.top]))

    def haystack(self, draw: Draw, n: int, sources: Sources) -> str:
        # n >= 9 keeps the third word's count above zero; the counts of ranks 1, 2, 3 differ from then on
        counts = [int(max(n, 9) / rank**self.alpha) for rank in range(1, len(draw.keys) + 1)]
        items = [w for w, c in zip(draw.keys, counts) for _ in range(c)]
        random.Random(f"{draw.seed}-{n}").shuffle(items)
        return " .... ".join(items)

    def question(self, draw: Draw) -> str:
        return ("Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text?")

    def answer_start(self, draw: Draw) -> str:
        return "Answer: According to the coded text above, the three most frequently appeared words are:"


TASKS: dict[str, Ruler] = {
    "niah_single_1": Niah("noise", "number", max_new_tokens=24),
    "niah_single_2": Niah("essay", "number", max_new_tokens=24),
    "niah_single_3": Niah("essay", "uuid", max_new_tokens=48),
    "niah_multikey_1": Niah("essay", "number", keys=4, max_new_tokens=24),
    "niah_multivalue": Niah("essay", "number", values=4, max_new_tokens=64),
    "niah_multiquery": Niah("essay", "number", keys=4, queries=4, max_new_tokens=64),
    "vt": VariableTracking(),
    "cwe": CommonWords(),
    "fwe": FrequentWords(),
}


def parse_tasks(text: str) -> tuple[str, ...]:
    """'niah_single_1,vt' -> ('niah_single_1', 'vt'); 'all' -> every task. Unknown names: ValueError."""
    names = tuple(TASKS) if text == "all" else tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in names if name not in TASKS]
    if unknown or not names:
        raise ValueError(f"unknown RULER task {unknown[0] if unknown else text!r}; choose from all, {', '.join(TASKS)}")
    return names


def render(fmt: str, tokenizer, task: Ruler, draw: Draw, haystack: str, example: str = "") -> tuple[str, str]:
    """(context, question) of a problem in format `fmt`; `example`: `oneshot`'s solved example."""
    question = task.question(draw)
    if fmt == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the chat format needs a tokenizer with a chat template")
        user = f"{task.instruction}\n{haystack}\n{question}"
        template = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                 add_generation_prompt=True)
        split = template.index(user) + len(f"{task.instruction}\n{haystack}")
        return template[:split], template[split:] + task.answer_start(draw)
    return f"{example}{task.instruction}\n{haystack}", f"\n{question} {task.answer_start(draw)}"


def solved(draw: Draw, context: str, question: str) -> str:
    """A problem followed by its answer: `oneshot`'s example."""
    return f"{context}{question} {', '.join(draw.answers)}.\n\n"


def largest_fitting(length: Callable[[int], int], budget: int, most: int) -> int:
    """The largest n in [1, most] with length(n) <= budget (length grows with n); 0 if none."""
    low, high = 0, 1
    while high < most and length(high) <= budget:  # doubling first: no prompt much longer than the budget
        low, high = high, min(2 * high, most)
    while low < high:
        middle = (low + high + 1) // 2
        if length(middle) <= budget:
            low = middle
        else:
            high = middle - 1
    return low


def generate_ruler(tokenizer, sources: Sources, task_names: tuple[str, ...], tokens: int, problems: int,
                   seed: int = 0, fmt: str = "plain") -> list[RulerProblem]:
    """`problems` problems of each task, each a prompt (context + question) of at most `tokens`
    tokens, as large a haystack as fits; seeded by (seed, task, tokens, index) only."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown RULER format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if not sources.sentences or not sources.words:
        raise ValueError("the haystack text has no sentences or no words")

    def size(context: str, question: str) -> int:
        return len(tokenizer.encode(context)) + len(tokenizer.encode(question, add_special_tokens=False))

    def build(task: Ruler, name: str, draw: Draw, budget: int, example: str = "") -> tuple[str, str]:
        task = task.sized(budget)
        most = task.max_units(sources, budget)
        n = largest_fitting(
            lambda k: size(*render(fmt, tokenizer, task, draw, task.haystack(draw, k, sources), example)), budget, most)
        if n == 0:
            raise NoRoom(f"a {budget}-token prompt leaves no room for a {name} haystack")
        if n == most < budget:  # the text, not the budget, bounded the haystack
            raise ValueError(f"the haystack text is too short for a {budget:,}-token {name} prompt "
                             f"({len(sources.sentences):,} sentences, {len(sources.words):,} distinct words)")
        return render(fmt, tokenizer, task, draw, task.haystack(draw, n, sources), example)

    out = []
    for name in task_names:
        task = TASKS[name]
        for index in range(problems):
            rng = random.Random(f"ruler-{seed}-{name}-{tokens}-{index}")
            draw = task.draw(rng, sources)
            example, share = "", EXAMPLE_SHARE
            shot = task.draw(random.Random(f"ruler-example-{seed}-{name}-{tokens}-{index}"), sources)
            while fmt == "oneshot" and not example:
                try:
                    example = solved(shot, *build(task, name, shot, tokens // share))
                except NoRoom:
                    if share == 2:
                        raise
                    share //= 2
            context, question = build(task, name, draw, tokens, example)
            out.append(RulerProblem(name, context, question, draw.answers, task.max_new_tokens, tokens))
    return out


def score_ruler(completion: str, answers: tuple[str, ...] | list[str]) -> float:
    """RULER's `string_match_all`: the fraction of `answers` found in `completion`, case-insensitive."""
    text = completion.lower()
    return sum(answer.lower() in text for answer in answers) / len(answers)


def summarize(records: list[dict]) -> dict:
    """Per task: problems and mean score (0-100, RULER's scale); `mean`: over the tasks."""
    by_task: dict[str, list[float]] = {}
    for record in records:
        by_task.setdefault(record["task"], []).append(record["score"])
    tasks = {name: {"n": len(scores), "score": 100 * sum(scores) / len(scores)} for name, scores in by_task.items()}
    return {"tasks": tasks, "mean": sum(t["score"] for t in tasks.values()) / len(tasks) if tasks else float("nan")}
