"""Seeded retrieval tasks: determinism, solvability, layouts and scorers."""

import re

import numpy as np
import pytest
import torch

from recurformer.tasks import (
    generate_hashhop,
    hashhop_tokens,
    mqar_tokens,
    score_hashhop,
    score_hashhop_tokens,
    score_mqar,
)
from recurformer.tasks.hashhop import FIRST_HASH_ID, HASH_ALPHABET, QUERY_ID, SEP_ID
from recurformer.tasks.mqar import PAD_ID

_LINK = re.compile(r"^(\w+) = (\w+)$")
_QUERY = re.compile(r"^Query: (\w+) after (\d+) hops? ->$")


def solve_text(prompt: str) -> list[str]:
    """Independent solver: parse the links and the last query line, follow the links."""
    lines = prompt.splitlines()
    links = dict(m.groups() for m in map(_LINK.match, lines) if m)
    start, hops = _QUERY.match(lines[-1]).groups()
    path = [start]
    for _ in range(int(hops)):
        path.append(links[path[-1]])
    return path


def wrong_hash(h: str) -> str:
    return ("a" if h[0] != "a" else "b") + h[1:]


# ---------------------------------------------------------------- HashHop, text form


@pytest.mark.parametrize("cot", [False, True])
@pytest.mark.parametrize("hops,shots", [(1, 0), (2, 0), (3, 2)])
def test_hashhop_text_is_solvable_by_following_the_links(hops, shots, cot):
    problems = generate_hashhop(6, hops=hops, n_chains=5, cot=cot, seed=3, shots=shots)
    for p in problems:
        links = [m.groups() for m in map(_LINK.match, p.prompt.splitlines()) if m]
        hashes = [h for link in links for h in link]
        assert len(links) == p.n_chains * hops == 5 * hops
        assert len(set(hashes)) == p.n_chains * (hops + 1)  # every hash distinct within the problem
        assert all(len(h) == 8 and set(h) <= set(HASH_ALPHABET) for h in hashes)
        starts = set(dict(links)) - {b for _, b in links}
        assert len(starts) == p.n_chains  # links form exactly n_chains chains
        path = solve_text(p.prompt)
        assert tuple(path) == p.chain
        assert p.answer == (" = ".join(path[1:]) if cot else path[-1])
        assert p.prompt.endswith("->") and p.prompt.count("Query:") == shots + 1


def test_hashhop_text_is_deterministic_per_seed_and_prefix_stable():
    a = generate_hashhop(4, n_chains=6, seed=7)
    assert a == generate_hashhop(4, n_chains=6, seed=7)
    assert a[:2] == generate_hashhop(2, n_chains=6, seed=7)
    b = generate_hashhop(4, n_chains=6, seed=8)
    assert all(x.prompt != y.prompt for x, y in zip(a, b))
    assert len({p.prompt for p in a}) == 4  # problems within a set differ too


def test_hashhop_text_sized_by_target_tokens_fits_the_budget():
    from tiny_models import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    for budget in (300, 700):
        problems = generate_hashhop(3, hops=2, target_tokens=budget, tokenizer=tokenizer, seed=1)
        for i, p in enumerate(problems):
            assert len(tokenizer.encode(p.prompt)) <= budget
            # One more chain of the same problem no longer fits: the search took the largest size.
            bigger = generate_hashhop(i + 1, hops=2, n_chains=p.n_chains + 1, seed=1)[i]
            assert len(tokenizer.encode(bigger.prompt)) > budget
            assert tuple(solve_text(p.prompt)) == p.chain
        assert problems == generate_hashhop(3, hops=2, target_tokens=budget, tokenizer=tokenizer, seed=1)
    with pytest.raises(ValueError, match="target_tokens=20 is too small: the prompt with 1 chain"):
        generate_hashhop(1, target_tokens=20, tokenizer=tokenizer)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), "exactly one of"),
        (dict(n_chains=3, target_tokens=100), "exactly one of"),
        (dict(target_tokens=100), "needs a tokenizer"),
        (dict(n_chains=3, hops=0), "hops must be >= 1"),
        (dict(n_chains=2, shots=2), "n_chains=2 must be >= shots"),
        (dict(n_chains=1000, hash_len=2), "hash_len=2 is too short"),
    ],
)
def test_hashhop_text_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate_hashhop(1, **kwargs)


