"""The kept heads' compiled decode step against its PyTorch oracle: outputs and the cache
buffers, token after token, over caches of one token to several chunks of the split
attention; batch rows with one or their own rotary rows; bf16; one-line errors."""

import pytest
import torch

from recurformer.ops.attention_step import (
    AttentionStepKernel,
    AttentionWeights,
    attention_step_compiled,
    attention_step_naive,
)


def randn(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


def attention_case(batch, heads, groups, dim, d_in, filled, *, bias=True, shared_rotary=False, dtype=torch.float32,
                   tokens=4, seed=0):
    """(weights, key buffer, value buffer, filled slots, [(x, cos, sin)] * tokens): buffers
    `[B, G, capacity, D]` with `filled` tokens and room for `tokens` more (and some spare)."""
    g = torch.Generator().manual_seed(seed)
    rows = (heads * dim, groups * dim, groups * dim)
    biases = [randn(g, n, scale=0.5) if bias else None for n in rows]
    weights = AttentionWeights(randn(g, rows[0], d_in, scale=d_in**-0.5), biases[0], randn(g, rows[1], d_in, scale=d_in**-0.5),
                               biases[1], randn(g, rows[2], d_in, scale=d_in**-0.5), biases[2], heads, groups, dim**-0.5)
    capacity = filled + tokens + 5
    keys, values = randn(g, batch, groups, capacity, dim), randn(g, batch, groups, capacity, dim)
    rotary_rows = 1 if shared_rotary else batch
    steps = [(randn(g, batch, d_in), randn(g, rotary_rows, dim), randn(g, rotary_rows, dim)) for _ in range(tokens)]
    if dtype != torch.float32:
        weights = AttentionWeights(**{k: v.to(dtype) if isinstance(v, torch.Tensor) else v for k, v in vars(weights).items()})
        keys, values = keys.to(dtype), values.to(dtype)
        steps = [tuple(t.to(dtype) for t in step) for step in steps]
    return weights, keys, values, filled, steps


def run_steps(step, weights, keys, values, filled, steps, starts=None):
    """Outputs of every token, appended after `filled` slots, and the final buffers."""
    keys, values = keys.clone(), values.clone()
    outputs = [step(x, cos, sin, keys, values, filled + 1 + i, weights, starts) for i, (x, cos, sin) in enumerate(steps)]
    return torch.stack(outputs), keys, values


def assert_same_steps(case, tol, starts=None):
    y_ref, keys_ref, values_ref = run_steps(attention_step_naive, *case, starts=starts)
    y, keys, values = run_steps(attention_step_compiled, *case, starts=starts)
    assert y.dtype == y_ref.dtype
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(keys.float(), keys_ref.float(), atol=tol, rtol=tol, equal_nan=True)  # NaN: padding
    torch.testing.assert_close(values.float(), values_ref.float(), atol=tol, rtol=tol, equal_nan=True)


# (batch, heads, groups, dim, d_in, filled): the SmolLM2 layer's kept heads (2 groups) past
# two chunks of the split; an empty cache (the token sees itself); odd sizes across a chunk
# boundary; multi-head attention, one head per group; a batch of six whose projections run
# four rows at a time and two alone (rows in blocks of 16, odd d_in).
SHAPES = [(1, 6, 2, 64, 576, 600), (2, 6, 2, 10, 37, 0), (3, 4, 1, 6, 21, 254), (2, 4, 4, 8, 16, 62),
          (6, 6, 2, 16, 40, 300)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_compiled_attention_step_matches_naive(compiled, shape):
    assert_same_steps(attention_case(*shape), 1e-5)


def test_without_biases_and_with_one_rotary_row_for_all_rows(compiled):
    assert_same_steps(attention_case(*SHAPES[2], bias=False, shared_rotary=True), 1e-5)


def test_left_padded_rows_attend_from_their_first_slot(compiled):
    """Rows start inside the first chunk of the split, on a chunk boundary, past it, and at
    the token itself: the chunks before a row's start are not read (the padding there is
    set to NaN, which would spread to the output if it were)."""
    weights, keys, values, filled, steps = attention_case(4, 6, 2, 16, 24, 600)
    starts = torch.tensor([5, 256, 300, filled])
    for b, start in enumerate(starts.tolist()):
        keys[b, :, :start], values[b, :, :start] = float("nan"), float("nan")
    assert_same_steps((weights, keys, values, filled, steps), 1e-5, starts=starts)
    y, _, _ = run_steps(attention_step_compiled, weights, keys, values, filled, steps, starts=starts)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("shape", [SHAPES[2], SHAPES[4]], ids=str)
def test_compiled_attention_step_bf16(compiled, shape):
    """bf16 activations, weights and buffers: the oracle rounds the projections and RoPE to
    bf16, the compiled step computes in fp32 and rounds what it stores."""
    assert_same_steps(attention_case(*shape, dtype=torch.bfloat16), 6e-2)


def test_only_the_tokens_slot_is_written(compiled):
    weights, keys, values, filled, steps = attention_case(*SHAPES[3])
    before_keys, before_values = keys.clone(), values.clone()
    x, cos, sin = steps[0]
    AttentionStepKernel(weights, torch.float32)(x, cos, sin, keys, values, filled + 1)
    others = [t for t in range(keys.shape[2]) if t != filled]
    assert torch.equal(keys[:, :, others], before_keys[:, :, others])
    assert torch.equal(values[:, :, others], before_values[:, :, others])
    assert not torch.equal(keys[:, :, filled], before_keys[:, :, filled])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(length=a["keys"].shape[2] + 1), r"attention_step: length must be in \[1, 71\], got 72"),
        (lambda a: a.update(length=0), r"attention_step: length must be in \[1, 71\], got 0"),
        (lambda a: a.update(values=a["values"][:, :, :-1].contiguous()), "attention_step: values must be a contiguous CPU"),
        (lambda a: a.update(keys=a["keys"].transpose(2, 3).contiguous().transpose(2, 3)), "attention_step: keys must be a contiguous"),
        (lambda a: a.update(keys=a["keys"].bfloat16()), "attention_step: keys must be a contiguous CPU torch.float32 buffer"),
        (lambda a: a.update(x=a["x"][:, 1:]), r"attention_step: x must be a CPU torch.float32 tensor \[B, 16\]"),
        (lambda a: a.update(sin=a["sin"][:, 1:]), r"attention_step: sin must be a CPU tensor \[1 or 2, 8\]"),
        (lambda a: a.update(starts=torch.tensor([0, a["length"]])), r"attention_step: starts must be .* slots in \[0, 63\)"),
        (lambda a: a.update(starts=torch.tensor([0, 1], dtype=torch.int32)), "attention_step: starts must be a contiguous CPU int64"),
        (lambda a: a.update(starts=torch.tensor([0])), r"attention_step: starts must be a contiguous CPU int64 tensor \[2\]"),
    ],
    ids=["length-past-capacity", "length-zero", "values-shape", "strided-keys", "keys-dtype", "x-shape", "sin-shape",
         "start-past-length", "starts-int32", "starts-shape"],
)
def test_compiled_attention_step_rejects_bad_inputs_in_one_line(compiled, change, message):
    weights, keys, values, filled, steps = attention_case(*SHAPES[3])
    x, cos, sin = steps[0]
    arguments = {"x": x, "cos": cos, "sin": sin, "keys": keys, "values": values, "length": filled + 1}
    change(arguments)
    with pytest.raises(ValueError, match=message) as raised:
        attention_step_compiled(**arguments, weights=weights)
    assert "\n" not in str(raised.value)


def test_uneven_heads_are_refused(compiled):
    weights = attention_case(*SHAPES[3])[0]
    bad = AttentionWeights(**{**vars(weights), "kv_heads": 3})
    with pytest.raises(ValueError, match="attention_step: 4 query heads over 3 KV groups"):
        AttentionStepKernel(bad, torch.float32)
