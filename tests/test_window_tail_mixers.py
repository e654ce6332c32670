"""window+mamba, window+mamba2, window+linear: start exactly at the window, and a gate
that opens; window+linear against an explicit [T, T] computation of its formula.

The shared interface (decode, chunked prefill, padding, state size) is checked for these
kinds with the others in test_mixers.py and test_model.py."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import recurformer  # noqa: F401  (registers the Auto classes)
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from recurformer import MixerConfig, WindowRecurrentMixer
from recurformer.config import ConfigError
from recurformer.mixers import ReplacedHeads, WindowLinearMixer, WindowMixer, build_mixer
from recurformer.surgery import convert

from mixer_cases import D_IN, HEADS, positions_for, rope
from tiny_models import open_gates, spec_for, tiny_model

KINDS = ("window+mamba", "window+mamba2", "window+linear")


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
    mixer = build_mixer(D_IN, HEADS, MixerConfig(kind=kind, window=5, sinks=1, **fields))
    q, k, v = torch.randn(4, 8, D_IN), torch.randn(2, 8, D_IN), torch.randn(2, 8, D_IN)
    mixer.init_from_heads(ReplacedHeads(q, k, v, None, None, None, group_size=2))
    return mixer, (q, k, v)


def test_reuse_init_makes_the_tail_a_linear_attention_of_the_same_heads():
    """window+mamba2's branch takes C <- W_Q, B <- W_K, x <- W_V (MambaInLlama's mapping),
    its output projection starts as the identity (never zero), and it outputs something."""
    mixer, (q, k, v) = make("window+mamba2", ssd_state="head_dim")  # N = head_dim: every row copies
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


def contribution(mixer, x, pe):
    """What the tail adds to the window's output."""
    if isinstance(mixer, WindowRecurrentMixer):
        return mixer.gate * mixer.recurrent(x)
    return mixer(x, position_embeddings=pe) - WindowMixer.forward(mixer, x, position_embeddings=pe)


