"""The compiled fused window step against its PyTorch oracle: outputs and every state
tensor, token after token, for each tail kind; rows at different positions (an empty
ring, one not yet full, one that wrapped), no sinks, a window of one, bf16; one-line
errors for bad arguments."""

import pytest
import torch

from recurformer.ops.window_step import (
    LinearTail,
    Mamba2Tail,
    MambaTail,
    WindowStepKernel,
    WindowWeights,
    window_step_compiled,
    window_step_naive,
)

TAILS = [None, "mamba2", "mamba", "linear"]


def randn(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


def slot_of(position: int, sinks: int, window: int) -> int:
    return position if position < sinks else sinks + (position - sinks) % window


def window_case(batch, heads, groups, dim, d_in, sinks, window, tail_kind, *, seen, bias=True, shared_rotary=False,
                dtype=torch.float32, tokens=7, seed=0):
    """(window weights, tail, state, [(x, cos, sin)] * tokens). Row b of the state has seen
    `seen[b]` tokens: its ring slots hold their positions as the mixers would write them."""
    g = torch.Generator().manual_seed(seed)
    rows = (heads * dim, groups * dim, groups * dim)
    biases = [randn(g, n, scale=0.5) if bias else None for n in rows]
    window_weights = WindowWeights(randn(g, rows[0], d_in, scale=d_in**-0.5), biases[0], randn(g, rows[1], d_in, scale=d_in**-0.5),
                                   biases[1], randn(g, rows[2], d_in, scale=d_in**-0.5), biases[2], heads, groups, sinks, window)
    slots = sinks + window
    state = {"keys": randn(g, batch, slots, groups, dim), "values": randn(g, batch, slots, groups, dim),
             "index": torch.full((batch, slots), -1, dtype=torch.long)}
    for b, count in enumerate(seen):
        for position in range(count):
            state["index"][b, slot_of(position, sinks, window)] = position
    tail = None
    if tail_kind == "mamba2":
        n_state, width = 5, 4
        channels = groups * dim + groups * n_state + heads * n_state
        in_rows = heads * dim + channels + heads
        tail = Mamba2Tail(randn(g, in_rows, d_in, scale=d_in**-0.5), randn(g, in_rows, scale=0.1) if bias else None,
                          randn(g, channels, width, scale=0.5), randn(g, channels, scale=0.1) if bias else None,
                          randn(g, heads) - 3.0, torch.log(1.0 + 15.0 * torch.rand(heads, generator=g)), randn(g, heads),
                          randn(g, heads * dim), randn(g, heads * dim, heads * dim, scale=(heads * dim) ** -0.5),
                          randn(g, heads * dim, scale=0.1) if bias else None, randn(g, heads * dim, scale=0.3), groups, 1e-5)
        state["conv"], state["ssm"] = randn(g, batch, channels, width), randn(g, batch, heads, dim, n_state)
    elif tail_kind == "mamba":
        inner, n_state, rank, width = 2 * heads * dim + 3, 6, 4, 3
        tail = MambaTail(randn(g, 2 * inner, d_in, scale=d_in**-0.5), randn(g, 2 * inner, scale=0.1) if bias else None,
                         randn(g, inner, width, scale=0.5), randn(g, inner, scale=0.1) if bias else None,
                         randn(g, rank + 2 * n_state, inner, scale=inner**-0.5), randn(g, inner, rank, scale=rank**-0.5),
                         randn(g, inner) - 3.0,
                         torch.log(torch.arange(1.0, n_state + 1)).repeat(inner, 1) + randn(g, inner, n_state, scale=0.1),
                         randn(g, inner), randn(g, heads * dim, inner, scale=inner**-0.5),
                         randn(g, heads * dim, scale=0.1) if bias else None, randn(g, heads * dim, scale=0.3))
        state["conv"], state["ssm"] = randn(g, batch, inner, width), randn(g, batch, inner, n_state)
    elif tail_kind == "linear":
        half = 3
        tail = LinearTail(randn(g, groups, dim, half), randn(g, heads, scale=0.5), randn(g, heads))
        state["tail_kv"] = randn(g, batch, groups, 2 * half, dim)
        state["tail_k"] = torch.rand(batch, groups, 2 * half, generator=g) * 5.0  # sums of features: positive
    rotary_rows = 1 if shared_rotary else batch
    steps = [(randn(g, batch, d_in), randn(g, rotary_rows, dim), randn(g, rotary_rows, dim)) for _ in range(tokens)]
    if dtype != torch.float32:
        window_weights, tail = cast(window_weights, dtype), cast(tail, dtype)
        state = {k: t.to(dtype) if k in ("keys", "values", "conv") else t for k, t in state.items()}
        steps = [tuple(t.to(dtype) for t in step) for step in steps]
    return window_weights, tail, state, steps


def cast(parts, dtype):
    """The dataclass `parts` with its float tensors in `dtype`."""
    if parts is None:
        return None
    fields = {k: v.to(dtype) if isinstance(v, torch.Tensor) else v for k, v in vars(parts).items()}
    return type(parts)(**fields)


def run_steps(step, window, tail, state, steps):
    """Outputs of every token and the final state (the given state is left unchanged)."""
    state = {k: t.clone() for k, t in state.items()}
    outputs = [step(x, cos, sin, state, window, tail) for x, cos, sin in steps]
    return torch.stack(outputs), state


def assert_same_steps(case, tol):
    y_ref, state_ref = run_steps(window_step_naive, *case)
    y, state = run_steps(window_step_compiled, *case)
    assert y.dtype == y_ref.dtype
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=tol)
    assert torch.equal(state["index"], state_ref["index"])
    for name in state:
        assert state[name].dtype == state_ref[name].dtype, name
        torch.testing.assert_close(state[name].float(), state_ref[name].float(), atol=tol, rtol=tol, msg=name)


