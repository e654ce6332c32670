"""The RecurFormer model: config and model classes, and their Auto* registration.

A RecurFormer model is its base model (Llama, Qwen2 or Mistral) whose attention modules are
`HybridAttention`s laid out by a `ReplacementSpec`. The config nests the base config as
`text_config` (the transformers pattern for composite models), so every base-model feature
(RoPE variants, attention kernels, generation defaults) keeps working. Weights keep the base
model's names; a converted layer adds `...self_attn.mixer.*`.

After `import recurformer`, `AutoModelForCausalLM.from_pretrained(dir)` loads a saved model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.configuration_utils import PreTrainedConfig, SubConfigSpec
from transformers.modeling_outputs import CausalLMOutputWithPast

from .attention import HybridAttention
from .cache import CACHE_ARGUMENT, HybridCache
from .config import SUPPORTED_ARCHITECTURES, ConfigError, ReplacementSpec
from .errors import RecurformerError
from .mixers import MixerConfig


class UnsupportedArchitectureError(RecurformerError, ValueError):
    """The base model's architecture is not one RecurFormer can convert."""


def check_architecture(config: PreTrainedConfig | str | None) -> None:
    """Refuse a base model RecurFormer cannot convert; `config`: its config, or its `model_type`."""
    model_type = config if isinstance(config, str) else getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    clip = getattr(config, "clip_qkv", None)  # OLMo's option: q/k/v clamped, which Llama's attention is not
    if clip is not None:
        raise UnsupportedArchitectureError(f"{model_type} with clip_qkv={clip}: clipped q/k/v is not Llama's attention, "
                                           "which the converted layers compute; only models without clip_qkv convert")


class RecurFormerConfig(PreTrainedConfig):
    """Base config (`text_config`) + the replacement spec + the mixer config, as plain dicts."""

    model_type = "recurformer"
    sub_configs_defaults = {"text_config": SubConfigSpec(config_class=AutoConfig, model_type="llama")}

    text_config: dict | PreTrainedConfig | None = None
    replacement: dict | None = None
    mixer: dict | None = None
    tie_word_embeddings: bool = False
    source_model: str | None = None  # the name, path or hub id@commit it was converted from (the teacher)
    source_fingerprint: str | None = None  # identifies that model's weights
    training: list | None = None  # the stages trained since the conversion: [{stage, steps, tokens, trainable}]

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        # The base model decides about tying; mirror it here, where transformers looks.
        self.tie_word_embeddings = bool(getattr(self.text_config, "tie_word_embeddings", False))

    def spec(self) -> ReplacementSpec:
        """The validated replacement spec, checked against the base config's shape."""
        if self.replacement is None:
            raise ConfigError("RecurFormer config has no 'replacement' spec")
        spec = ReplacementSpec.from_dict(self.replacement)
        text = self.text_config
        expected = (text.num_hidden_layers, text.num_key_value_heads)
        if (spec.num_layers, spec.num_kv_heads) != expected:
            raise ConfigError(
                f"replacement spec is for {spec.num_layers} layers x {spec.num_kv_heads} KV heads, "
                f"but the base model has {expected[0]} layers x {expected[1]} KV heads"
            )
        return spec

    def mixer_config(self) -> MixerConfig:
        if self.mixer is None:
            raise ConfigError("RecurFormer config has no 'mixer' config")
        return MixerConfig.from_dict(self.mixer)


class RecurFormerPreTrainedModel(PreTrainedModel):
    config: RecurFormerConfig
    config_class = RecurFormerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _skip_keys_device_placement = ["past_key_values", "cache"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_attention_backend = True


class RecurFormerForCausalLM(RecurFormerPreTrainedModel, GenerationMixin):
    """A causal LM whose layers mix kept softmax heads with a recurrent mixer."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: RecurFormerConfig):
        super().__init__(config)
        text = config.text_config
        check_architecture(text)
        self.spec = config.spec()
        self.model = AutoModel.from_config(text)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        install_hybrid_attention(self.model, self.spec, config.mixer_config())
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: HybridCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: HybridCache | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """As the base model's forward; with `use_cache`, the cache is a `HybridCache`, given
        as `cache` or (the name before transformers 5.24) `past_key_values`."""
        if cache is not None and past_key_values is not None:
            raise ValueError("pass the cache once, as cache= or past_key_values=, not both")
        cache = past_key_values if cache is None else cache
        if use_cache is None:
            use_cache = bool(self.config.text_config.use_cache) and not self.training
        if use_cache and cache is None:
            cache = HybridCache(self.config.text_config.num_hidden_layers)
        padding_mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
        if padding_mask is not None and bool(padding_mask.all()):
            padding_mask = None  # no padding: checked once here rather than in every layer's mixer
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            padding_mask=padding_mask,
            **{CACHE_ARGUMENT: cache},
            **kwargs,
        )
        hidden = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.text_config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            **{CACHE_ARGUMENT: cache if use_cache else None},
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        if model_kwargs.get(CACHE_ARGUMENT) is None and generation_config.use_cache is not False:
            if generation_config.cache_implementation not in (None, "dynamic"):
                raise ValueError(
                    f"cache_implementation={generation_config.cache_implementation!r} is not supported: "
                    "RecurFormer models use their own HybridCache"
                )
            model_kwargs[CACHE_ARGUMENT] = HybridCache(self.config.text_config.num_hidden_layers)
            return None
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)

    def hybrid_attentions(self) -> list[HybridAttention]:
        return [layer.self_attn for layer in self.model.layers]


def install_hybrid_attention(base_model: nn.Module, spec: ReplacementSpec, mixer_config: MixerConfig) -> None:
    """Replace every layer's attention of `base_model` (e.g. a `LlamaModel`) by a
    `HybridAttention` laid out by `spec`. Structure only: the new modules are freshly
    initialized; `surgery.convert` copies the weights."""
    config = base_model.config
    for idx, layer in enumerate(base_model.layers):
        original = layer.self_attn
        replaced = spec.replaced_heads(idx)
        hybrid = HybridAttention(
            config,
            idx,
            kept_kv_heads=spec.kept_heads(idx),
            replaced_kv_heads=replaced,
            mixer_config=mixer_config if replaced else None,
            qkv_bias=original.q_proj.bias is not None,
            o_bias=original.o_proj.bias is not None,
            sliding_window=getattr(original, "sliding_window", getattr(config, "sliding_window", None)),
        )
        if hybrid.mixer is not None:
            # The mixer's own init (Mamba's A, dt, D) must survive transformers' generic init pass.
            for module in hybrid.mixer.modules():
                module._is_hf_initialized = True
        layer.self_attn = hybrid


AutoConfig.register("recurformer", RecurFormerConfig, exist_ok=True)
AutoModelForCausalLM.register(RecurFormerConfig, RecurFormerForCausalLM, exist_ok=True)
