"""The retrieval study's design: the tasks, the settings (`Study`), the grid of variants,
the resumable units of work and the seeds of every problem stream. See
`study.py` for what the study does and `report.py` for its results."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from torch import Tensor

from recurformer.config import ConfigError, require
from recurformer.files import write_json_atomic
from recurformer.mixers import MIXER_KINDS
from recurformer.tasks import hashhop_tokens, mqar_tokens, score_hashhop_tokens, score_mqar

SELECTORS = ("recency", "random", "inverse", "layer")
PARTS = ("all", "headline")
EVAL_SEED = 1_000_000  # + scale: held out from every training seed (training uses seed * 10 + k)


# ---------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class MQAR:
    """Multi-query associative recall; at `scale` s: s x the tokens and s x the pairs.

    [ours] Positions between queries hold PAD, not Zoology's random fillers: with a
    vocabulary this small (Zoology's is 8192) a random filler often repeats a key with
    another token after it, and the most recent `key -> next token` is then a wrong answer.
    """

    seq_len: int
    kv_pairs: int
    vocab_size: int
    warm_start: str | None = None  # a task whose base model (same seed) this one's training starts from
    name: str = "mqar"

    def make(self, num: int, scale: int, seed: int) -> dict[str, Tensor]:
        """`{"input_ids", "labels"}` `[num, seq_len * scale]`."""
        return mqar_tokens(num, self.seq_len * scale, self.kv_pairs * scale, self.vocab_size, seed=seed,
                           random_non_queries=False)

    def score(self, predictions: Tensor, labels: Tensor) -> dict:
        return score_mqar(predictions, labels)

    def describe(self) -> str:
        return f"MQAR, {self.kv_pairs} key-value pairs in {self.seq_len} tokens, vocabulary {self.vocab_size}"


@dataclass(frozen=True)
class HashHop:
    """Token HashHop with chain of thought (each hop is written out, so each answer token is
    one lookup); at `scale` s: s x the chains and s x the queries, hence s x the tokens."""

    n_chains: int
    hops: int
    queries: int
    vocab_size: int
    warm_start: str | None = None
    name: str = "hashhop"

    @property
    def seq_len(self) -> int:
        return self.n_chains * self.hops * 3 + self.queries * (2 + self.hops)

    def make(self, num: int, scale: int, seed: int) -> dict[str, Tensor]:
        """`{"input_ids", "labels"}` `[num, seq_len * scale]`."""
        return hashhop_tokens(num, self.n_chains * scale, self.hops, self.vocab_size, seed=seed, cot=True,
                              num_queries=self.queries * scale)

    def score(self, predictions: Tensor, labels: Tensor) -> dict:
        return score_hashhop_tokens(predictions, labels)

    def describe(self) -> str:
        return (f"HashHop (chain of thought), {self.n_chains} chains of {self.hops} hops, {self.queries} queries, "
                f"{self.seq_len} tokens, vocabulary {self.vocab_size}")


def warm_started_tasks(hashhop: HashHop, mqar: MQAR) -> tuple:
    """[ours] HashHop first, then MQAR starting from the HashHop model of the same seed.

    From a random init our MQAR models settled into a solution without retrieval: answer
    with a value of the context that has not been asked yet (about 34% with 8 pairs, the
    accuracy of that guess; measured for learning rates 1e-3 to 1e-2, batch sizes 16 to 64,
    up to 3000 steps, with and without fillers, tied embeddings or biases). HashHop, whose
    keys and values share one vocabulary, offers no such shortcut, and its models learn
    retrieval after a plateau; MQAR then only has to learn its format.
    """
    return hashhop, replace(mqar, warm_start=hashhop.name)


# ---------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Study:
    """Everything that decides the numbers. Validated up front; see `full()` and `quick()`."""

    tasks: tuple
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    batch_size: int
    base_max_steps: int
    base_check_every: int
    base_solved: float  # validation accuracy at which a base model counts as solving its task
    base_lr: float
    continual_batch_size: int
    transfer_steps: int
    transfer_lr: float
    lm_steps: int
    lm_lr: float
    analyze_sequences: int
    recency_window: int  # w of the recency ratio RR, in tokens
    mixer_window: int  # tokens seen by the `window` mixer
    eval_examples: int
    scales: tuple[int, ...]
    betas: tuple[float, ...]
    mixers: tuple[str, ...]
    seeds: tuple[int, ...]
    headline_beta: float
    headline_selectors: tuple[str, ...]
    tolerance: float  # accuracy drop (absolute) that counts as "broken" in the conclusions
    margin: float  # accuracy difference (absolute) below which two variants count as level

    def __post_init__(self) -> None:
        require(self.heads % self.kv_heads == 0, f"--heads {self.heads} is not a multiple of kv heads {self.kv_heads}")
        require(all(0.0 <= b <= 1.0 for b in self.betas), f"--betas must be in [0, 1], got {list(self.betas)}")
        require(0.0 < self.headline_beta < 1.0, f"headline beta must be in (0, 1), got {self.headline_beta}")
        require(self.headline_beta in self.betas, f"headline beta {self.headline_beta} is not among --betas {list(self.betas)}")
        unknown = [m for m in self.mixers if m not in MIXER_KINDS]
        require(not unknown, f"--mixers: {', '.join(unknown)} not available in this recurformer (have: {', '.join(MIXER_KINDS)})")
        require(bool(self.mixers), "--mixers: give at least one mixer")
        require(bool(self.seeds) and len(set(self.seeds)) == len(self.seeds), f"--seeds must be distinct, got {list(self.seeds)}")
        require(all(0 <= s < 100 for s in self.seeds), f"--seeds must be in [0, 100), got {list(self.seeds)}")
        require(self.base_check_every % 10 == 0 and 1 <= self.base_max_steps < 10_000,
                "base_check_every must be a multiple of 10 and base_max_steps in [1, 10000) (see data_seed)")
        require(self.scales[0] == 1 and list(self.scales) == sorted(set(self.scales)), f"scales must start at 1 and grow, got {self.scales}")
        require(all(s in SELECTORS for s in self.headline_selectors), f"headline selectors must be among {SELECTORS}")
        names = [t.name for t in self.tasks]
        for i, task in enumerate(self.tasks):
            require(task.warm_start is None or task.warm_start in names[:i],
                    f"--tasks: {task.name} starts from the {task.warm_start} model; select {task.warm_start} too")

    @classmethod
    def full(cls, mixers: tuple[str, ...], seeds: tuple[int, ...] = (0, 1, 2)) -> "Study":
        return cls(
            tasks=warm_started_tasks(HashHop(n_chains=8, hops=2, queries=4, vocab_size=128), MQAR(seq_len=64, kv_pairs=8, vocab_size=128)),
            hidden=128, layers=4, heads=4, kv_heads=2, intermediate=256, batch_size=64,
            base_max_steps=3000, base_check_every=100, base_solved=0.97, base_lr=3e-3,
            continual_batch_size=32, transfer_steps=100, transfer_lr=3e-3, lm_steps=150, lm_lr=1e-3,
            analyze_sequences=64, recency_window=4, mixer_window=8, eval_examples=512, scales=(1, 2, 4),
            betas=(0.0, 0.25, 0.5, 0.75, 1.0), mixers=mixers, seeds=seeds, headline_beta=0.5,
            headline_selectors=("recency", "random", "layer"), tolerance=0.05, margin=0.01,
        )

    @classmethod
    def quick(cls, mixers: tuple[str, ...]) -> "Study":
        """A pipeline check: every kind of unit and output, at toy sizes; the numbers mean nothing."""
        return cls(
            tasks=warm_started_tasks(HashHop(n_chains=2, hops=2, queries=1, vocab_size=32), MQAR(seq_len=16, kv_pairs=2, vocab_size=32)),
            hidden=32, layers=2, heads=4, kv_heads=2, intermediate=32, batch_size=8,
            base_max_steps=4, base_check_every=10, base_solved=0.97, base_lr=3e-3,
            continual_batch_size=8, transfer_steps=2, transfer_lr=3e-3, lm_steps=2, lm_lr=1e-3,
            analyze_sequences=4, recency_window=4, mixer_window=4, eval_examples=16, scales=(1, 2, 4),
            betas=(0.0, 0.5, 1.0), mixers=mixers, seeds=(0, 1), headline_beta=0.5,
            headline_selectors=("recency", "layer"), tolerance=0.05, margin=0.01,
        )

    def to_dict(self) -> dict:
        data = asdict(self)
        data["tasks"] = [{"name": t.name, "seq_len": t.seq_len, **asdict(t)} for t in self.tasks]
        return data

    def unit_settings(self, task) -> dict:
        """The settings `task`'s finished units depend on (the others only decide which units exist)."""
        grid = {"tasks", "betas", "mixers", "seeds", "headline_beta", "headline_selectors", "tolerance", "margin"}
        settings = {k: v for k, v in self.to_dict().items() if k not in grid}
        source = next((t for t in self.tasks if t.name == task.warm_start), None)
        tasks = {"task": {"seq_len": task.seq_len, **asdict(task)}}
        if source is not None:  # the base model depends on the one it starts from
            tasks["warm_start_task"] = {"seq_len": source.seq_len, **asdict(source)}
        return json.loads(json.dumps({**settings, **tasks}))

    def only(self, names: list[str]) -> "Study":
        """The same study restricted to the tasks in `names`."""
        known = [t.name for t in self.tasks]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise ConfigError(f"--tasks: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(known)}")
        return replace(self, tasks=tuple(t for t in self.tasks if t.name in names))


def check_work_dir(study: Study, work: Path, record: bool) -> None:
    """Refuse a task directory whose `settings.json` holds other unit settings (skipping its
    finished units would mix two studies); with `record`, write the settings of a new one."""
    for task in study.tasks:
        path, settings = work / task.name / "settings.json", study.unit_settings(task)
        if not path.exists():
            if record:
                write_json_atomic(path, settings)
            continue
        recorded = json.loads(path.read_text())
        changed = sorted(k for k in settings.keys() | recorded.keys() if settings.get(k) != recorded.get(k))
        if changed:
            raise ConfigError(f"{path.parent} holds units made with other settings ({', '.join(changed)}); use another --work")


@dataclass(frozen=True)
class Variant:
    """What is replaced: `selector` in SELECTORS, `none` (beta 0) or `all` (beta 1)."""

    selector: str
    mixer: str
    beta: float

    @property
    def name(self) -> str:
        if self.selector == "none":
            return "none-b0.00"
        return f"{self.mixer}-{self.selector}-b{self.beta:.2f}"


@dataclass(frozen=True)
class Unit:
    """One resumable piece of work: `kind` in base, variant, eval; done when `path` exists.
    `home` is the directory of its (task, seed): `base/`, `variants/<name>/`, `evals/<name>.json`."""

    kind: str
    task: object
    seed: int
    variant: Variant | None
    home: Path

    @property
    def path(self) -> Path:
        if self.kind == "base":
            return self.home / "base"
        name = "original" if self.variant is None else self.variant.name
        return self.home / "variants" / name if self.kind == "variant" else self.home / "evals" / f"{name}.json"

    @property
    def label(self) -> str:
        what = "base model" if self.kind == "base" else (self.variant.name if self.variant else "original")
        return f"{self.kind} {self.task.name} s{self.seed} {what}"

    @property
    def timing_kind(self) -> str:
        """Units whose cost differs get their own estimate (a mixer trains at its own speed)."""
        if self.kind == "variant":
            return f"variant:{self.variant.mixer if self.variant.selector != 'none' else 'none'}"
        return self.kind


def variants(study: Study, seed: int, part: str) -> list[Variant]:
    """The grid for `seed`: everything for the first seed (part `all`), the headline rows
    (beta 0 and the headline selectors at the headline beta) otherwise."""
    out = [Variant("none", "none", 0.0)] if 0.0 in study.betas else []
    full = part == "all" and seed == study.seeds[0]
    for beta in study.betas:
        for mixer in study.mixers:
            if beta == 1.0 and full:
                out.append(Variant("all", mixer, 1.0))
            elif 0.0 < beta < 1.0:
                chosen = SELECTORS if full else (study.headline_selectors if beta == study.headline_beta else ())
                out += [Variant(s, mixer, beta) for s in chosen]
    return out


def plan(study: Study, work: Path, part: str) -> list[Unit]:
    """Every unit in dependency order: base model, its evaluation, then each variant and its evaluation."""
    units = []
    for task in study.tasks:
        for seed in study.seeds:
            home = work / task.name / f"s{seed}"
            units.append(Unit("base", task, seed, None, home))
            units.append(Unit("eval", task, seed, None, home))
            for variant in variants(study, seed, part):
                units.append(Unit("variant", task, seed, variant, home))
                units.append(Unit("eval", task, seed, variant, home))
    return units


def data_seed(seed: int, purpose: str) -> int:
    """Problem streams per model seed and purpose: `10 * seed + k`. Base training draws each
    round from `1000 * data_seed(seed, "base") + step` = `10000 * seed + step`, a multiple of
    10 (rounds are multiples of 10 steps) below the next seed's, while the other purposes
    end in k = 1..3; evaluation uses EVAL_SEED + scale. With seeds below 100 and fewer than
    10000 steps, no two streams share a seed."""
    return seed * 10 + {"base": 0, "analysis": 1, "continual": 2, "validation": 3}[purpose]

