"""HashHop: multi-hop retrieval over random hashes, in text form and in token form.

**[ours]** Our own generator of the task of Magic.dev's HashHop (github.com/magicproduct/
hash-hop), which the RecurFormer paper uses. A problem is `n_chains` chains of random
hashes `h0 -> h1 -> ... -> h_hops`; the context lists every link of every chain, shuffled;
the query names `h0` of one chain and the number of hops; the answer is `h_hops`. Random
hashes carry no meaning, so the only way to answer is to retrieve the links from the
context, `hops` times in a row.

Text form (`generate_hashhop`), for pretrained LLMs through their tokenizer:

```
Each line below links one hash to the next: A = B means A leads to B. Start from the query hash, follow the links for the given number of hops, and answer with the hash you reach.

k3v9q0ab = 7hx2m1pe
p0c4yy7t = k3v9q0ab
...

Query: p0c4yy7t after 2 hops ->
```

The completion is one space and the answer: ` 7hx2m1pe`. With `cot=True` the instruction
asks for every hash on the way and the answer is `h1 = h2 = ... = h_hops` (here
` k3v9q0ab = 7hx2m1pe`). With `shots=k`, k solved queries on other chains of the same
context (`Query: ... -> answer`, one per line) come before the real query. Hashes are
`hash_len` characters from `HASH_ALPHABET` (lowercase letters and digits), distinct within
a problem.

Token form (`hashhop_tokens`), for small models trained from scratch; every hash is one id:

```
a1 b1 SEP a2 b2 SEP ... aP bP SEP | QUERY h0 h_hops | QUERY h0' h_hops' | ...
```

with `cot=True` each query is `QUERY h0 h1 ... h_hops`. Vocabulary: `PAD_ID = 0` (never
emitted; for callers that pad), `SEP_ID = 1`, `QUERY_ID = 2`, hashes
`[FIRST_HASH_ID = 3, vocab_size)`.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from recurformer.tasks.mqar import IGNORE_INDEX, align_predictions, score_mqar

HASH_ALPHABET = string.ascii_lowercase + string.digits

PAD_ID = 0
SEP_ID = 1
QUERY_ID = 2
FIRST_HASH_ID = 3

_INSTRUCTION = (
    "Each line below links one hash to the next: A = B means A leads to B. "
    "Start from the query hash, follow the links for the given number of hops, and "
)
_ASK = {
    False: "answer with the hash you reach.",
    True: "answer with every hash you pass, separated by ' = ', ending with the hash you reach.",
}
# A maximal run of letters and digits: how we read hashes back out of a model's text.
_WORD = re.compile(r"[A-Za-z0-9]+")


@dataclass(frozen=True)
class HashHopProblem:
    """One text-form problem. `prompt + " " + answer` is the full solved text.

    `chain` is the queried chain `(h0, h1, ..., h_hops)`; `answer` is `h_hops`, or with
    `cot` the string `"h1 = h2 = ... = h_hops"`.
    """

    prompt: str
    answer: str
    chain: tuple[str, ...]
    hops: int
    n_chains: int
    cot: bool


def generate_hashhop(
    num_problems: int,
    hops: int = 2,
    n_chains: int | None = None,
    target_tokens: int | None = None,
    tokenizer=None,
    hash_len: int = 8,
    cot: bool = False,
    seed: int = 0,
    shots: int = 0,
) -> list[HashHopProblem]:
    """`num_problems` text-form HashHop problems; same arguments -> same problems anywhere.

    Size each problem by exactly one of `n_chains`, or `target_tokens` with a Hugging Face
    `tokenizer`: then each problem gets the largest `n_chains` whose prompt (as
    `tokenizer.encode(prompt)` counts it, special tokens included, answer excluded) fits in
    `target_tokens`. The search doubles `n_chains` until the prompt no longer fits, then
    bisects; it is deterministic, and the result fits while one more chain would not.

    Problem `i` draws from `random.Random(f"hashhop:{seed}:{i}")` (string seeds are hashed
    with SHA-512, identical on every platform), so the first k problems of a larger set
    are the same k problems.
    """
    if (n_chains is None) == (target_tokens is None):
        raise ValueError("give exactly one of n_chains and target_tokens")
    if target_tokens is not None and tokenizer is None:
        raise ValueError("target_tokens needs a tokenizer to count the prompt's tokens")
    if num_problems < 0:
        raise ValueError(f"num_problems must be >= 0, got {num_problems}")
    if hops < 1:
        raise ValueError(f"hops must be >= 1, got {hops}")
    if hash_len < 1:
        raise ValueError(f"hash_len must be >= 1, got {hash_len}")
    if shots < 0:
        raise ValueError(f"shots must be >= 0, got {shots}")
    min_chains = shots + 1
    if n_chains is not None and n_chains < min_chains:
        raise ValueError(f"n_chains={n_chains} must be >= shots + 1 = {min_chains}")

    def make(index: int, chains: int) -> HashHopProblem:
        return _make_problem(f"hashhop:{seed}:{index}", chains, hops, hash_len, cot, shots)

    if n_chains is not None:
        return [make(i, n_chains) for i in range(num_problems)]

    def n_tokens(index: int, chains: int) -> int:
        return len(tokenizer.encode(make(index, chains).prompt))

    def fits(index: int, chains: int) -> bool:
        return n_tokens(index, chains) <= target_tokens

    problems = []
    for i in range(num_problems):
        if not fits(i, min_chains):
            raise ValueError(
                f"target_tokens={target_tokens} is too small: the prompt with {min_chains} chain(s) of "
                f"{hops} hop(s) has {n_tokens(i, min_chains)} tokens"
            )
        lo, hi = min_chains, 2 * min_chains  # invariant: fits(lo); hi unknown until bracketed
        while fits(i, hi):
            lo, hi = hi, 2 * hi
        while hi - lo > 1:  # now fits(lo) and not fits(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(i, mid) else (lo, mid)
        problems.append(make(i, lo))
    return problems


def _make_problem(rng_seed: str, n_chains: int, hops: int, hash_len: int, cot: bool, shots: int) -> HashHopProblem:
    n_hashes = n_chains * (hops + 1)
    if len(HASH_ALPHABET) ** hash_len < 2 * n_hashes:
        raise ValueError(f"hash_len={hash_len} is too short for {n_hashes} distinct hashes")
    rng = random.Random(rng_seed)
    seen: set[str] = set()
    # Chains are drawn first, so the first k chains do not depend on n_chains: prompts grow
    # almost monotonically with n_chains, which keeps the target_tokens search meaningful.
    chains = [tuple(_new_hash(rng, hash_len, seen) for _ in range(hops + 1)) for _ in range(n_chains)]
    lines = [f"{a} = {b}" for chain in chains for a, b in zip(chain, chain[1:])]
    rng.shuffle(lines)
    query, *examples = (chains[c] for c in rng.sample(range(n_chains), shots + 1))

    hop_word = "hop" if hops == 1 else "hops"
    parts = [_INSTRUCTION + _ASK[cot], "", *lines, ""]
    parts += [f"Query: {c[0]} after {hops} {hop_word} -> {_answer(c, cot)}" for c in examples]
    parts.append(f"Query: {query[0]} after {hops} {hop_word} ->")
    return HashHopProblem("\n".join(parts), _answer(query, cot), query, hops, n_chains, cot)


def _new_hash(rng: random.Random, hash_len: int, seen: set[str]) -> str:
    while True:
        h = "".join(rng.choices(HASH_ALPHABET, k=hash_len))
        if h not in seen:
            seen.add(h)
            return h


def _answer(chain: tuple[str, ...], cot: bool) -> str:
    return " = ".join(chain[1:]) if cot else chain[-1]


def score_hashhop(predictions: list[str], problems: list[HashHopProblem]) -> dict[str, float | int | list[float]]:
    """Score model completions (the text generated after each prompt) against `problems`.

    A prediction is read on its first non-empty line only (models often go on with another
    `Query:` line); its hashes are the maximal runs of letters and digits on that line.
    - `exact_match`: without cot, the first hash equals `h_hops`; with cot, the last hash on
      the line equals `h_hops` (a model that skips or repeats an intermediate hash can still
      be right at the end; `per_hop_accuracy` shows the path).
    - `per_hop_accuracy[j]`: fraction of problems whose (j+1)-th answer hash is right, in
      position. With cot there is one entry per hop (`h1` ... `h_hops`); without cot the
      only answer hash is `h_hops`, so the list is `[exact_match]`.
    - `n`: number of problems.
    All problems must share `hops` and `cot`.
    """
    if len(predictions) != len(problems):
        raise ValueError(f"{len(predictions)} predictions for {len(problems)} problems")
    if not problems:
        raise ValueError("no problems to score")
    kinds = {(p.hops, p.cot) for p in problems}
    if len(kinds) > 1:
        raise ValueError(f"problems mix (hops, cot) settings {sorted(kinds)}: score each setting separately")
    (hops, cot), = kinds
    n_answer = hops if cot else 1

    exact = 0
    per_hop = [0] * n_answer
    for prediction, problem in zip(predictions, problems):
        lines = [line for line in prediction.strip().splitlines() if line.strip()]
        words = _WORD.findall(lines[0]) if lines else []
        expected = problem.chain[1:] if cot else problem.chain[-1:]
        if words and words[-1 if cot else 0] == problem.chain[-1]:
            exact += 1
        for j, h in enumerate(expected):
            per_hop[j] += j < len(words) and words[j] == h
    n = len(problems)
    return {"exact_match": exact / n, "per_hop_accuracy": [c / n for c in per_hop], "n": n}


def hashhop_tokens(
    num_examples: int,
    n_chains: int,
    hops: int,
    vocab_size: int,
    seed: int = 0,
    cot: bool = False,
    num_queries: int = 1,
    separator: bool = True,
) -> dict[str, Tensor]:
    """Token-form HashHop: `{"input_ids": [N, T], "labels": [N, T]}`, int64, fixed T.

    Each example draws `n_chains * (hops + 1)` distinct hash ids from
    `[FIRST_HASH_ID, vocab_size)`, lists the `P = n_chains * hops` links as `a b` (`a b SEP`
    with `separator`) in random order, then asks `num_queries` distinct chains, each as
    `QUERY h0` followed by the answer: `h_hops`, or `h1 ... h_hops` with `cot`.
    `T = P * (2 + separator) + num_queries * (2 + (hops if cot else 1))`.

    Labels follow the Hugging Face causal-LM convention (the model shifts them):
    `labels == input_ids` at answer positions, `-100` elsewhere. The dict holds exactly
    the keys a HF causal LM accepts, so `model(**batch)` returns the loss on the answers.
    Same arguments -> same tensors (`numpy.random.default_rng(seed)`).
    """
    if num_examples < 0:
        raise ValueError(f"num_examples must be >= 0, got {num_examples}")
    if hops < 1:
        raise ValueError(f"hops must be >= 1, got {hops}")
    if not 1 <= num_queries <= n_chains:
        raise ValueError(f"num_queries must be in [1, n_chains={n_chains}], got {num_queries}")
    n_hashes = n_chains * (hops + 1)
    if n_hashes > vocab_size - FIRST_HASH_ID:
        raise ValueError(
            f"vocab_size={vocab_size} has {vocab_size - FIRST_HASH_ID} hash ids "
            f"([{FIRST_HASH_ID}, {vocab_size})), fewer than the {n_hashes} an example needs"
        )
    rng = np.random.default_rng(seed)
    N, P = num_examples, n_chains * hops

    hashes = np.empty((N, n_hashes), dtype=np.int64)
    for r in range(N):
        hashes[r] = rng.choice(vocab_size - FIRST_HASH_ID, size=n_hashes, replace=False) + FIRST_HASH_ID
    chains = hashes.reshape(N, n_chains, hops + 1)

    order = rng.permuted(np.tile(np.arange(P), (N, 1)), axis=1)  # [N, P] shuffled links
    src = np.take_along_axis(chains[:, :, :-1].reshape(N, P), order, axis=1)
    dst = np.take_along_axis(chains[:, :, 1:].reshape(N, P), order, axis=1)
    columns = [src, dst] + ([np.full_like(src, SEP_ID)] if separator else [])
    context = np.stack(columns, axis=2).reshape(N, -1)  # [N, P * (2 + separator)]

    picked = rng.permuted(np.tile(np.arange(n_chains), (N, 1)), axis=1)[:, :num_queries]
    asked = np.take_along_axis(chains, picked[:, :, None], axis=1)  # [N, Q, hops + 1]
    answers = asked[:, :, 1:] if cot else asked[:, :, -1:]  # [N, Q, A]
    query = np.concatenate([np.full_like(asked[:, :, :1], QUERY_ID), asked[:, :, :1], answers], axis=2)

    input_ids = np.concatenate([context, query.reshape(N, -1)], axis=1)
    is_answer = np.zeros(query.shape[1:], dtype=bool)  # [Q, 2 + A]
    is_answer[:, 2:] = True
    is_answer = np.concatenate([np.zeros(context.shape[1], dtype=bool), is_answer.reshape(-1)])
    labels = np.where(is_answer, input_ids, IGNORE_INDEX)
    return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels.astype(np.int64))}


def score_hashhop_tokens(logits_or_predictions: Tensor, labels: Tensor) -> dict[str, float | int | list[float]]:
    """Score the token form: `logits [N, T, V]` (HF shift applied) or ids `[N, T]` aligned
    with `labels` (see `mqar.align_predictions`).

    Returns `accuracy` (labeled tokens right), `example_accuracy` (examples with every
    answer token right), `per_hop_accuracy` and `n` (examples). Each answer is a run of
    consecutive labeled positions; `per_hop_accuracy[j]` is the accuracy at the j-th
    position of every run: with cot, hop j+1; without cot one entry, the final hash.
    """
    scores = score_mqar(logits_or_predictions, labels)  # checks shapes and that something is labeled
    mask = labels != IGNORE_INDEX
    correct = (align_predictions(logits_or_predictions, labels) == labels) & mask
    # Offset of each labeled position within its run: distance to the last unlabeled one.
    index = torch.arange(labels.shape[1]).expand_as(labels)
    last_gap = torch.where(mask, -1, index).cummax(dim=1).values
    offset = index - last_gap - 1
    n_positions = int(offset[mask].max()) + 1
    scores["per_hop_accuracy"] = [
        correct[offset == j].sum().item() / (mask & (offset == j)).sum().item() for j in range(n_positions)
    ]
    return scores
