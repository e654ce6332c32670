"""convert(): turn a pretrained Llama/Qwen2/Mistral causal LM into a RecurFormer model.

Declarative and checked: for every layer a `LayerPlan` says which rows of q/k/v are kept and
in which order `o_proj` reads its input columns; shapes are asserted before anything is
copied, and errors name the layer and head. All other weights are copied unchanged.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers.initialization import no_init_weights

from .config import ConfigError, ReplacementSpec
from .errors import RecurformerError
from .hub import source_name
from .mixers import Mixer, MixerConfig, ReplacedHeads, resolve_for_model
from .modeling import RecurFormerConfig, RecurFormerForCausalLM, check_architecture

INITS = ("reuse", "random")


class SurgeryError(RecurformerError, ValueError):
    """A weight does not have the shape the plan expects."""


@dataclass(frozen=True)
class LayerPlan:
    """Row and column indices for one layer.

    q rows `[kept_q * D]`, k/v rows `[kept_kv * D]`; `o_columns` `[H * D]` lists the original
    input columns of `o_proj` in the new order (kept query heads, then replaced ones).
    """

    layer: int
    kept_kv: list[int]
    replaced_kv: list[int]
    q_rows: Tensor
    kv_rows: Tensor
    replaced_q_rows: Tensor
    replaced_kv_rows: Tensor
    o_columns: Tensor

    @classmethod
    def build(cls, layer: int, spec: ReplacementSpec, group_size: int, head_dim: int) -> "LayerPlan":
        kept, replaced = spec.kept_heads(layer), spec.replaced_heads(layer)

        def q_rows(kv_heads: list[int]) -> Tensor:
            heads = [g * group_size + i for g in kv_heads for i in range(group_size)]
            return _rows(heads, head_dim)

        return cls(
            layer, kept, replaced,
            q_rows=q_rows(kept), kv_rows=_rows(kept, head_dim),
            replaced_q_rows=q_rows(replaced), replaced_kv_rows=_rows(replaced, head_dim),
            o_columns=torch.cat([q_rows(kept), q_rows(replaced)]),
        )


def model_fingerprint(model: nn.Module) -> str:
    """A short hash of the first layer's query weights: tells two same-shaped models apart."""
    weight = model.model.layers[0].self_attn.q_proj.weight.detach().float().cpu().contiguous()
    return hashlib.sha256(weight.numpy().tobytes()).hexdigest()[:16]


def _rows(heads: list[int], head_dim: int) -> Tensor:
    if not heads:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads])


def loaded_from(model: nn.Module) -> str | None:
    """[ours] Where `from_pretrained` loaded `model` from, as a converted model records its source
    (`hub.source_name`), so that a folder the library converted and saved finds its original
    (the teacher, its tokenizer) as one `convert` and `run` wrote does; None for a model built
    from a config or whose folder is gone."""
    name = getattr(model.config, "_name_or_path", "")
    if not name:
        return None
    try:
        return source_name(name)
    except RecurformerError:
        return None


def convert(
    model: nn.Module,
    spec: ReplacementSpec,
    mixer_config: MixerConfig | None = None,
    init: str = "reuse",
    seed: int = 0,
    source_model: str | None = None,
) -> RecurFormerForCausalLM:
    """Build a RecurFormer model from a pretrained causal LM; `model` is left unchanged.

    Args:
        model: a `LlamaForCausalLM`, `Qwen2ForCausalLM` or `MistralForCausalLM`.
        spec: the `(layer, kv_head)` groups to replace.
        mixer_config: the mixer (default: `MixerConfig()`, window+mamba2 in the default shape;
            `auto` fields are decided for the model's heads, `mixers/shape.py`).
        init: `reuse` derives what it can of each mixer from the replaced heads' weights
            (see docs/method.md); `random` keeps the mixer's own initialization (control).
        seed: seeds the mixers' random initialization.
        source_model: the name or path of `model`, recorded so training can find the teacher
            (default: where `from_pretrained` loaded `model` from, `loaded_from`).
    """
    if init not in INITS:
        raise ConfigError(f"init: unknown {init!r}; choose one of {', '.join(INITS)}")
    text = model.config
    check_architecture(text)
    if (spec.num_layers, spec.num_kv_heads) != (text.num_hidden_layers, text.num_key_value_heads):
        raise ConfigError(
            f"replacement spec is for {spec.num_layers} layers x {spec.num_kv_heads} KV heads, but the model "
            f"has {text.num_hidden_layers} layers x {text.num_key_value_heads} KV heads"
        )
    # the shape decided once, for the model's groups, so the saved config records it whole
    mixer_config = resolve_for_model(mixer_config or MixerConfig(), text)
    config = RecurFormerConfig(
        text_config=copy.deepcopy(text), replacement=spec.to_dict(), mixer=mixer_config.to_dict(),
        source_model=source_model or loaded_from(model), source_fingerprint=model_fingerprint(model),
    )
    config.text_config._attn_implementation = text._attn_implementation
    with no_init_weights():
        converted = RecurFormerForCausalLM(config)

    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    group_size = text.num_attention_heads // text.num_key_value_heads
    source = model.state_dict()
    weights = {name: t.detach().clone() for name, t in source.items() if ".self_attn." not in name}
    generator = torch.Generator().manual_seed(seed)
    for idx, (old_layer, hybrid) in enumerate(zip(model.model.layers, converted.hybrid_attentions())):
        plan = LayerPlan.build(idx, spec, group_size, head_dim)
        prefix = f"model.layers.{idx}.self_attn."
        weights.update(_attention_weights(prefix, old_layer.self_attn, plan, text, head_dim))
        if hybrid.mixer is not None:
            # Initialized in fp32 (the dtype the mixer is built in), then rounded once.
            _init_mixer(hybrid.mixer, old_layer.self_attn, plan, group_size, head_dim, init, generator)
            weights.update({
                prefix + "mixer." + n: t.to(device=model.device, dtype=model.dtype) if t.is_floating_point() else t
                for n, t in hybrid.mixer.state_dict().items()
            })
    # `assign`: every tensor keeps the dtype (and device) it has in `weights`, so the kept
    # model's weights stay exactly what they were and the mixers take the model's dtype.
    missing, unexpected = converted.load_state_dict(weights, strict=False, assign=True)
    if missing or unexpected:
        raise SurgeryError(f"weights do not match the converted layout: missing {missing[:5]}, unexpected {unexpected[:5]}")
    _copy_buffers(model, converted)
    converted.tie_weights()
    converted.to(model.device)  # anything the weights did not carry (a mixer's buffers) joins them
    converted.eval()
    return converted


