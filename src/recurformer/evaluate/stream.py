"""`--task stream`: a long stream fed in chunks, at a fixed memory budget (docs/tasks.md).

Each stream (held-out text with a machine log in it, `tasks/stream.py`) is fed `chunk`
tokens at a time, at its true positions, as a model reads its own output. With `--press`
and `--budget`, after every forward the kept heads evict down to what the budget holds
(`eviction.py`): the budget is a fraction of the original's cache at the stream's end
(`tokens` x its bytes per token), and it holds the replaced heads' state, the kept heads'
tokens and the next chunk's, so that no point of the stream holds more (the peak is
measured and checked). The original is run as a conversion that replaces no group
(`as_hybrid`), so every row evicts the same way. Each check's answer tokens are scored
teacher-forced (all right: `correct`; their mean log-probability: `logprob`; a dial's or a
gate's predicted value equal to one of its earlier values: `stale`); the stream's last check is
completed freely (greedy, exact match). The headline is the accuracy over every answer,
each stream weighed alike, with its 90% interval over streams (`evaluate/bootstrap.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..cache import CACHE_ARGUMENT, HybridCache
from ..config import ConfigError, option, parse_choices, require
from ..corpus_sources import shared_corpora, shown_corpora
from ..data import DataError, load_documents
from ..device import model_device
from ..equal_cache import mixer_state_bytes
from ..eviction import PRESSES, Eviction, as_hybrid, least_kept
from ..tasks.ruler import Sources
from ..tasks.shared_context import is_exact
from ..tasks.stream import DIALS, GAP, KINDS, Stream, Unit, bin_names, distance_bin, generate_streams
from .bootstrap import interval
from .registry import Task, register
from .ruler import digest, eos_ids
from .shared_context import value_start

HAYSTACK_CORPORA = ("wikitext-2-raw-test.txt",)  # held-out text: never trained on


def parse_kinds(text: str) -> tuple[str, ...]:
    kinds = parse_choices(text, "--kinds", KINDS)
    if "set" not in kinds:
        raise ConfigError("--kinds must include set: a stream ends with a free check of a dial")
    return kinds


@dataclass(frozen=True)
class StreamOptions:
    data: list[str] = option(help="real text for the streams (.txt or .jsonl; held-out: never trained on)",
                             metavar="FILE", factory=lambda: shared_corpora(HAYSTACK_CORPORA),
                             shown=shown_corpora(HAYSTACK_CORPORA))
    tokens: int = option(4096, "tokens of each stream")
    streams: int = option(40, "streams")
    chunk: int = option(64, "tokens fed at a time; a press acts after each forward")
    kinds: str = option(",".join(KINDS), f"comma-separated log events: {', '.join(KINDS)} (set is required)")
    press: str = option("none", f"what the kept heads evict to hold --budget: none, {', '.join(PRESSES)}")
    budget: float | None = option(None, "the memory the model may hold at any point, as a fraction of the "
                                  "original's cache at the stream's end (with --press)")
    dials: int = option(DIALS, "dials in each stream (1-8): fewer, fewer names to tell apart")
    gap: int = option(GAP, "tokens of text between two log lines, on average: shorter, shorter distances")
    free_tokens: int = option(4, "tokens generated freely for the stream's last check")
    seed: int = option(0, "seeds the streams' text windows and logs")

    def __post_init__(self) -> None:
        require(bool(self.data), "--task stream needs --data FILE (no shared corpora found)")
        require(self.tokens >= 256, f"--tokens must be >= 256, got {self.tokens}")
        require(self.streams >= 1, f"--streams must be >= 1, got {self.streams}")
        require(self.chunk >= 1, f"--chunk must be >= 1, got {self.chunk}")
        require(self.free_tokens >= 1, f"--free-tokens must be >= 1, got {self.free_tokens}")
        require(1 <= self.dials <= 8, f"--dials must be in [1, 8], got {self.dials}")
        require(self.gap >= 2, f"--gap must be >= 2, got {self.gap}")
        parse_kinds(self.kinds)
        require(self.press == "none" or self.press in PRESSES,
                f"--press: unknown {self.press!r}; choose one of none, {', '.join(PRESSES)}")
        if self.budget is not None:
            require(0 < self.budget <= 1, f"--budget must be a fraction in (0, 1], got {self.budget}")
        require((self.press == "none") == (self.budget is None),
                "--press and --budget go together: a press evicts to hold a budget")
        require(self.free_tokens <= self.chunk, f"--free-tokens ({self.free_tokens}) must fit in one --chunk "
                f"({self.chunk}): the budget leaves room for one chunk")


def check(options: StreamOptions, config, tokenizer=None) -> None:
    """Before any work: the streams within the model's positions (`config`: its text config)."""
    limit = config.max_position_embeddings
    require(options.tokens <= limit, f"--tokens {options.tokens:,} is more than the model's positions ({limit:,})")


