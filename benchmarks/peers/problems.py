"""The shared problem set of the equal-cache comparison (docs/results/long-context.md, "Peers at
equal cache bytes"): token ids that every row reads, ours (`benchmarks/peers/ours.py`) and
kvpress's (`peers/kvpress_eval.py`, another virtual environment that cannot import recurformer).

- `passkey`: our `passkey` task's problems (`tasks/passkey.py`: its generator, format `oneshot`,
  a Tiny Shakespeare haystack, seed 0), each tokenized once. `question_start` is the index of
  the question's first token (`"\\n\\nWhat is the pass key? The pass key is"`, with any token
  that straddles the boundary): `ids[:question_start]` is the context a press compresses, the
  rest is the question it does not.
- `loss`: per text, `sequences` pieces of `prefix + scored + 1` tokens cut from the start of the
  text (its documents joined by EOS, as `ppl-by-distance` cuts them, at a stride of
  `prefix + scored`): a row prefills `prefix` tokens, then scores the next-token predictions of
  the `scored` tokens after them.

    python -m benchmarks.peers.problems --out runs/long-context-problems.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from transformers import AutoTokenizer

from recurformer import resolve_model
from recurformer.data import load_documents, tokenize_documents
from recurformer.evaluate.passkey import BEST_FORMAT
from recurformer.files import write_json_atomic
from recurformer.tasks.passkey import FORMATS, generate_passkey

from benchmarks.common import DATA, ROOT, TEXTS

HAYSTACK = DATA / "tinyshakespeare.txt"
SCHEMA = "recurformer-long-context-problems/1"


def passkey_problems(tokenizer, haystack: list[int], contexts: tuple[int, ...], depths: tuple[float, ...],
                     problems: int, seed: int = 0) -> list[dict]:
    """Our passkey task's problems as token ids split into context and question."""
    suffix = FORMATS[BEST_FORMAT].suffix
    out = []
    for context in contexts:
        for case in generate_passkey(tokenizer, haystack, context, depths, problems, seed=seed, fmt=BEST_FORMAT):
            encoded = tokenizer(case.prompt, return_offsets_mapping=True)
            ids, context_chars = encoded["input_ids"], len(case.prompt) - len(suffix)
            # A token that straddles the boundary (the haystack's last newline merged with the
            # question's) belongs to the question: the context is what ends before it.
            question_start = sum(1 for _, end in encoded["offset_mapping"] if end <= context_chars)
            out.append({"context": context, "depth": case.depth, "answer": case.answer, "ids": ids,
                        "question_start": question_start})
    return out


def loss_sequences(tokenizer, path: Path, sequences: int, prefix: int, scored: int) -> list[list[int]]:
    """`sequences` pieces of `prefix + scored + 1` token ids from the start of the text at `path`."""
    ids = tokenize_documents(tokenizer, load_documents([path]))
    stride = prefix + scored
    if len(ids) < (sequences - 1) * stride + stride + 1:
        raise SystemExit(f"error: {path} has {len(ids):,} tokens, too few for {sequences} sequences of {stride + 1}")
    return [ids[i * stride: i * stride + stride + 1] for i in range(sequences)]


def digest(problems: dict) -> str:
    """A short fingerprint of a problem set: results made on different sets are not compared."""
    return hashlib.sha256(json.dumps(problems, sort_keys=True).encode()).hexdigest()[:16]


def parse_list(text: str, kind=int) -> tuple:
    return tuple(kind(part) for part in text.split(","))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "runs" / "long-context-problems.json"))
    parser.add_argument("--model", default="smollm2-135m", help="whose tokenizer makes the ids")
    parser.add_argument("--contexts", default="2048,8000", help="passkey prompt tokens (prompt + 8 answer tokens "
                        "must fit the model's 8,192 positions)")
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--problems", default="2,1", help="passkey problems per depth, one number per context")
    parser.add_argument("--sequences", type=int, default=1, help="loss sequences per text")
    parser.add_argument("--prefix", type=int, default=7168, help="tokens prefilled before the scored ones")
    parser.add_argument("--scored", type=int, default=1024, help="tokens scored with the prefilled cache")
    args = parser.parse_args()
    contexts, counts = parse_list(args.contexts), parse_list(args.problems)
    if len(counts) != len(contexts):
        raise SystemExit(f"error: --problems needs one count per context ({len(contexts)}), got {args.problems!r}")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model, progress=False))
    haystack = tokenize_documents(tokenizer, load_documents([HAYSTACK]))
    depths = parse_list(args.depths, float)
    problems = {
        "schema": SCHEMA, "model": args.model, "format": BEST_FORMAT, "haystack": HAYSTACK.name, "seed": 0,
        "prefix": args.prefix, "scored": args.scored,
        "passkey": [p for c, n in zip(contexts, counts) for p in passkey_problems(tokenizer, haystack, (c,), depths, n)],
        "loss": {name: {"file": path.name, "sequences": loss_sequences(tokenizer, path, args.sequences, args.prefix,
                                                                         args.scored)}
                 for name, path in TEXTS.items()},
    }
    problems["digest"] = digest(problems)
    write_json_atomic(args.out, problems)
    print(f"wrote {args.out} ({len(problems['passkey'])} passkey problems, digest {problems['digest']})")


if __name__ == "__main__":
    main()
