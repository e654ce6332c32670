"""Retrieval at equal cache bytes at the evaluated length: our rows (docs/results/long-context.md,
"Retrieval at equal cache bytes").

Every row answers the problem set of `ruler_problems.py` (RULER at 4K, passkey at 1K/2K/4K) the
way kvpress's pipeline answers (`recurformer.evaluate.generation.prefilled_answer`): the context
is prefilled into the row's cache (a press compresses it then), the question is fed
uncompressed at its positions, then greedy tokens. The completions are stored; the table
(`ruler_table.py`) scores them.

A *budget* (`--budget NAME=DIR`, e.g. `0.5=runs/demo05/final`; NAME is the cache fraction it
stands for, with a tag when two models stand for one: `0.25-ablation-retrieval`) is a converted
model: at each context length C of the problems, every row of that budget holds the bytes that
model's cache holds at C tokens (its kept K/V grow with C, its mixer state does not). Rows
(`--rows`, each `KIND@BUDGET`):

- `conversion@B`: the budget's model itself;
- `window@B`: the training-free `window` on its groups, ring buffer of its state's bytes
  (`recurformer.equal_cache.window_baseline`);
- `duo@B`: DuoAttention-style, no training: the groups the `ablation` scorer keeps
  (`--ablation-scores`) stay full, the others (as many as the budget's model replaced) are
  windowed with `window@B`'s window;
- `duo-retrieval@B`: the same with the groups the `ablation-retrieval` scorer keeps
  (`--retrieval-scores`: the cost measured on a retrieval probe's answers);
- `streaming@B`: StreamingLLM: every group a window of 4 sinks + `w(C)` recent tokens, `w(C)`
  sized at each C to the budget's bytes;
- `compose-PRESS@B`: the model of `--compose-base` (a smaller compression, e.g. the beta 0.5
  model) with PRESS (`kept_press.py`) on its kept heads, keeping at each C the fraction of
  their tokens that brings its cache to the budget's bytes, every head the same count;
  `compose-global-PRESS@B`: the same count on average, all heads' tokens ranked together;

and `original`. Rows and problems already in `--out` are kept: an interrupted run resumes.

    OMP_NUM_THREADS=1 python -m benchmarks.peers.ruler_ours \\
        --budget 0.5=runs/demo/final --budget 0.25=runs/demo075/final \\
        --rows original,conversion@0.5,window@0.5,duo@0.5,streaming@0.5 --compose-base 0.5
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from recurformer import HeadScores, MixerConfig, convert, make_scorer, select_heads
from recurformer.bench import cache_bytes
from recurformer.cache import CACHE_ARGUMENT
from recurformer.config import ReplacementSpec
from recurformer.equal_cache import equal_cache_window, window_baseline
from recurformer.evaluate.generation import prefilled_answer
from recurformer.evaluate.ruler import ends_answer
from recurformer.files import write_json_atomic
from recurformer.loading import load_any, load_model

from benchmarks.common import RESULTS as ALL_RESULTS, ROOT

from benchmarks.peers.kept_press import PRESSES, KeptPress
from benchmarks.peers.ruler_table import TableError, split_budget

RESULTS = ALL_RESULTS / "long-context"
SCHEMA = "recurformer-ruler-rows/1"
SINKS = 4
PROBE = 256  # tokens of the forward that measures a cache's bytes per token


@torch.no_grad()
def cache_line(model) -> tuple[float, int]:
    """(K/V bytes per token, fixed state bytes) of `model`'s cache: bytes at C tokens are
    `per_token * C + state` (its K/V grow linearly, its mixer state is allocated whole)."""
    cache = model(torch.randint(0, 1000, (1, PROBE)), use_cache=True)[CACHE_ARGUMENT]
    held, _, state = cache_bytes(cache)
    return held / PROBE, state


def beta_of(model) -> float:
    spec = model.config.replacement
    return len(spec["groups"]) / (spec["num_layers"] * spec["num_kv_heads"])


class Rows:
    """Builds the rows of one run: the original, the budgets' models and their rivals."""

    def __init__(self, original, tokenizer, budgets: dict[str, str], ablation_scores: str, compose_base: str | None,
                 retrieval_scores: str | None = None):
        self.original, self.tokenizer = original, tokenizer
        self.scores = {"duo": (ablation_scores, "ablation"), "duo-retrieval": (retrieval_scores, "ablation-retrieval")}
        self.models = {name: load_any(folder)[0].eval() for name, folder in budgets.items()}
        self.folders = budgets
        self.lines = {name: cache_line(model) for name, model in self.models.items()}
        self.full_per_token, _ = cache_line(original)
        self.compose_base = compose_base
        self.windows: dict[str, int] = {}
        self.press: KeptPress | None = None  # hooked on the base model: one at a time

    def budget_bytes(self, budget: str, context: int) -> int:
        per_token, state = self.lines[budget]
        return round(per_token * context + state)

    def equal_window(self, budget: str) -> int:
        if budget not in self.windows:
            self.windows[budget] = equal_cache_window(self.original, self.models[budget])
        return self.windows[budget]

    def build(self, kind: str, budget: str | None, context: int):
        """(model, label, cache bytes at `context`, compress hook or None) of a row."""
        if kind == "original":
            per_token, _ = cache_line(self.original)
            return self.original, "original (full cache)", round(per_token * context), None
        model = self.models[budget]
        beta = beta_of(model)
        if kind == "conversion":
            mixer = model.config.mixer
            return model, (f"{mixer['kind']} (window {mixer['window']} + {mixer['sinks']} sinks, state "
                           f"{mixer.get('ssd_state')}), beta {beta:.2f}: `{self.folders[budget]}`"), \
                self.budget_bytes(budget, context), None
        if kind == "window":
            row, window = window_baseline(self.original, model, self.equal_window(budget))
            return row, f"window {window} + {SINKS} sinks on the same groups, beta {beta:.2f}", \
                self._bytes(row, context), None
        if kind in self.scores:
            scores, scorer = self.scores[kind]
            spec = select_heads(HeadScores.load(scores), beta, make_scorer(scorer))
            window = self.equal_window(budget)
            row = convert(self.original, spec, MixerConfig(kind="window", window=window, sinks=SINKS))
            shared = len(set(spec.groups) & {tuple(g) for g in model.config.replacement["groups"]})
            return row, (f"DuoAttention-style: {scorer}-kept groups full, {len(spec.groups)} others window "
                         f"{window} + {SINKS} sinks ({shared} of them replaced by the conversion too)"), \
                self._bytes(row, context), None
        if kind == "streaming":
            window = round(self.budget_bytes(budget, context) / self.full_per_token) - SINKS
            every = ReplacementSpec.from_dict({**model.config.replacement, "groups": [
                [layer, head] for layer in range(model.config.replacement["num_layers"])
                for head in range(model.config.replacement["num_kv_heads"])]})
            row = convert(self.original, every, MixerConfig(kind="window", window=window, sinks=SINKS))
            return row, f"StreamingLLM: every group window {window} + {SINKS} sinks at {context:,} tokens", \
                self._bytes(row, context), None
        if kind.startswith("compose-"):
            press = kind.removeprefix("compose-").removeprefix("global-")
            allocation = "global" if kind.startswith("compose-global-") else "head"
            base = self.models[self.compose_base]
            per_token, state = self.lines[self.compose_base]
            keep = (self.budget_bytes(budget, context) - state) / (per_token * context)
            if self.press is not None:
                self.press.remove()
            self.press = KeptPress(base, press, keep, self.tokenizer, allocation)
            each = "on average, all heads ranked together" if allocation == "global" else "each"
            return base, (f"the beta {beta_of(base):.2f} {base.config.mixer['kind']} conversion with {press} keeping "
                          f"{keep:.3f} of its kept heads' tokens ({each}) at {context:,} tokens"), \
                round(per_token * int(context * keep) + state), self.press
        raise SystemExit(f"error: unknown row kind {kind!r}")

    def _bytes(self, model, context: int) -> int:
        per_token, state = cache_line(model)
        return round(per_token * context + state)


