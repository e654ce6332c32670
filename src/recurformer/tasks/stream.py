"""A stream: held-out text with a machine log woven through it, and checks of the log's state.

**[ours]** The case a fixed-size state is made for: the cache must hold what streams in (a
model's own long output, an agent's running log, a long chat), with no prefill to compress
once, so an eviction policy must decide online what to keep before it knows what will be
asked. A stream is held-out real text (its sentences in order from a seeded start) with,
every `gap` tokens or so, one line of a log:

- `set`: "[log] Dial K17 is set to amber." A dial is set again later (overwritten), sometimes
  several times; "[check] Dial K17 is set to amber." wants the latest value, and an answer
  that gives an earlier one is *stale*.
- `count`: "[log] Gate C has counted 3 visitors." (a running count, one more each time) and
  "[check] Gate C has counted 3 visitors."; an earlier count is stale.
- `append`: "[log] Shelf 4 receives a lantern." and "[check] Shelf 4 holds: lantern, rope."
  (every item so far, in order).

A check is a line of the stream like any other (the model reads its own correct answers,
as a model that writes a log reads back what it wrote); its answer tokens are scored
teacher-forced. Each scored answer (`Unit`: a dial's value, a count, one item of a list)
records its kind, its *distance* (tokens since the value last appeared in the stream: its
write, or an earlier check that stated it) and, for a dial, the values it held before (its
stale values). A stream ends with the start of one more check of a dial, which the model
completes freely (greedy): log-likelihood can hide a gap that generation shows.

Values and items are words that the tokenizer writes as one token after a space, and counts
are one digit, so that a stale answer shows in one token. The templates ("[log]", "[check]", dials, gates,
shelves) are our own and differ from every other task's and from the training mix's
(`tests/test_stream_task.py` checks that none of theirs occurs here).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from .ruler import Sources

KINDS = ("set", "count", "append")
INSTRUCTION = ("Below is a long text. Now and then a [log] line records a change in a machine room: a dial set "
               "to a colour, a gate's running count of visitors, an item put on a shelf. A [check] line states the "
               "current state.")
WORDS = ("amber", "azure", "crimson", "ivory", "olive", "scarlet", "silver", "violet", "indigo", "copper", "bronze",
         "golden", "purple", "orange", "yellow", "green", "white", "black", "brown", "pink", "grey", "teal", "navy",
         "beige", "lantern", "rope", "bucket", "ladder", "hammer", "blanket", "kettle", "compass", "candle", "basket",
         "mirror", "whistle", "helmet", "barrel", "anchor", "saddle", "pillow", "shovel", "bottle", "wrench", "needle",
         "violin", "trumpet", "banner", "cushion", "lamp", "clock", "chair", "table", "spoon", "knife", "brush")
COLOURS = WORDS[:24]  # a dial's values
ITEMS = WORDS[24:]  # a shelf's items
GATES = "ABCDEFGH"
MAX_COUNT = 9  # a count is one digit
MAX_ITEMS = 5  # items on a shelf
# of each, per stream (`dials`: the first): with 1 dial the original answers 80% of the dials' checks and 69% of
# the counts' with its full cache (72 streams of 3,072 tokens); with 2, 59.6% of the dials' on 40 (floor: 60%)
DIALS, COUNTERS, SHELVES = 1, 2, 2
GAP = 110  # tokens of text between two log lines, on average (`gap`)
WRITE_SHARE = 0.55  # of the log lines, the share that changes the state (the others check it)
DISTANCE_BINS = (0, 256, 1024, 2048)  # lower ends (tokens)


@dataclass(frozen=True)
class Unit:
    """One scored answer: its `tokens` start at `start` in the stream's ids."""

    kind: str  # one of KINDS
    start: int
    tokens: tuple[int, ...]
    value: str
    distance: int  # tokens since the value last appeared (its write, or an earlier check)
    stale: tuple[str, ...] = ()  # a dial's or a gate's earlier values, latest last
    stale_tokens: tuple[int, ...] = ()  # their last tokens (a value's one word, a count's digit)