# (batch, heads, groups, dim, d_in, sinks, window, tokens seen per row): the SmolLM2 layer
# (three groups, run's window), rows at three positions (empty, not full, wrapped), no
# sinks with odd sizes, a window of one, multi-head attention, and a batch of six whose
# projections run four rows at a time and two alone (rows in blocks of 16, odd d_in).
SHAPES = [
    (1, 9, 3, 64, 576, 4, 141, [150]),
    (6, 6, 2, 16, 40, 2, 9, [0, 3, 9, 12, 20, 1]),
    (3, 6, 2, 10, 37, 2, 5, [0, 4, 19]),
    (2, 4, 1, 6, 21, 0, 7, [3, 30]),
    (2, 4, 4, 8, 16, 3, 1, [2, 9]),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("tail", TAILS, ids=str)
def test_compiled_window_step_matches_naive(compiled, shape, tail):
    *sizes, seen = shape
    assert_same_steps(window_case(*sizes, tail, seen=seen), 1e-5)


@pytest.mark.parametrize("tail", TAILS, ids=str)
def test_without_biases_and_with_one_rotary_row_for_all_rows(compiled, tail):
    assert_same_steps(window_case(*SHAPES[2][:-1], tail, seen=SHAPES[2][-1], bias=False, shared_rotary=True), 1e-5)


@pytest.mark.parametrize("tail", TAILS, ids=str)
def test_a_window_longer_than_the_tokens_never_evicts(compiled, tail):
    """The ring never wraps: every token stays in view (window+linear's tail sums stay as they were)."""
    case = window_case(2, 4, 2, 8, 16, 2, 64, tail, seen=[0, 5])
    assert_same_steps(case, 1e-5)
    if tail == "linear":
        _, state = run_steps(window_step_compiled, *case)
        assert torch.equal(state["tail_kv"], case[2]["tail_kv"]) and torch.equal(state["tail_k"], case[2]["tail_k"])


@pytest.mark.parametrize("tail", TAILS, ids=str)
@pytest.mark.parametrize("shape", SHAPES[1:3], ids=str)
def test_compiled_window_step_bf16(compiled, tail, shape):
    """bf16 activations, weights, ring buffer and conv state (fp32 accumulators): the oracle
    rounds the projections, RoPE and the branch to bf16, the compiled step computes in fp32
    and rounds what it stores; they agree to a few bf16 roundings (~4e-3 each)."""
    case = window_case(*shape[:-1], tail, seen=shape[-1], dtype=torch.bfloat16)
    assert_same_steps(case, 6e-2)


def test_the_step_writes_the_state_in_place_and_allocates_only_its_output(compiled):
    window, tail, state, steps = window_case(*SHAPES[2][:-1], "mamba2", seen=SHAPES[2][-1])
    kernel = WindowStepKernel(window, tail, torch.float32)
    addresses = {name: t.data_ptr() for name, t in state.items()}
    before = {name: t.clone() for name, t in state.items()}
    x, cos, sin = steps[0]
    out = kernel(x, cos, sin, state)
    assert {name: t.data_ptr() for name, t in state.items()} == addresses
    assert all(not torch.equal(state[name], before[name]) for name in state)
    assert out.shape == (3, 60) and out.data_ptr() not in addresses.values()


def test_the_kernel_reads_weights_updated_in_place(compiled):
    window, tail, state, steps = window_case(*SHAPES[3][:-1], "linear", seen=SHAPES[3][-1])
    kernel = WindowStepKernel(window, tail, torch.float32)
    x, cos, sin = steps[0]
    first = kernel(x, cos, sin, {k: t.clone() for k, t in state.items()})
    window.v_weight.mul_(2.0)
    tail.gate.add_(1.0)
    again = kernel(x, cos, sin, {k: t.clone() for k, t in state.items()})
    expected = window_step_naive(x, cos, sin, {k: t.clone() for k, t in state.items()}, window, tail)
    assert not torch.allclose(again, first)
    torch.testing.assert_close(again, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (lambda s, a: s.update(index=s["index"].int()), TypeError, "window_step: state index must be torch.int64"),
        (lambda s, a: s.update(keys=s["keys"][:, :-1]), ValueError, r"window_step: state keys must have shape \[3, 7, 2, 10\]"),
        (lambda s, a: s.update(ssm=s["ssm"].transpose(2, 3).contiguous().transpose(2, 3)), ValueError,
         "state ssm must be a contiguous CPU tensor"),
        (lambda s, a: s.pop("conv"), ValueError, "window_step: the state has no tensor 'conv'"),
        (lambda s, a: a.update(x=a["x"][:, :-1]), ValueError, r"window_step: x must be a CPU torch.float32 tensor \[B, 37\]"),
        (lambda s, a: a.update(x=a["x"].double()), TypeError, "window_step: activations must be float32 or bfloat16"),
        (lambda s, a: a.update(cos=a["cos"][:2]), ValueError, r"window_step: cos must be a CPU tensor \[1 or 3, 10\]"),
    ],
    ids=["index-dtype", "keys-shape", "non-contiguous-state", "missing-state", "x-shape", "x-dtype", "cos-rows"],
)
def test_compiled_window_step_rejects_bad_inputs_in_one_line(compiled, change, error, message):
    window, tail, state, steps = window_case(*SHAPES[2][:-1], "mamba2", seen=SHAPES[2][-1])
    x, cos, sin = steps[0]
    arguments = {"x": x, "cos": cos, "sin": sin}
    change(state, arguments)
    with pytest.raises(error, match=message) as raised:
        window_step_compiled(arguments["x"], arguments["cos"], arguments["sin"], state, window, tail)
    assert "\n" not in str(raised.value)