def test_score_hashhop_exact_match():
    problems = generate_hashhop(4, hops=2, n_chains=4, seed=0)
    truth = [" " + p.answer for p in problems]
    assert score_hashhop(truth, problems) == {"exact_match": 1.0, "per_hop_accuracy": [1.0], "n": 4}
    # The first hash counts; quotes, trailing text and later lines do not matter.
    chatty = [f"'{p.answer}'. Then\nQuery: {p.chain[0]}" for p in problems]
    assert score_hashhop(chatty, problems)["exact_match"] == 1.0
    wrong = [wrong_hash(p.answer) for p in problems]
    assert score_hashhop(wrong, problems) == {"exact_match": 0.0, "per_hop_accuracy": [0.0], "n": 4}
    intermediate = [p.chain[1] for p in problems]  # one hop short
    assert score_hashhop(intermediate, problems)["exact_match"] == 0.0
    assert score_hashhop(["", "   "] + truth[2:], problems)["exact_match"] == 0.5


def test_score_hashhop_cot_per_hop():
    problems = generate_hashhop(4, hops=3, n_chains=4, cot=True, seed=0)
    truth = [" " + p.answer + "\n" for p in problems]
    assert score_hashhop(truth, problems) == {"exact_match": 1.0, "per_hop_accuracy": [1.0, 1.0, 1.0], "n": 4}
    wrong = [" = ".join(wrong_hash(h) for h in p.chain[1:]) for p in problems]
    assert score_hashhop(wrong, problems) == {"exact_match": 0.0, "per_hop_accuracy": [0.0, 0.0, 0.0], "n": 4}
    # Right first hop, wrong second, right final hash.
    mixed = [f"{p.chain[1]} = {wrong_hash(p.chain[2])} = {p.chain[3]}" for p in problems]
    assert score_hashhop(mixed, problems) == {"exact_match": 1.0, "per_hop_accuracy": [1.0, 0.0, 1.0], "n": 4}


def test_score_hashhop_rejects_mismatched_inputs():
    problems = generate_hashhop(2, n_chains=2, seed=0) + generate_hashhop(1, n_chains=2, cot=True, seed=0)
    with pytest.raises(ValueError, match="2 predictions for 3 problems"):
        score_hashhop(["a", "b"], problems)
    with pytest.raises(ValueError, match="mix"):
        score_hashhop(["a", "b", "c"], problems)


# ---------------------------------------------------------------- HashHop, token form


def solve_tokens(ids: list[int], separator: bool, n_links: int) -> dict[int, int]:
    width = 3 if separator else 2
    return {ids[i * width]: ids[i * width + 1] for i in range(n_links)}


