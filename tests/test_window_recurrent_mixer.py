"""window+mamba / window+mamba2: start exactly at the window, and a gate that opens.

The shared interface (decode, chunked prefill, padding, state size) is checked for these
kinds with the others in test_mixers.py and test_model.py."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import recurformer  # noqa: F401  (registers the Auto classes)
from recurformer import MixerConfig, WindowRecurrentMixer
from recurformer.config import ConfigError
from recurformer.mixers import ReplacedHeads
from recurformer.surgery import convert

from mixer_cases import D_IN, HEADS, positions_for, rope
from tiny_models import open_gates, spec_for, tiny_model

KINDS = ("window+mamba", "window+mamba2")


def logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("beta", [0.5, 1.0])
def test_reuse_init_gives_the_window_mixers_logits(arch, kind, beta):
    model = tiny_model(arch)
    spec = spec_for(model, beta)
    window = convert(model, spec, MixerConfig(kind="window", window=8, sinks=2))
    hybrid = convert(model, spec, MixerConfig(kind=kind, window=8, sinks=2))
    ids = torch.randint(0, 97, (2, 50))
    expected = logits(window, ids)
    assert (logits(hybrid, ids) - expected).abs().max() <= 1e-5
    # The comparison has teeth: the window loses something here, and an open gate changes the logits.
    assert (expected - logits(model, ids)).abs().max() > 1e-2
    assert (logits(open_gates(hybrid), ids) - expected).abs().max() > 1e-2


def make(kind, **fields):
    torch.manual_seed(0)
    mixer = WindowRecurrentMixer(D_IN, HEADS, MixerConfig(kind=kind, window=5, sinks=1, **fields))
    q, k, v = torch.randn(4, 8, D_IN), torch.randn(2, 8, D_IN), torch.randn(2, 8, D_IN)
    mixer.init_from_heads(ReplacedHeads(q, k, v, None, None, None, group_size=2))
    return mixer, (q, k, v)


def test_reuse_init_makes_the_tail_a_linear_attention_of_the_same_heads():
    """window+mamba2's branch takes C <- W_Q, B <- W_K, x <- W_V (MambaInLlama's mapping),
    its output projection starts as the identity (never zero), and it outputs something."""
    mixer, (q, k, v) = make("window+mamba2")
    branch = mixer.recurrent
    H, G, P, N = 4, 2, 8, 8
    rows = branch.in_proj.weight
    first_x, first_B = H * P, H * P + G * P
    first_C = first_B + G * N
    assert torch.equal(rows[first_x:first_B], v.reshape(-1, D_IN))
    assert torch.equal(rows[first_B:first_C], k.reshape(-1, D_IN))
    assert torch.equal(rows[first_C:first_C + H * N], q.reshape(-1, D_IN))
    assert torch.equal(branch.out_proj.weight, torch.eye(H * P))
    assert torch.equal(mixer.gate, torch.zeros(H * P))
    x = torch.randn(2, 30, D_IN)
    assert branch(x).abs().mean() > 1e-3


def contribution(mixer, x):
    return mixer.gate * mixer.recurrent(x)


@pytest.mark.parametrize("kind", KINDS)
def test_one_step_from_init_opens_the_gate_and_the_next_one_trains_the_branch(kind):
    mixer, _ = make(kind)
    x, target = torch.randn(2, 30, D_IN), torch.randn(2, 30, HEADS.d_out)
    pe = rope(positions_for(2, 30))
    tail = mixer.tail_parameters()
    window_before = {n: p.clone() for n, p in mixer.window.named_parameters()}
    branch_before = {n: p.clone() for n, p in mixer.recurrent.named_parameters()}
    optimizer = torch.optim.AdamW(tail, lr=1e-2)
    with torch.no_grad():
        assert torch.equal(contribution(mixer, x), torch.zeros(2, 30, HEADS.d_out))
    for _ in range(2):
        optimizer.zero_grad()
        (mixer(x, position_embeddings=pe) - target).square().mean().backward()
        optimizer.step()
        if _ == 0:
            with torch.no_grad():
                assert contribution(mixer, x).abs().mean() > 1e-4
    changed = [n for n, p in mixer.recurrent.named_parameters() if not torch.equal(p, branch_before[n])]
    assert "in_proj.weight" in changed and "out_proj.weight" in changed
    assert all(torch.equal(p, window_before[n]) for n, p in mixer.window.named_parameters())


def test_a_zero_gate_in_front_of_a_zero_projection_would_be_stuck():
    """The design the module docstring warns against, so the test above can fail: with the
    branch's output projection also at zero, no step ever moves either of them."""
    mixer, _ = make("window+mamba2")
    with torch.no_grad():
        mixer.recurrent.out_proj.weight.zero_()
    x, target = torch.randn(2, 30, D_IN), torch.randn(2, 30, HEADS.d_out)
    optimizer = torch.optim.AdamW(mixer.tail_parameters(), lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        (mixer(x, position_embeddings=rope(positions_for(2, 30))) - target).square().mean().backward()
        optimizer.step()
    with torch.no_grad():
        assert torch.equal(contribution(mixer, x), torch.zeros(2, 30, HEADS.d_out))


def test_tail_parameters_are_the_branch_and_the_gate():
    mixer, _ = make("window+mamba")
    tail = {id(p) for p in mixer.tail_parameters()}
    named = dict(mixer.named_parameters())
    assert {n for n, p in named.items() if id(p) in tail} == {n for n in named if not n.startswith("window.")}


@pytest.mark.parametrize("kind, other", [("window+mamba", "mamba"), ("window+mamba2", "mamba2")])
def test_state_is_the_window_buffer_plus_the_recurrent_state(kind, other):
    fields = dict(window=9, sinks=3, d_state=4, ssd_state=5)
    hybrid = WindowRecurrentMixer(D_IN, HEADS, MixerConfig(kind=kind, **fields))
    window = MixerConfig(kind="window", **fields)
    recurrent = MixerConfig(kind=other, **fields)
    from recurformer.mixers import build_mixer

    state = hybrid.allocate_state(3, torch.float32, "cpu")
    expected = {f"window.{k}": t.shape for k, t in build_mixer(D_IN, HEADS, window).allocate_state(3, torch.float32, "cpu").items()}
    expected |= {f"recurrent.{k}": t.shape for k, t in build_mixer(D_IN, HEADS, recurrent).allocate_state(3, torch.float32, "cpu").items()}
    assert {k: t.shape for k, t in state.items()} == expected


@pytest.mark.parametrize("kind", KINDS)
def test_save_and_load_keeps_the_kind_and_the_gate(kind, tmp_path):
    model = tiny_model("qwen2")
    converted = open_gates(convert(model, spec_for(model, 0.5), MixerConfig(kind=kind, window=6, sinks=1)))
    converted.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.mixer_config().kind == kind
    gates = [n for n in loaded.state_dict() if n.endswith(".mixer.gate")]
    assert gates and all(torch.equal(loaded.state_dict()[n], converted.state_dict()[n]) for n in gates)
    ids = torch.randint(0, 97, (2, 30))
    assert torch.equal(logits(loaded, ids), logits(converted, ids))


def test_unknown_kind_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"mixer kind: unknown 'window\+gru'; choose one of .*window\+mamba, window\+mamba2"):
        MixerConfig(kind="window+gru")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("field, value", [("window", 0), ("sinks", -1)])
def test_bad_window_or_sinks_name_the_field(kind, field, value):
    with pytest.raises(ConfigError, match=f"^{field} must be"):
        MixerConfig(kind=kind, **{field: value})


@pytest.mark.parametrize("kind", ("window",) + KINDS)
def test_a_window_beyond_the_position_limit_is_refused(kind):
    model = tiny_model("llama")  # 512 positions
    with pytest.raises(ConfigError, match=r"^window 513 is larger than the model's position limit \(512 positions\)$"):
        convert(model, spec_for(model, 0.5), MixerConfig(kind=kind, window=513))
    convert(model, spec_for(model, 0.5), MixerConfig(kind=kind, window=512))