def test_compiled_window_step_rejects_bad_weights_in_one_line(compiled):
    window, tail, state, steps = window_case(*SHAPES[2][:-1], "mamba2", seen=SHAPES[2][-1])
    x, cos, sin = steps[0]
    bad = cast(tail, torch.float32)
    bad = type(bad)(**{**vars(bad), "out_weight": bad.out_weight[:, :-1]})
    with pytest.raises(ValueError, match=r"window_step: out_weight must have shape \[60, 60\] \[H D, width\]"):
        window_step_compiled(x, cos, sin, state, window, bad)
    uneven = WindowWeights(**{**vars(window), "kv_heads": 4})
    with pytest.raises(ValueError, match="window_step: 6 query heads over 4 KV groups"):
        window_step_compiled(x, cos, sin, state, uneven, None)


def test_a_strided_x_gives_the_result_of_its_contiguous_copy(compiled):
    window, tail, state, steps = window_case(*SHAPES[2][:-1], None, seen=SHAPES[2][-1])
    x, cos, sin = steps[0]
    wide = torch.stack([x, x], dim=2)[..., 0]
    assert not wide.is_contiguous() and torch.equal(wide, x)
    expected = window_step_compiled(x, cos, sin, {k: t.clone() for k, t in state.items()}, window, tail)
    assert torch.equal(window_step_compiled(wide, cos, sin, {k: t.clone() for k, t in state.items()}, window, tail), expected)