@pytest.mark.parametrize("cot", [False, True])
@pytest.mark.parametrize("separator", [False, True])
def test_hashhop_tokens_layout_and_solvability(cot, separator):
    n_chains, hops, queries, vocab = 5, 3, 2, 64
    batch = hashhop_tokens(8, n_chains, hops, vocab, seed=4, cot=cot, num_queries=queries, separator=separator)
    ids, labels = batch["input_ids"], batch["labels"]
    assert set(batch) == {"input_ids", "labels"}
    n_links, answer_len = n_chains * hops, hops if cot else 1
    context = n_links * (3 if separator else 2)
    T = context + queries * (2 + answer_len)
    assert ids.shape == labels.shape == (8, T) and ids.dtype == labels.dtype == torch.int64

    for row, lab in zip(ids.tolist(), labels.tolist()):
        links = solve_tokens(row, separator, n_links)
        hashes = set(links) | set(links.values())
        assert len(hashes) == n_chains * (hops + 1) and min(hashes) >= FIRST_HASH_ID and max(hashes) < vocab
        if separator:
            assert row[2:context:3] == [SEP_ID] * n_links
        asked = []
        for q in range(queries):
            block = row[context + q * (2 + answer_len) : context + (q + 1) * (2 + answer_len)]
            assert block[0] == QUERY_ID
            path = [block[1]]
            for _ in range(hops):
                path.append(links[path[-1]])
            assert block[2:] == (path[1:] if cot else path[-1:])
            asked.append(block[1])
        assert len(set(asked)) == queries
        labeled = [t for t, y in enumerate(lab) if y != -100]
        expected = [context + q * (2 + answer_len) + 2 + j for q in range(queries) for j in range(answer_len)]
        assert labeled == expected and all(lab[t] == row[t] for t in labeled)


def test_hashhop_tokens_deterministic_per_seed():
    a = hashhop_tokens(16, 4, 2, 50, seed=1)
    b = hashhop_tokens(16, 4, 2, 50, seed=1)
    c = hashhop_tokens(16, 4, 2, 50, seed=2)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert not torch.equal(a["input_ids"], c["input_ids"])
    with pytest.raises(ValueError, match="fewer than the 15"):
        hashhop_tokens(1, 5, 2, 17)


def perfect_logits(labels: torch.Tensor, vocab: int) -> torch.Tensor:
    """Logits whose HF-shifted argmax reproduces every label."""
    logits = torch.zeros(*labels.shape, vocab)
    n, t = torch.nonzero(labels[:, 1:] != -100, as_tuple=True)
    logits[n, t, labels[:, 1:][n, t]] = 1.0
    return logits


def test_score_hashhop_tokens_per_hop():
    batch = hashhop_tokens(6, 4, 3, 40, seed=0, cot=True, num_queries=2)
    ids, labels = batch["input_ids"], batch["labels"]
    full = {"accuracy": 1.0, "example_accuracy": 1.0, "n": 6, "per_hop_accuracy": [1.0, 1.0, 1.0]}
    assert score_hashhop_tokens(ids, labels) == full
    assert score_hashhop_tokens(perfect_logits(labels, 40), labels) == full
    # Break hop 2 of every answer, and everything in example 0.
    predictions = ids.clone()
    hop2 = torch.nonzero(labels != -100)[1::3]
    predictions[hop2[:, 0], hop2[:, 1]] = 0
    predictions[0] = 0
    scores = score_hashhop_tokens(predictions, labels)
    assert scores["per_hop_accuracy"] == pytest.approx([5 / 6, 0.0, 5 / 6])
    assert scores["example_accuracy"] == 0.0 and scores["accuracy"] == pytest.approx(10 / 18)
    non_cot = hashhop_tokens(3, 4, 3, 40, seed=0)
    assert score_hashhop_tokens(non_cot["input_ids"], non_cot["labels"])["per_hop_accuracy"] == [1.0]


# ---------------------------------------------------------------- MQAR