def _copy_buffers(model: nn.Module, converted: nn.Module) -> None:
    """Give the converted model the original's buffers as they are, dtype included: a bf16
    Llama keeps its rotary `inv_freq` in fp32 (transformers computes it so), and casting it
    to bf16 would move every position's rotation. Buffers only the converted model has (a
    mixer's) keep what the mixer gave them."""
    original = dict(model.named_buffers())
    for name, _ in list(converted.named_buffers()):
        if name in original:
            owner, _, attr = name.rpartition(".")
            setattr(converted.get_submodule(owner), attr, original[name].detach().clone())


def _attention_weights(prefix: str, attn: nn.Module, plan: LayerPlan, text, head_dim: int) -> dict[str, Tensor]:
    """The kept heads' q/k/v rows and the reordered o_proj of one layer, shape-checked."""
    hidden = text.hidden_size
    n_q, n_kv = text.num_attention_heads * head_dim, text.num_key_value_heads * head_dim
    for name, shape in (("q_proj", (n_q, hidden)), ("k_proj", (n_kv, hidden)), ("v_proj", (n_kv, hidden)), ("o_proj", (hidden, n_q))):
        _check(getattr(attn, name).weight, shape, plan, f"{name}.weight")
    out = {"o_proj.weight": attn.o_proj.weight[:, plan.o_columns]}
    if attn.o_proj.bias is not None:
        out["o_proj.bias"] = attn.o_proj.bias
    if plan.kept_kv:
        for name, rows in (("q_proj", plan.q_rows), ("k_proj", plan.kv_rows), ("v_proj", plan.kv_rows)):
            linear = getattr(attn, name)
            out[f"{name}.weight"] = linear.weight[rows]
            if linear.bias is not None:
                out[f"{name}.bias"] = linear.bias[rows]
    return {prefix + name: t.detach().clone() for name, t in out.items()}


def _check(tensor: Tensor, shape: tuple[int, ...], plan: LayerPlan, name: str) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise SurgeryError(f"layer {plan.layer}: {name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")


def _init_mixer(
    mixer: Mixer, attn: nn.Module, plan: LayerPlan, group_size: int, head_dim: int, init: str, generator: torch.Generator
) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
        mixer.reset_parameters()
    if init == "random":
        return

    # the heads are copied at the mixer's (fp32) precision; a mixer without parameters takes them as they are
    like = next(mixer.parameters(), attn.q_proj.weight)

    def heads(linear: nn.Linear, rows: Tensor) -> tuple[Tensor, Tensor | None]:
        w = linear.weight.detach()[rows].view(-1, head_dim, linear.in_features).to(like)
        b = None if linear.bias is None else linear.bias.detach()[rows].view(-1, head_dim).to(like)
        return w, b

    (q, qb), (k, kb), (v, vb) = (
        heads(attn.q_proj, plan.replaced_q_rows),
        heads(attn.k_proj, plan.replaced_kv_rows),
        heads(attn.v_proj, plan.replaced_kv_rows),
    )
    mixer.init_from_heads(ReplacedHeads(q, k, v, qb, kb, vb, group_size))


def parameter_report(original: nn.Module, converted: nn.Module) -> dict[str, float]:
    """Parameter counts of the original and converted models, by part, and their ratio.

    Counts unique tensors (tied embeddings once). Keys: `original_total`,
    `converted_total`, `ratio`, `original_attention`, `converted_attention` (q/k/v/o),
    `converted_mixer`.
    """

    def count(model: nn.Module, keep) -> int:
        return sum(p.numel() for name, p in model.named_parameters() if keep(name))

    def is_attention(name: str) -> bool:
        return ".self_attn." in name and ".mixer." not in name

    original_total = count(original, lambda n: True)
    converted_total = count(converted, lambda n: True)
    return {
        "original_total": original_total,
        "converted_total": converted_total,
        "ratio": converted_total / original_total,
        "original_attention": count(original, is_attention),
        "converted_attention": count(converted, is_attention),
        "converted_mixer": count(converted, lambda n: ".mixer." in n),
    }