def original_bytes_per_token(model) -> int:
    """Cache bytes per token of the unconverted model: every KV head of every layer, K and V."""
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers * text.num_key_value_heads * head_dim * 2 * next(model.parameters()).element_size()


def kept_bytes_per_token(model) -> int:
    """Cache bytes per token of `model`'s kept heads (a `RecurFormerForCausalLM`)."""
    size = next(model.parameters()).element_size()
    return sum(len(m.kept_kv_heads) * m.head_dim * 2 * size for m in model.hybrid_attentions())


def budget_bytes(model, options: StreamOptions) -> int | None:
    """The most the model may hold at any point: `budget` x the original's cache at the
    stream's end; None without a budget."""
    if options.budget is None:
        return None
    return round(options.budget * options.tokens * original_bytes_per_token(model))


def tokens_kept(model, options: StreamOptions) -> int | None:
    """How many tokens each kept head keeps after an eviction so that `model` (hybrid) never
    holds more than the budget: the budget less the replaced heads' state and one chunk;
    None without a budget or where the model's whole cache fits it anyway."""
    budget = budget_bytes(model, options)
    if budget is None:
        return None
    state, per_token = mixer_state_bytes(model), kept_bytes_per_token(model)
    if per_token == 0 or state + options.tokens * per_token <= budget:
        return None
    keep = (budget - state) // per_token - options.chunk
    least = least_kept(options.press)
    if keep < least:
        raise ConfigError(f"--budget {options.budget:g} holds {budget:,} bytes: not the replaced heads' state "
                          f"({state:,} bytes) and one --chunk of {options.chunk} tokens with {least} kept per head "
                          f"({per_token:,} bytes a token); give a larger --budget or a smaller --chunk")
    return keep


def _held(cache: HybridCache) -> int:
    sizes = cache.nbytes()
    return sizes["kv"] + sizes["mixer_state"]


def scored_positions(tokenizer, unit: Unit) -> range:
    """The stream positions whose next-token predictions score `unit`: those before each of
    its value's tokens (`value_start` on: the check's name and verb are not scored)."""
    first = value_start(tokenizer, list(unit.tokens))
    return range(unit.start + first - 1, unit.start + len(unit.tokens) - 1)


@torch.no_grad()
def feed_stream(model, tokenizer, stream: Stream, chunk: int, eviction: Eviction | None, free_tokens: int,
                eos: set[int]) -> dict:
    """Feed `stream` through `model` (hybrid) in chunks, evicting after each forward; the
    scored answers, the free completion and the most bytes the cache held."""
    device = model_device(model)
    ids = list(stream.ids)
    wanted = {p: ids[p + 1] for u in stream.units for p in scored_positions(tokenizer, u)}
    predicted: dict[int, tuple[float, int]] = {}  # position -> (log-probability of the next id, argmax)
    cache = HybridCache(model.config.get_text_config().num_hidden_layers)
    peak, logits = 0, None
    if eviction is not None:
        eviction.reset()

    def forward(piece: list[int], start: int, rows: list[int]):
        """The logits `[len(rows), vocab]` at the chunk's `rows` (only those: the output head
        is a fifth of the model's arithmetic)."""
        nonlocal peak
        out = model(input_ids=torch.tensor([piece], device=device), use_cache=True,
                    position_ids=torch.arange(start, start + len(piece), device=device)[None],
                    logits_to_keep=torch.tensor(rows, dtype=torch.long, device=device), **{CACHE_ARGUMENT: cache})
        peak = max(peak, _held(cache))
        if eviction is not None:
            eviction(cache, start + len(piece))
        return out.logits[0].float()

    for start in range(0, len(ids), chunk):
        piece = ids[start:start + chunk]
        scored = [p for p in range(start, start + len(piece)) if p in wanted]
        last = start + len(piece) == len(ids)  # the free completion starts from the stream's last logits
        logits = forward(piece, start, [p - start for p in scored] + [len(piece) - 1] * last)
        for row, position in zip(logits.log_softmax(dim=-1), scored):
            predicted[position] = (float(row[wanted[position]]), int(row.argmax()))
    completion: list[int] = []
    for step in range(free_tokens):
        token = int(logits[-1].argmax())
        if token in eos:
            break
        completion.append(token)
        if step + 1 < free_tokens:
            logits = forward([token], len(ids) + step, [0])
    units = []
    for unit in stream.units:
        positions = scored_positions(tokenizer, unit)
        scored = [predicted[p] for p in positions]
        correct = all(argmax == ids[p + 1] for p, (_, argmax) in zip(positions, scored))
        record = {"kind": unit.kind, "distance": unit.distance, "correct": correct,
                  "logprob": sum(lp for lp, _ in scored) / len(scored)}
        if unit.kind in ("set", "count"):
            top, right = scored[0][1], ids[positions[0] + 1]
            record |= {"overwritten": bool(unit.stale), "stale": top != right and top in unit.stale_tokens}
        units.append(record)
    text = tokenizer.decode(completion, skip_special_tokens=True)
    free = {"completion": text, "exact": is_exact(text, stream.free_value),
            "stale": any(is_exact(text, v) for v in stream.free_stale)}
    return {"units": units, "free": free, "peak_bytes": peak}