@pytest.mark.parametrize("kind", KINDS)
def test_one_step_from_init_opens_the_gate_and_the_next_one_trains_the_branch(kind):
    mixer, _ = make(kind)
    x, target = torch.randn(2, 30, D_IN), torch.randn(2, 30, HEADS.d_out)
    pe = rope(positions_for(2, 30))
    tail = {id(p) for p in mixer.tail_parameters()}
    before = {n: p.clone() for n, p in mixer.named_parameters()}
    optimizer = torch.optim.AdamW(mixer.tail_parameters(), lr=1e-2)
    with torch.no_grad():
        # window+linear: its own fp32 softmax against the window's kernel, equal to rounding
        scale = max(1.0, WindowMixer.forward(mixer.window if hasattr(mixer, "recurrent") else mixer, x,
                                             position_embeddings=pe).abs().max().item())
        assert contribution(mixer, x, pe).abs().max() <= 1e-5 * scale
    for i in range(2):
        optimizer.zero_grad()
        (mixer(x, position_embeddings=pe) - target).square().mean().backward()
        optimizer.step()
        if i == 0:
            with torch.no_grad():
                assert contribution(mixer, x, pe).abs().mean() > 1e-4
    changed = {n for n, p in mixer.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {n for n, p in mixer.named_parameters() if id(p) in tail}  # every tail parameter, nothing else


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
        assert torch.equal(contribution(mixer, x, None), torch.zeros(2, 30, HEADS.d_out))


def test_tail_parameters_are_the_branch_and_the_gate():
    mixer, _ = make("window+mamba")
    tail = {id(p) for p in mixer.tail_parameters()}
    named = dict(mixer.named_parameters())
    assert {n for n, p in named.items() if id(p) in tail} == {n for n in named if not n.startswith("window.")}


@pytest.mark.parametrize("kind, other", [("window+mamba", "mamba"), ("window+mamba2", "mamba2")])
def test_state_is_the_window_buffer_plus_the_recurrent_state(kind, other):
    fields = dict(window=9, sinks=3, d_state=4, ssd_state=5)
    hybrid = build_mixer(D_IN, HEADS, MixerConfig(kind=kind, **fields))
    window = MixerConfig(kind="window", **fields)
    recurrent = MixerConfig(kind=other, **fields)
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
    with pytest.raises(ConfigError, match=r"mixer kind: unknown 'window\+gru'; choose one of .*window\+mamba, .*window\+mamba2"):
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


def linear_reference(mixer, x, pe):
    """window+linear's formula with explicit [T, T] masks."""
    batch, length, _ = x.shape
    H, G, D, w, sinks = mixer.n_heads, mixer.n_kv_heads, mixer.head_dim, mixer.window, mixer.sinks
    q = mixer.q_proj(x).view(batch, length, H, D).transpose(1, 2)
    k = mixer.k_proj(x).view(batch, length, G, D).transpose(1, 2)
    v = mixer.v_proj(x).view(batch, length, G, D).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *pe)
    k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
    W = mixer.feature_map.repeat_interleave(H // G, dim=0)  # [H, D, F/2]

    def phi(t):
        p = torch.einsum("bhld,hde->bhle", t, W)
        return torch.cat([p.softmax(-1), (-p).softmax(-1)], -1)

    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    in_window = (j <= i) & ((i - j < w) | (j < sinks))
    in_tail = (j >= sinks) & (j <= i - w)
    scores = (q @ k.transpose(-1, -2)) * D**-0.5
    scores = scores.masked_fill(~in_window, float("-inf"))
    e = torch.exp(scores - scores.amax(-1, keepdim=True))
    linear = (phi(q) @ phi(k).transpose(-1, -2)) * in_tail
    alpha = mixer.log_alpha.exp()[:, None, None]
    window = (e @ v) / e.sum(-1, keepdim=True)
    hybrid = (e @ v + alpha * linear @ v) / (e.sum(-1, keepdim=True) + alpha * linear.sum(-1, keepdim=True))
    out = window + mixer.gate[:, None, None] * (hybrid - window)
    return out.transpose(1, 2).reshape(batch, length, H * D)


@pytest.mark.parametrize("window, sinks", [(1, 0), (4, 2), (7, 0), (60, 3)])
def test_window_linear_matches_its_formula(window, sinks):
    torch.manual_seed(0)
    mixer = WindowLinearMixer(D_IN, HEADS, MixerConfig(kind="window+linear", window=window, sinks=sinks, feature_dim=6))
    with torch.no_grad():
        mixer.gate.normal_()
        mixer.log_alpha.normal_()
        mixer.feature_map.normal_()
    x = torch.randn(2, 41, D_IN)
    pe = rope(positions_for(2, 41))
    with torch.no_grad():
        expected = linear_reference(mixer, x, pe)
        state = mixer.allocate_state(2, torch.float32, "cpu")
        steps = [mixer(x[:, :9], state, position_embeddings=tuple(t[:, :9] for t in pe))]
        steps += [mixer.step(x[:, t], state, tuple(p[:, t:t + 1] for p in pe))[:, None] for t in range(9, 41)]
        torch.testing.assert_close(mixer(x, position_embeddings=pe), expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(steps, 1), expected, atol=1e-5, rtol=1e-4)
    # The tail matters here: with the gate closed the output differs.
    with torch.no_grad():
        mixer.gate.zero_()
        assert (linear_reference(mixer, x, pe) - expected).abs().max() > 1e-3 or window >= 41


def test_window_linear_state_holds_the_evicted_tokens_sums():
    torch.manual_seed(0)
    mixer = WindowLinearMixer(D_IN, HEADS, MixerConfig(kind="window+linear", window=5, sinks=2, feature_dim=3))
    state = mixer.allocate_state(1, torch.float32, "cpu")
    assert state["tail_kv"].shape == (1, 2, 6, 8) and state["tail_k"].shape == (1, 2, 6)
    x = torch.randn(1, 12, D_IN)
    with torch.no_grad():
        mixer(x, state, position_embeddings=rope(positions_for(1, 12)))
        k = mixer.k_proj(x).view(1, 12, 2, 8).transpose(1, 2)
        _, k = apply_rotary_pos_emb(k, k, *rope(positions_for(1, 12)))
        evicted = k[:, :, 2:7]  # tokens 2..6 left the window of token 11 (7..11); 0, 1 are sinks
        p = torch.einsum("bgsd,gde->bgse", evicted, mixer.feature_map)
        features = torch.cat([p.softmax(-1), (-p).softmax(-1)], -1)
    torch.testing.assert_close(state["tail_k"], features.sum(2), atol=1e-6, rtol=1e-5)
