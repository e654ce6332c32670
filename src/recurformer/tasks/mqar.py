"""Multi-query associative recall (MQAR), token form, after the Zoology benchmark.

Zoology (Arora et al. 2023, "Zoology: Measuring and improving recall in efficient language
models") tests whether a sequence model can look up a value by its key. Our generator
follows their description; the code is our own.

Layout of one example, `seq_len` tokens, `n = num_kv_pairs`:

```
k1 v1 k2 v2 ... kn vn | slot 0 | slot 1 | ... | slot S-1 | (one filler if odd)
```

- The first `2n` tokens list the key-value pairs. Keys are distinct ids from the lower half
  of the vocabulary, `[1, vocab_size // 2)`; values are distinct ids from the upper half,
  `[vocab_size // 2, vocab_size)`. Id `0` (`PAD_ID`) is the only special id.
- The rest is cut into `S = (seq_len - 2n) // 2` two-token slots. Each key is queried once,
  in its own slot: `k v` with the key's value. The slot is drawn with probability
  proportional to `power_a * (s + 1) ** (power_a - 1)` for slot index `s` (Zoology's
  power law over the gap since the key-value section: real text repeats a bigram soon
  more often than late). Slots are drawn without replacement, one key after the other in
  the order of the key-value section, as Zoology does, so earlier keys tend to get the
  shorter gaps. We sample with the Gumbel-top-k trick, which gives exactly that
  sequential-without-replacement distribution in one vectorized step.
- Every other position holds a random filler id from `[1, vocab_size)` when
  `random_non_queries` (Zoology's default), else `PAD_ID`.

**[ours] Labels use the Hugging Face causal-LM convention**: `labels[:, t] ==
input_ids[:, t]` at the value position of every query slot and `-100` elsewhere; the model
shifts internally, so it learns to predict the value from the position of the queried key.
(Zoology stores pre-shifted labels and leaves a filler after the query key; we place the
value there so `model(**batch)` trains on exactly the answers.)

Scoring (`score_mqar`) takes either a model's raw logits `[N, T, V]` (the HF shift is
applied: the prediction for `labels[:, t]` is `logits[:, t - 1].argmax()`) or predicted ids
`[N, T]` already aligned with `labels` (`predictions[:, t]` is the guess for
`labels[:, t]`). The rank of the tensor says which one it is.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

PAD_ID = 0
IGNORE_INDEX = -100


def mqar_tokens(
    num_examples: int,
    seq_len: int,
    num_kv_pairs: int,
    vocab_size: int,
    power_a: float = 0.01,
    seed: int = 0,
    random_non_queries: bool = True,
) -> dict[str, Tensor]:
    """`num_examples` MQAR sequences: `{"input_ids": [N, T], "labels": [N, T]}`, int64.

    Same arguments -> same tensors on every machine (`numpy.random.default_rng(seed)`).
    The dict holds exactly the keys a Hugging Face causal LM accepts, so `model(**batch)`
    returns the loss on the answers.
    """
    _check_mqar_args(num_examples, seq_len, num_kv_pairs, vocab_size, power_a)
    rng = np.random.default_rng(seed)
    n, half = num_kv_pairs, vocab_size // 2
    keys = _distinct_rows(rng, num_examples, low=1, high=half, size=n)  # [N, n]
    values = _distinct_rows(rng, num_examples, low=half, high=vocab_size, size=n)  # [N, n]

    context = 2 * n
    n_slots = (seq_len - context) // 2
    log_weight = (power_a - 1.0) * np.log(np.arange(1, n_slots + 1))  # constant power_a factor drops out
    perturbed = log_weight + rng.gumbel(size=(num_examples, n_slots))
    slots = np.argsort(-perturbed, axis=1, kind="stable")[:, :n]  # [N, n]; slots[:, i] is key i's slot

    if random_non_queries:
        ids = rng.integers(1, vocab_size, size=(num_examples, seq_len))
    else:
        ids = np.full((num_examples, seq_len), PAD_ID, dtype=np.int64)
    ids[:, 0:context:2] = keys
    ids[:, 1:context:2] = values
    rows = np.arange(num_examples)[:, None]
    key_pos = context + 2 * slots
    ids[rows, key_pos] = keys
    ids[rows, key_pos + 1] = values

    labels = np.full_like(ids, IGNORE_INDEX)
    labels[rows, key_pos + 1] = values
    return {"input_ids": torch.from_numpy(ids.astype(np.int64)), "labels": torch.from_numpy(labels.astype(np.int64))}


def score_mqar(logits_or_predictions: Tensor, labels: Tensor) -> dict[str, float | int]:
    """Accuracy on the labeled positions of `labels` [N, T] (HF convention, `-100` = ignore).

    `logits_or_predictions` is either logits `[N, T, V]` as a causal LM returns them (we
    apply the HF shift) or predicted ids `[N, T]` already aligned with `labels`. Returns
    `{"accuracy": fraction of labeled tokens right, "example_accuracy": fraction of
    examples with every labeled token right, "n": number of examples}`.
    Works for any labels in this convention, e.g. those of `hashhop_tokens`.
    """
    predictions = align_predictions(logits_or_predictions, labels)
    mask = labels != IGNORE_INDEX
    if not mask.any():
        raise ValueError("labels has no labeled position (all -100): nothing to score")
    correct = (predictions == labels) & mask
    return {
        "accuracy": correct.sum().item() / mask.sum().item(),
        "example_accuracy": (correct | ~mask).all(dim=1).sum().item() / labels.shape[0],
        "n": labels.shape[0],
    }


def align_predictions(logits_or_predictions: Tensor, labels: Tensor) -> Tensor:
    """Predicted ids `[N, T]` aligned with `labels` `[N, T]`.

    Logits `[N, T, V]` get the HF shift: the guess for `labels[:, t]` is
    `logits[:, t - 1].argmax(-1)`; position 0 has no guess and gets `-1`, which never
    equals a label. Ids `[N, T]` are returned unchanged.
    """
    if labels.dim() != 2:
        raise ValueError(f"labels must be [N, T], got shape {tuple(labels.shape)}")
    x = logits_or_predictions
    if x.dim() == 3:
        if x.shape[:2] != labels.shape:
            raise ValueError(f"logits {tuple(x.shape)} do not match labels {tuple(labels.shape)}")
        shifted = x[:, :-1].argmax(dim=-1)
        return torch.cat([torch.full_like(shifted[:, :1], -1), shifted], dim=1)
    if x.dim() == 2:
        if x.shape != labels.shape:
            raise ValueError(f"predictions {tuple(x.shape)} do not match labels {tuple(labels.shape)}")
        return x
    raise ValueError(f"expected logits [N, T, V] or predictions [N, T], got shape {tuple(x.shape)}")


def _distinct_rows(rng: np.random.Generator, rows: int, low: int, high: int, size: int) -> np.ndarray:
    """[rows, size] ids from `[low, high)`, distinct within each row."""
    out = np.empty((rows, size), dtype=np.int64)
    for r in range(rows):
        out[r] = rng.choice(high - low, size=size, replace=False) + low
    return out


def _check_mqar_args(num_examples: int, seq_len: int, num_kv_pairs: int, vocab_size: int, power_a: float) -> None:
    if num_examples < 0:
        raise ValueError(f"num_examples must be >= 0, got {num_examples}")
    if num_kv_pairs < 1:
        raise ValueError(f"num_kv_pairs must be >= 1, got {num_kv_pairs}")
    if seq_len < 4 * num_kv_pairs:
        raise ValueError(
            f"seq_len={seq_len} is too short for num_kv_pairs={num_kv_pairs}: "
            f"needs 2 tokens per pair plus 2 per query, at least {4 * num_kv_pairs}"
        )
    n_keys = vocab_size // 2 - 1
    if num_kv_pairs > n_keys:
        raise ValueError(
            f"vocab_size={vocab_size} has only {n_keys} key ids ([1, {vocab_size // 2})), "
            f"fewer than num_kv_pairs={num_kv_pairs}"
        )
    if not power_a > 0:
        raise ValueError(f"power_a must be > 0, got {power_a}")