def parse_row(name: str, budgets: dict[str, str], compose_base: str | None) -> tuple[str, str | None]:
    """'window@0.5' -> ('window', '0.5'), checked."""
    if name == "original":
        return "original", None
    kind, _, budget = name.partition("@")
    kinds = ("conversion", "window", "duo", "duo-retrieval", "streaming", *(f"compose-{p}" for p in PRESSES),
             *(f"compose-global-{p}" for p in PRESSES))
    if kind not in kinds or budget not in budgets:
        raise SystemExit(f"error: row {name!r}: rows are original or KIND@BUDGET, KIND one of {', '.join(kinds)}, "
                         f"BUDGET one of --budget's names ({', '.join(budgets) or 'none given'})")
    if kind.startswith("compose-") and compose_base not in budgets:
        raise SystemExit(f"error: row {name!r} needs --compose-base, one of --budget's names")
    return kind, budget


def load_results(path: Path, digest: str, schema: str = SCHEMA, extends: tuple[str, ...] = ()) -> dict:
    """The rows file at `path` (a new one of `schema` if there is none), made on problem set `digest`
    or on one it `extends` (its first contexts: the file then counts as made on `digest`)."""
    if not path.exists():
        return {"schema": schema, "problems": digest, "rows": {}}
    results = json.loads(path.read_text())
    if results.get("problems") != digest and results.get("problems") not in extends:
        raise SystemExit(f"error: {path} was made on problem set {results.get('problems')}, not {digest}; "
                         "use another --out")
    results["problems"] = digest
    return results