def _accuracy(units: list[dict]) -> dict:
    return {"n": len(units), "accuracy": 100 * sum(u["correct"] for u in units) / len(units)} if units else {"n": 0}


def per_stream(records: list[dict]) -> list[list[float]]:
    """Each stream's answers as 0 or 100, the streams without one left out: the unit the
    intervals resample (the same streams in every row: they are made alike)."""
    return [[100.0 * u["correct"] for u in r["units"]] for r in records if r["units"]]


def summarize(records: list[dict]) -> dict:
    """Accuracy (0-100) over every answer with its 90% interval over streams, mean answer
    log-probability, accuracy by kind and by distance, the dials' and gates' latest and stale
    answers once they have changed, and the free completions' exact match."""
    mean, low, high = interval([per_stream(records)])
    units = [u for r in records for u in r["units"]]
    overwritten = [u for u in units if u.get("overwritten")]
    return {
        "accuracy": {"mean": mean, "low": low, "high": high},
        "logprob": sum(u["logprob"] for u in units) / len(units),
        "by_kind": {k: _accuracy([u for u in units if u["kind"] == k]) for k in KINDS if any(u["kind"] == k for u in units)},
        "by_distance": {b: _accuracy([u for u in units if distance_bin(u["distance"]) == b]) for b in bin_names()},
        "overwritten": {**_accuracy(overwritten),
                        "stale": 100 * sum(u["stale"] for u in overwritten) / len(overwritten) if overwritten else None},
        "free": {"n": len(records), "exact": 100 * sum(r["free"]["exact"] for r in records) / len(records),
                 "stale": 100 * sum(r["free"]["stale"] for r in records) / len(records)},
    }


def make_streams(tokenizer, options: StreamOptions) -> list[Stream]:
    try:
        return generate_streams(tokenizer, Sources.from_text("\n".join(load_documents(options.data))),
                                options.streams, options.tokens, parse_kinds(options.kinds), options.seed,
                                options.free_tokens, options.dials, options.gap)
    except ValueError as error:
        raise DataError(f"--task stream: {error}") from None


def evaluate(model, tokenizer, options: StreamOptions, progress: bool = True, known: Mapping[int, dict] | None = None,
             on_record: Callable[[int, dict], None] | None = None) -> dict:
    """The task's result. `known`: records of streams measured before with the same options (any
    `streams`), by stream index, taken as they are (a stream depends on its index only);
    `on_record(index, record)` is called after each stream measured here, so that a caller can
    keep them and resume."""
    check(options, model.config.get_text_config())
    hybrid = as_hybrid(model).eval()
    keep = tokens_kept(hybrid, options)
    budget = budget_bytes(hybrid, options)
    streams = make_streams(tokenizer, options)
    eviction = None if keep is None else Eviction(hybrid, options.press, keep)
    eos, known = eos_ids(model, tokenizer), known or {}
    records = []
    try:
        for index, stream in enumerate(tqdm(streams, desc=f"stream {options.press}", unit="stream",
                                            disable=not progress)):
            if index in known:
                records.append(known[index])
                continue
            records.append(feed_stream(hybrid, tokenizer, stream, options.chunk, eviction, options.free_tokens, eos))
            if on_record is not None:
                on_record(index, records[-1])
    finally:
        if eviction is not None:
            eviction.remove()
    if not any(r["units"] for r in records):
        raise DataError(f"--task stream: {options.tokens:,}-token streams hold no check of the log; ask for longer "
                        "streams or a shorter --gap")
    peak = max(r["peak_bytes"] for r in records)
    if budget is not None and peak > budget:  # the eviction's arithmetic is wrong: no number is better than this one
        raise RuntimeError(f"the cache held {peak:,} bytes, more than the budget's {budget:,}")
    summary = summarize(records)
    return {"tokens": options.tokens, "streams": options.streams, "chunk": options.chunk, "kinds": options.kinds,
            "press": options.press, "budget": options.budget, "budget_bytes": budget, "kept_tokens": keep,
            "peak_bytes": peak, "original_bytes": options.tokens * original_bytes_per_token(hybrid),
            "seed": options.seed, "digest": digest(streams), "headline": summary["accuracy"]["mean"],
            "summary": summary, "records": records}


register(Task(
    name="stream", summary="a long stream of held-out text and a machine log fed in chunks, at a fixed memory "
                           "budget (--press, --budget); teacher-forced answers and a free one (docs/tasks.md)",
    options=StreamOptions, evaluate=evaluate, check=check, report_order=18,
))