def test_mqar_layout_and_recall():
    n, T, V, kv = 64, 128, 200, 8
    batch = mqar_tokens(n, T, kv, V, seed=0)
    ids, labels = batch["input_ids"], batch["labels"]
    assert set(batch) == {"input_ids", "labels"}
    assert ids.shape == labels.shape == (n, T) and ids.dtype == labels.dtype == torch.int64
    assert ids.min() >= 1 and ids.max() < V  # random fillers never use the special id 0
    keys, values = ids[:, 0 : 2 * kv : 2], ids[:, 1 : 2 * kv : 2]
    assert ((keys >= 1) & (keys < V // 2)).all() and ((values >= V // 2) & (values < V)).all()
    for row, lab, k, v in zip(ids, labels, keys.tolist(), values.tolist()):
        assert len(set(k)) == kv and len(set(v)) == kv
        table = dict(zip(k, v))
        labeled = torch.nonzero(lab != -100).flatten().tolist()
        assert len(labeled) == kv and min(labeled) > 2 * kv
        queried = [row[t - 1].item() for t in labeled]
        assert sorted(queried) == sorted(k)  # every key is queried once, and only keys from the kv section
        assert all(lab[t] == row[t] == table[row[t - 1].item()] for t in labeled)
        assert all((t - 2 * kv) % 2 == 1 for t in labeled)  # values sit in the second token of a slot
    assert not (labels[:, : 2 * kv] != -100).any()


def test_mqar_without_random_fillers_pads_with_zero():
    batch = mqar_tokens(4, 40, 4, 50, seed=0, random_non_queries=False)
    ids, labels = batch["input_ids"], batch["labels"]
    queried = (labels != -100).roll(-1, dims=1) | (labels != -100)
    assert (ids[:, 8:][~queried[:, 8:]] == PAD_ID).all()
    assert (ids[:, 8:][queried[:, 8:]] != PAD_ID).all()


def test_mqar_query_gaps_follow_a_power_law():
    kv, T = 4, 8 + 2 * 64
    slot_counts = {}
    for power_a in (0.01, 1.0):
        labels = mqar_tokens(500, T, kv, 100, power_a=power_a, seed=0)["labels"]
        positions = torch.nonzero(labels != -100)[:, 1]
        slots = (positions - 1 - 2 * kv) // 2
        slot_counts[power_a] = np.bincount(slots.numpy(), minlength=64)
    steep, flat = slot_counts[0.01], slot_counts[1.0]
    # Roughly 1/(s+1): short gaps dominate, and counts fall off with the gap.
    assert steep[0] > 4 * steep[8:16].mean() > 4 * steep[48:].mean()
    assert steep[:8].sum() > steep[8:].sum() / 2
    # power_a = 1 is uniform: no slot gets more than twice its share.
    assert flat.max() < 2 * flat.mean() and flat.min() > flat.mean() / 2


def test_mqar_deterministic_per_seed():
    a, b, c = (mqar_tokens(8, 64, 4, 100, seed=s) for s in (5, 5, 6))
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert not torch.equal(a["input_ids"], c["input_ids"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(seq_len=15, num_kv_pairs=4, vocab_size=100), "seq_len=15 is too short"),
        (dict(seq_len=64, num_kv_pairs=4, vocab_size=8), "fewer than num_kv_pairs=4"),
        (dict(seq_len=64, num_kv_pairs=4, vocab_size=100, power_a=0.0), "power_a must be > 0"),
    ],
)
def test_mqar_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mqar_tokens(1, **kwargs)


def test_score_mqar():
    V = 60
    batch = mqar_tokens(10, 48, 6, V, seed=1)
    ids, labels = batch["input_ids"], batch["labels"]
    full = {"accuracy": 1.0, "example_accuracy": 1.0, "n": 10}
    assert score_mqar(ids, labels) == full
    assert score_mqar(perfect_logits(labels, V), labels) == full
    # Logits that are right one position late (no HF shift applied by the caller) score zero.
    unshifted = torch.nn.functional.one_hot(labels.clamp(min=0), V).float()
    assert score_mqar(unshifted, labels)["accuracy"] == 0.0
    wrong = ids.clone()
    wrong[labels != -100] = V // 2 + (wrong[labels != -100] - V // 2 + 1) % (V - V // 2)  # another value
    assert score_mqar(wrong, labels) == {"accuracy": 0.0, "example_accuracy": 0.0, "n": 10}
    one_off = ids.clone()
    first = torch.nonzero(labels[0] != -100)[0, 0]
    one_off[0, first] = 0
    assert score_mqar(one_off, labels) == {"accuracy": pytest.approx(59 / 60), "example_accuracy": 0.9, "n": 10}
    with pytest.raises(ValueError, match="do not match"):
        score_mqar(ids[:, :-1], labels)
