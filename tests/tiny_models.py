"""Tiny random Llama / Qwen2 / Mistral models built from configs: no downloads, fast on CPU."""

from __future__ import annotations

import random
import tempfile

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from recurformer.cache import CACHE_ARGUMENT, HybridCache
from recurformer.config import ReplacementSpec
from recurformer.decode_graph import DecodeGraph
from recurformer.mixers import MIXER_KINDS, HeadShape, MixerConfig, build_mixer

COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=512)

# GQA with tied embeddings, GQA with q/k/v biases, and MHA: the shapes the surgery must handle.
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(num_attention_heads=6, num_key_value_heads=2, head_dim=8)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(num_attention_heads=4, num_key_value_heads=4, sliding_window=None)),
}


# One small config per registered mixer kind (each kind reads only its own fields): the
# window is shorter than most test sequences, so a ring buffer wraps; SSD chunks are short.
MIXERS = {kind: MixerConfig(kind=kind, window=16, sinks=2, ssd_chunk=16, feature_dim=6) for kind in MIXER_KINDS}


def keeps_state(kind: str) -> bool:
    """Whether a mixer of `kind` keeps anything between tokens (a kind may keep nothing)."""
    mixer = build_mixer(8, HeadShape(num_q_heads=2, num_kv_heads=1, head_dim=4), MIXERS[kind])
    return bool(mixer.allocate_state(1, torch.float32, "cpu"))


def open_gates(converted, seed: int = 0):
    """Give the window+* mixers' gates random values: they start at zero, which would hide
    the recurrent branch from every test. Returns the model."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in converted.named_parameters():
            if name.endswith(".mixer.gate"):
                p.copy_(torch.randn(p.shape, generator=generator))
    return converted


def tiny_model(arch: str, attn_implementation: str = "sdpa", seed: int = 0, dtype: torch.dtype = torch.float32,
               **fields):
    """The model in fp32; another `dtype` loads it as a user does, `from_pretrained(dir,
    dtype=dtype)`, which keeps buffers such as the rotary `inv_freq` in fp32. `fields`: config
    fields that differ from COMMON and the architecture's (`num_hidden_layers=3`, ...)."""
    config_cls, model_cls, extra = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **extra, **fields})
    config._attn_implementation = attn_implementation
    model = model_cls(config).eval()
    # Random init gives near-uniform logits; sharper weights make mismatches visible.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    if dtype != torch.float32:
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            model = model_cls.from_pretrained(tmp, dtype=dtype, attn_implementation=attn_implementation).eval()
    return model


def mixed_layout(model) -> ReplacementSpec:
    """For a three-layer `model`: layer 0 loses every KV group (no kept group), layer 1 its
    first (mixed), layer 2 none (no replaced group)."""
    heads = model.config.num_key_value_heads
    return ReplacementSpec(3, heads, [(0, h) for h in range(heads)] + [(1, 0)])


def spec_for(model, beta: float, seed: int = 0) -> ReplacementSpec:
    """Replace a random `beta` fraction of the model's KV groups."""
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    groups = [(l, h) for l in range(layers) for h in range(heads)]
    random.Random(seed).shuffle(groups)
    return ReplacementSpec(layers, heads, groups[: round(beta * len(groups))])


def tiny_tokenizer(vocab_size: int = 97, alphabet: list[str] | None = None):
    """A byte-level BPE tokenizer trained on a few lines of text, offline, in milliseconds.
    `alphabet`: its initial byte-level characters (default: the first 60 in code point order,
    the same in every process: `ByteLevel.alphabet()` is a set, whose order is not)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = [
        "The quick brown fox jumps over the lazy dog.",
        "A recurrent state has a fixed size; a KV cache grows with every token.",
        "Attention heads that only look at the last few tokens can be replaced.",
    ] * 20
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<eos>"], initial_alphabet=alphabet or sorted(pre_tokenizers.ByteLevel.alphabet())[:60],
        show_progress=False,
    )
    tokenizer.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>")


def save_tiny_model(path, arch: str = "llama", seed: int = 0):
    """A tiny model + tokenizer saved as a Hugging Face model directory; returns the path."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(arch, seed=seed)
    assert len(tokenizer) <= model.config.vocab_size
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# Words for the run model's tokenizer: MQAR draws its keys and values from whole-word tokens.
WORDS = ("apple river stone cloud green house table water music light paper glass forest window garden bridge "
         "silver market letter winter summer doctor pencil rabbit castle dragon engine island jacket kettle lemon "
         "mirror needle orange pepper quartz ribbon saddle tiger violin wagon yellow zebra anchor basket candle "
         "desert feather hammer ladder meadow nickel oyster puzzle rocket sugar tunnel velvet walnut butter cotton").split()


def ruler_prompts() -> list[str]:
    """A few plain-format prompts of `run`'s RULER mix, with small haystacks of `WORDS`."""
    from recurformer.evaluate.ruler import RUN_TASKS
    from recurformer.tasks.ruler import TASKS, Sources, render

    sources = Sources.from_text(" ".join(f"the {a} is near the {b}." for a, b in zip(WORDS, WORDS[1:])))
    prompts = []
    for name in RUN_TASKS.split(","):
        for seed in range(3):
            draw = TASKS[name].draw(random.Random(seed), sources)
            prompts.append("".join(render("plain", None, TASKS[name], draw, TASKS[name].haystack(draw, 8, sources))))
    return prompts


def save_tiny_run_model(path, seed: int = 0):
    """A tiny Llama whose tokenizer (1,000 tokens, trained on the evaluation tasks' prompts
    and plain words) lets `recurformer run --quick` go through every stage, including the
    HashHop, passkey, RULER and MQAR evaluations that `tiny_tokenizer` is too small for; returns
    the path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from recurformer.tasks import passkey
    from recurformer.tasks.hashhop import generate_hashhop

    text = [generate_hashhop(1, hops=1, n_chains=2, seed=s)[0].prompt for s in range(3)]
    text += ruler_prompts()
    text += [passkey.EXAMPLE, " ".join(WORDS) * 5, "the quick brown fox jumps over the lazy dog ."]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.train_from_iterator(text * 5, trainer)
    config_cls, model_cls, extra = ARCHITECTURES["llama"]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**COMMON, "vocab_size": 1024}, **extra)).eval()
    model.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>").save_pretrained(path)
    return path


@torch.no_grad()
def decode_after_prefill(model, ids: torch.Tensor, mask: torch.Tensor, new: torch.Tensor,
                         graphed: bool) -> tuple[torch.Tensor, HybridCache]:
    """Logits `[B, T, V]` of the tokens `new` `[B, T]` decoded one at a time after a prefill of
    the left-padded `ids` (`mask`: 1 for a token), with the ordinary decode or with
    `DecodeGraph`'s static steps; and the cache."""
    width, steps = ids.shape[1], new.shape[1]
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = HybridCache(model.config.text_config.num_hidden_layers)
    model(ids, attention_mask=mask, position_ids=positions, **{CACHE_ARGUMENT: cache})
    step_mask, position, logits = mask, positions[:, -1:], []
    graph = DecodeGraph(model, cache, capacity=width + steps, starts=width - mask.sum(1)) if graphed else None
    for t in range(steps):
        position = position + 1
        if graphed:
            logits.append(graph(new[:, t:t + 1], position))
        else:
            step_mask = torch.cat([step_mask, torch.ones_like(step_mask[:, :1])], 1)
            logits.append(model(new[:, t:t + 1], attention_mask=step_mask, position_ids=position,
                                **{CACHE_ARGUMENT: cache}).logits)
    return torch.cat(logits, 1), cache