def problem_index(problems: dict) -> list[dict]:
    """What the table needs of each problem to score a completion (no token ids)."""
    return [{key: p[key] for key in ("kind", "task", "context", "depth", "answers")} for p in problems["problems"]]


def save(path: Path, problems: dict, name: str, row: dict, budgets: dict) -> None:
    """Write `row` into the results at `path`, read again just before (other runs' rows are kept)."""
    results = load_results(path, problems["digest"])
    results["rows"][name] = row
    results["budgets"] = {**results.get("budgets", {}), **budgets}
    results["index"] = problem_index(problems)
    results["tasks"] = problems["tasks"]
    write_json_atomic(path, results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default=str(ROOT / "runs" / "ruler-problems.json"))
    parser.add_argument("--budget", action="append", default=[], metavar="NAME=DIR", help="a converted model")
    parser.add_argument("--rows", required=True, help="comma-separated rows (module docstring)")
    parser.add_argument("--compose-base", help="the budget whose model the compose-* rows compress")
    parser.add_argument("--ablation-scores", default=str(ALL_RESULTS /
                                                         "smollm2-135m-ablation-2048-scores.json"))
    parser.add_argument("--retrieval-scores", help="scores with `ablation_retrieval` costs, for duo-retrieval rows")
    parser.add_argument("--kinds", default="ruler,passkey", help="which problems to answer")
    parser.add_argument("--out", default=str(RESULTS / "ruler-ours.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    budgets = dict(item.split("=", 1) for item in args.budget if "=" in item)
    if len(budgets) != len(args.budget):
        raise SystemExit(f"error: --budget takes NAME=DIR, got {args.budget}")
    for name in budgets:
        try:
            split_budget(name)
        except TableError as error:
            raise SystemExit(f"error: --{error}") from None
    for folder in budgets.values():
        if not (Path(folder) / "config.json").is_file():
            raise SystemExit(f"error: --budget {folder}: not a model folder (no config.json)")
    rows = [(name, *parse_row(name, budgets, args.compose_base)) for name in args.rows.split(",") if name]
    if args.retrieval_scores is None and any(kind == "duo-retrieval" for _, kind, _ in rows):
        raise SystemExit("error: duo-retrieval rows need --retrieval-scores")
    problems = json.loads(Path(args.problems).read_text())
    kinds = set(args.kinds.split(","))
    chosen = [(i, p) for i, p in enumerate(problems["problems"]) if p["kind"] in kinds]
    out = Path(args.out)
    original, tokenizer, _ = load_model(problems["model"], progress=False)
    builder = Rows(original, tokenizer, budgets, args.ablation_scores, args.compose_base, args.retrieval_scores)
    budget_record = {name: {"model": folder, "beta": beta_of(builder.models[name]),
                            "groups": sorted(map(list, builder.models[name].config.replacement["groups"])),
                            "bytes": {str(c): builder.budget_bytes(name, c)
                                      for c in sorted({p["context"] for _, p in chosen})}}
                     for name, folder in budgets.items()}
    for name, record in load_results(out, problems["digest"]).get("budgets", {}).items():
        new = budget_record.get(name)
        changed = any(record["bytes"].get(c, size) != size for c, size in (new or {}).get("bytes", {}).items())
        if new and (changed or new["groups"] != record.get("groups", new["groups"])):
            raise SystemExit(f"error: --budget {name}={new['model']}: its bytes or groups differ from those of "
                             f"{record['model']}, at which {out}'s rows were made; use another --out")
    eos, stop = set(problems["eos"]), ends_answer(tokenizer)
    for name, kind, budget in rows:
        row = load_results(out, problems["digest"])["rows"].get(name, {"budget": budget, "kind": kind, "labels": {},
                                                                         "cache": {}, "completions": {},
                                                                         "seconds": 0.0})
        todo = [(i, p) for i, p in chosen if str(i) not in row["completions"]]
        print(f"{name}: {len(todo)} of {len(chosen)} problems to answer", flush=True)
        built_for = None
        for index, problem in sorted(todo, key=lambda item: item[1]["context"]):
            if built_for != problem["context"]:
                model, label, size, compress = builder.build(kind, budget, problem["context"])
                row["labels"][str(problem["context"])] = label
                row["cache"][str(problem["context"])] = size
                built_for = problem["context"]
            start = time.time()
            ids = problem["ids"]
            answer = prefilled_answer(model, ids[:problem["question_start"]], ids[problem["question_start"]:],
                                      problem["max_new_tokens"], eos, compress=compress, stop=stop)
            row["seconds"] += time.time() - start
            row["completions"][str(index)] = tokenizer.decode(answer, skip_special_tokens=True)
            save(out, problems, name, row, budget_record)
            print(f"  {problem['task']} @ {problem['context']}: {row['completions'][str(index)]!r} "
                  f"(expected {problem['answers']}) {time.time() - start:.0f}s", flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
