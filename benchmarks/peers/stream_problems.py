"""The streams of the fixed-budget comparison (docs/results/streaming.md) as token ids, for
kvpress's own `DecodingPress` (`benchmarks/peers/kvpress_eval.py --stream`, another virtual
environment that cannot import recurformer): the cross-check of our decoding-time presses.

Each stream is our `stream` task's (`tasks/stream.py`, the options of
`benchmarks/long_context/streaming.py`'s rows): its `ids`, and its checks as `units`, each
with the positions whose next-token predictions score it (`evaluate.stream.scored_positions`:
a check is right when every one of them predicts the stream's next id). `kept` gives, at each
budget, the tokens a head keeps after an eviction in our rows of the original (the budget less
one chunk, `evaluate.stream.tokens_kept`), so that kvpress's `target_size` holds the same bytes.

    python -m benchmarks.peers.stream_problems --streams 16
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import asdict, replace

from recurformer.evaluate.stream import StreamOptions, check, make_streams, scored_positions, tokens_kept
from recurformer.errors import RecurformerError
from recurformer.eviction import as_hybrid
from recurformer.files import write_json_atomic
from recurformer.loading import load_model
from recurformer.tasks.stream import DIALS

from benchmarks.common import HELD_OUT, ROOT, budget_fractions

SCHEMA = "recurformer-stream-problems/1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "runs" / "stream-problems.json"))
    parser.add_argument("--model", default="smollm2-135m", help="the original: its tokenizer and cache size")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=3072)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--kinds", default="set,count")
    parser.add_argument("--budgets", default="0.5,0.25")
    parser.add_argument("--dials", type=int, default=DIALS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        options = StreamOptions(data=[str(HELD_OUT)], tokens=args.tokens, streams=args.streams, chunk=args.chunk,
                                kinds=args.kinds, dials=args.dials, seed=args.seed)
        budgets = {budget: replace(options, press="streaming", budget=value)
                   for budget, value in zip(args.budgets.split(","), budget_fractions(args.budgets))}
        model, tokenizer, _ = load_model(args.model, progress=False)
        check(options, model.config.get_text_config())  # the streams within the model's positions
        hybrid = as_hybrid(model)
        kept = {budget: tokens_kept(hybrid, budgeted) for budget, budgeted in budgets.items()}
        streams = [{"ids": list(stream.ids),
                    "units": [{"kind": unit.kind, "distance": unit.distance,
                               "positions": list(scored_positions(tokenizer, unit))} for unit in stream.units]}
                   for stream in make_streams(tokenizer, options)]
    except RecurformerError as error:
        raise SystemExit(f"stream_problems: {error}") from None
    problems = {"schema": SCHEMA, "options": {**asdict(options), "data": [HELD_OUT.name]}, "chunk": args.chunk,
                "kept": kept, "streams": streams}
    problems["digest"] = hashlib.sha256(json.dumps(problems, sort_keys=True).encode()).hexdigest()[:16]
    write_json_atomic(args.out, problems)
    print(f"wrote {args.out}: {len(streams)} streams, {sum(len(s['units']) for s in streams)} checks, kept {kept}")


if __name__ == "__main__":
    main()