@dataclass(frozen=True)
class Stream:
    ids: tuple[int, ...]  # the whole stream, ending with the free check's start
    units: tuple[Unit, ...]  # the teacher-forced answers, in order
    free_value: str  # the dial value the free check must give
    free_stale: tuple[str, ...]  # that dial's earlier values
    tokens: int  # the stream's target length (ids plus the free answer fit in it)


@dataclass
class _Entity:
    kind: str
    name: str  # "Dial K17", "Gate C", "Shelf 4"
    values: list[str] = field(default_factory=list)  # a dial's values or a gate's counts, latest last; a shelf's items
    seen: list[int] = field(default_factory=list)  # the position each of `values` last appeared at


def single_token_words(tokenizer, words: tuple[str, ...]) -> tuple[str, ...]:
    """The `words` that `tokenizer` writes as one token after a space."""
    return tuple(w for w in words if len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1)


class _Builder:
    """The stream's ids, grown segment by segment; answers' positions recorded as they go."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = tokenizer.encode(INSTRUCTION)
        self.units: list[Unit] = []

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def add(self, text: str) -> None:
        self.ids += self.encode(text)

    def answer(self, word: str) -> tuple[int, tuple[int, ...]]:
        """Append " word"; its (start, tokens)."""
        tokens = tuple(self.encode(" " + word))
        start = len(self.ids)
        self.ids += tokens
        return start, tokens


def _state_line(tag: str, entity: _Entity, builder: _Builder) -> int:
    """A dial's or a gate's line with its latest value; the value's start."""
    if entity.kind == "set":
        builder.add(f"\n{tag} {entity.name} is set to")
        start, _ = builder.answer(entity.values[-1])
        builder.add(".")
    else:
        builder.add(f"\n{tag} {entity.name} has counted")
        start, _ = builder.answer(entity.values[-1])
        builder.add(" visitors.")
    return start


def _write(entity: _Entity, rng: random.Random, builder: _Builder, colours, items) -> None:
    if entity.kind == "set":
        entity.values.append(rng.choice([c for c in colours if c not in entity.values]))
    elif entity.kind == "count":
        entity.values.append(str(len(entity.values) + 1))
    else:
        item = rng.choice([i for i in items if i not in entity.values])
        builder.add(f"\n[log] {entity.name} receives a")
        entity.values.append(item)
        entity.seen.append(builder.answer(item)[0])
        builder.add(".")
        return
    entity.seen.append(_state_line("[log]", entity, builder))


def _check(entity: _Entity, builder: _Builder) -> None:
    """The check line of `entity`, its answers recorded as units (each restates its value)."""
    if entity.kind in ("set", "count"):
        start = _state_line("[check]", entity, builder)
        value, previous = entity.values[-1], tuple(entity.values[:-1])
        tokens = tuple(builder.ids[start:])[:len(builder.encode(" " + value))]
        stale_tokens = tuple(builder.encode(" " + v)[-1] for v in previous)
        builder.units.append(Unit(entity.kind, start, tokens, value, start - entity.seen[-1], previous, stale_tokens))
        entity.seen[-1] = start
    else:
        builder.add(f"\n[check] {entity.name} holds:")
        for number, item in enumerate(entity.values):
            if number:
                builder.add(",")
            start, tokens = builder.answer(item)
            builder.units.append(Unit("append", start, tokens, item, start - entity.seen[number]))
            entity.seen[number] = start
        builder.add(".")


def _entities(rng: random.Random, kinds: tuple[str, ...], dials: int) -> list[_Entity]:
    dials = [f"Dial {letter}{rng.randrange(10, 100)}" for letter in rng.sample("KLMNPRST", dials)]
    gates = [f"Gate {g}" for g in rng.sample(GATES, COUNTERS)]
    shelves = [f"Shelf {n}" for n in rng.sample(range(1, 10), SHELVES)]
    names = {"set": dials, "count": gates, "append": shelves}
    return [_Entity(kind, name) for kind in kinds for name in names[kind]]


def generate_stream(tokenizer, sources: Sources, tokens: int, kinds: tuple[str, ...], index: int, seed: int = 0,
                    free_tokens: int = 4, dials: int = DIALS, gap: int = GAP) -> Stream:
    """Stream `index` of at most `tokens` tokens (the free check's answer, `free_tokens`,
    included) with `dials` dials and a log line every `gap` tokens of text on average,
    seeded by (seed, tokens, kinds, index) only."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown stream kind {unknown[0] if unknown else ''!r}; choose from {', '.join(KINDS)}")
    if "set" not in kinds:
        raise ValueError("a stream ends with a free check of a dial: its kinds must include 'set'")
    if not 1 <= dials <= 8 or gap < 2:
        raise ValueError(f"a stream has 1 to 8 dials and a gap of at least 2 tokens, got {dials} and {gap}")
    colours, items = single_token_words(tokenizer, COLOURS), single_token_words(tokenizer, ITEMS)
    if len(colours) < 8 or len(items) < 2 * MAX_ITEMS:
        raise ValueError("the tokenizer writes too few of the stream's words as one token")
    if not sources.sentences:
        raise ValueError("the text has no sentences")
    rng = random.Random(f"stream-{seed}-{tokens}-{','.join(kinds)}-{index}")
    entities = _entities(rng, kinds, dials)
    builder = _Builder(tokenizer)
    sentence = rng.randrange(len(sources.sentences))
    reserve = 24 + free_tokens  # the free check's line and its answer
    while True:
        length = rng.randint(gap // 2, 3 * gap // 2)
        text: list[int] = []
        while len(text) < length:
            text += builder.encode(" " + sources.sentences[sentence % len(sources.sentences)])
            sentence += 1
        if len(builder.ids) + len(text) + 40 + reserve > tokens:
            break
        builder.ids += text
        written = [e for e in entities if e.values]
        writable = [e for e in entities if not (e.kind == "count" and e.values and int(e.values[-1]) >= MAX_COUNT)
                    and not (e.kind == "append" and len(e.values) >= MAX_ITEMS)
                    and not (e.kind == "set" and len(e.values) >= len(colours))]
        if not written:  # the first line sets a dial: every stream has one for its free check
            _write(rng.choice([e for e in entities if e.kind == "set"]), rng, builder, colours, items)
        elif writable and rng.random() < WRITE_SHARE:
            _write(rng.choice(writable), rng, builder, colours, items)
        else:
            _check(rng.choice(written), builder)
    dials = [e for e in entities if e.kind == "set" and e.values]
    if not dials:
        raise ValueError(f"a {tokens:,}-token stream has no room for a dial and its check; ask for a longer stream")
    dial = rng.choice(dials)
    builder.add(f"\n[check] {dial.name} is set to")
    if len(builder.ids) + free_tokens > tokens:
        raise ValueError(f"a {tokens:,}-token stream has no room for its log; ask for a longer stream")
    return Stream(tuple(builder.ids), tuple(builder.units), dial.values[-1], tuple(dial.values[:-1]), tokens)


def generate_streams(tokenizer, sources: Sources, streams: int, tokens: int, kinds: tuple[str, ...], seed: int = 0,
                     free_tokens: int = 4, dials: int = DIALS, gap: int = GAP) -> list[Stream]:
    """`streams` streams (`generate_stream`); the first k of n are the k of a set of k."""
    return [generate_stream(tokenizer, sources, tokens, kinds, i, seed, free_tokens, dials, gap) for i in range(streams)]


def distance_bin(distance: int) -> str:
    """'0-255', '256-1023', '1024-2047' or '2048+'."""
    lower = max(b for b in DISTANCE_BINS if b <= distance)
    later = [b for b in DISTANCE_BINS if b > lower]
    return f"{lower}-{later[0] - 1}" if later else f"{lower}+"


def bin_names() -> tuple[str, ...]:
    return tuple(distance_bin(b) for b in DISTANCE_BINS)

