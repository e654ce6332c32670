"""[ours] Decode steps of a RecurFormer model captured once in a CUDA graph and replayed.

On a GPU an eager decode step is bound by launching its kernels, not by the bytes it reads
(docs/gpu.md). A CUDA graph replays the whole step as one launch, but only a step that
depends on no Python value and never waits for the device can be captured. `DecodeGraph`
makes the cache static (`HybridCache.make_static`: fixed buffers, the filled length and the
ring-buffer slots on the device) and runs the model's own modules in order
(`static_step`), so no mask or position is built from Python integers; the first step
runs eagerly (the warm-up a capture needs, and a real token), the second is captured and
every step replays it. On the CPU the same static step runs eagerly, so the CPU tests check
what the GPU replays.

    graph = DecodeGraph(model, cache, capacity=prompt + new_tokens)
    for _ in range(new_tokens):
        logits = graph(token, position)           # [B, 1, V]
        token, position = logits.argmax(-1), position + 1

`graphed_generate` is that loop as `generate` runs it on a GPU (`recurformer generate
--device cuda`): prefill, then graphed steps, greedy or sampled as `model.generate` samples.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor
from transformers import GenerationConfig
from transformers.generation import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .cache import CACHE_ARGUMENT, HybridCache
from .device import model_device


@torch.no_grad()
def static_step(model, ids: Tensor, positions: Tensor, cache: HybridCache) -> Tensor:
    """One token per row, ids and positions `[B, 1]`, through `model`'s layers over the static
    `cache` -> logits `[B, 1, V]`: embedding, rotary, each decoder layer (with no mask: the
    static attention masks itself), final norm and head."""
    base = model.model
    hidden = base.embed_tokens(ids)
    position_embeddings = base.rotary_emb(hidden, positions)
    for layer in base.layers:
        hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=position_embeddings,
                       use_cache=True, **{CACHE_ARGUMENT: cache})
    return model.lm_head(base.norm(hidden))


class GraphedStep:
    """A decode step `step(ids, positions) -> logits` (ids and positions `[B, 1]`, logits
    `[B, 1, V]`) over state that stays in place between calls: eager on the CPU; on a GPU
    run once eagerly on a side stream (the warm-up a capture needs, and a real token),
    captured as a CUDA graph on the second call, replayed from then on."""

    def __init__(self, step, batch: int, device: torch.device):
        self.step = step
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.logits: Tensor | None = None
        self.graph = None

    @torch.no_grad()
    def __call__(self, ids: Tensor, positions: Tensor) -> Tensor:
        """The step's logits; a copy: the graph's own output is overwritten by the next step."""
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        if self.ids.device.type != "cuda":
            return self.step(self.ids, self.positions)
        if self.graph is None and self.logits is None:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.logits = self.step(self.ids, self.positions)
            torch.cuda.current_stream().wait_stream(stream)
            return self.logits.clone()
        if self.graph is None:  # capturing records the step without running it: replay runs it
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self.step(self.ids, self.positions)
        self.graph.replay()
        return self.logits.clone()


class DecodeGraph:
    """Decode steps of `model` over a prefilled `cache`, with room for `capacity` tokens in
    all; `starts` `[B]`: each row's first real token in a left-padded batch. The static
    step (`static_step`) as a `GraphedStep`."""

    def __init__(self, model, cache: HybridCache, capacity: int, starts: Tensor | None = None):
        layers = len(model.model.layers)
        if len(cache.layers) != layers:  # the last layer counts each token for all (`StaticSteps`)
            raise ValueError(f"DecodeGraph: the cache has {len(cache.layers)} layers, the model {layers}")
        cache.make_static(capacity, starts)
        self.cache, self.capacity, self.steps = cache, capacity, 0
        self.step = GraphedStep(lambda ids, positions: static_step(model, ids, positions, cache), cache.batch_size,
                                model_device(model))

    def __call__(self, ids: Tensor, positions: Tensor) -> Tensor:
        """Logits `[B, 1, V]` of the next token after `ids` at `positions` (both `[B, 1]`); the
        cache takes the token."""
        if self.steps + self.cache.layers[0].tokens >= self.capacity:
            raise ValueError(f"DecodeGraph: the cache is full ({self.capacity} tokens)")
        self.steps += 1
        return self.step(ids, positions)


# What `model.generate` would apply to the scores besides temperature, top-k, top-p and
# min-p; at transformers' default each applies nothing. A model whose generation config sets
# one decodes through `model.generate` (`graphed_generate` refuses it).
OTHER_PROCESSORS = ("repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size", "min_length",
                    "min_new_tokens", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens",
                    "forced_bos_token_id", "forced_eos_token_id", "sequence_bias", "typical_p", "epsilon_cutoff",
                    "eta_cutoff", "top_h", "exponential_decay_length_penalty", "renormalize_logits",
                    "watermarking_config", "guidance_scale", "num_beams")


def generation_settings(config: GenerationConfig) -> GenerationConfig:
    """`config` as `model.generate` runs it when given nothing else: its unset values at
    transformers' defaults (which transformers 5 applies at `generate`; before, the config
    held them already)."""
    config = copy.deepcopy(config)
    defaults = getattr(GenerationConfig, "_get_default_generation_params", dict)()
    for name, value in defaults.items():
        if getattr(config, name, None) is None:
            setattr(config, name, value)
    return config


def other_processors(model) -> list[str]:
    """The settings of `model`'s generation config that `graphed_generate` does not apply."""
    settings, plain = generation_settings(model.generation_config), generation_settings(GenerationConfig())
    return [name for name in OTHER_PROCESSORS if getattr(settings, name, None) != getattr(plain, name, None)]


def sampling_warpers(model, temperature: float) -> LogitsProcessorList:
    """What `model.generate(do_sample=True, temperature=...)` applies to the scores before it
    samples, in its order: temperature, then the generation config's top-k, top-p and min-p."""
    settings = generation_settings(model.generation_config)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if settings.top_k:
        warpers.append(TopKLogitsWarper(settings.top_k))
    if settings.top_p is not None and settings.top_p < 1.0:
        warpers.append(TopPLogitsWarper(settings.top_p))
    if settings.min_p is not None:
        warpers.append(MinPLogitsWarper(settings.min_p))
    return warpers


@torch.no_grad()
def graphed_generate(model, input_ids: Tensor, max_new_tokens: int, eos_token_id: int | list[int] | None = None,
                     pad_token_id: int | None = None, temperature: float = 0.0,
                     attention_mask: Tensor | None = None) -> Tensor:
    """`model.generate` for prompts `[B, T]` (left-padded where `attention_mask` `[B, T]` has
    zeros) of a RecurFormer model, its decode steps replayed from a CUDA graph (`DecodeGraph`;
    eager off a GPU) -> `[B, T + new]`: greedy at temperature 0, else sampled through
    `sampling_warpers` (a generation config that asks for more, `other_processors`, is
    refused); a row that has produced an end token (`eos_token_id`: one or several)
    continues with `pad_token_id` (default: the first end token), and decoding stops once
    every row has."""
    others = other_processors(model)
    if others:
        raise ValueError(f"graphed_generate: the generation config sets {', '.join(others)}; use model.generate")
    batch, prompt = input_ids.shape
    device = input_ids.device
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # each row's tokens from 0, after its padding
    ends = None if eos_token_id is None else torch.tensor(eos_token_id, device=device).flatten()
    cache = HybridCache(len(model.model.layers))
    logits = model(input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                   **{CACHE_ARGUMENT: cache}).logits[:, -1]
    graph = DecodeGraph(model, cache, capacity=prompt + max_new_tokens, starts=prompt - mask.sum(1))
    warpers = sampling_warpers(model, temperature) if temperature > 0 else None
    sequences, done = input_ids, torch.zeros(batch, dtype=torch.bool, device=device)
    position = positions[:, -1:]
    for step in range(max_new_tokens):
        if warpers is None:
            token = logits.argmax(-1)
        else:
            token = torch.multinomial(warpers(sequences, logits.float()).softmax(-1), num_samples=1)[:, 0]
        if ends is not None:
            token = torch.where(done, pad_token_id if pad_token_id is not None else ends[0], token)
            done |= torch.isin(token, ends)
        sequences = torch.cat([sequences, token[:, None]], 1)
        if step + 1 == max_new_tokens or (ends is not None and bool(done.all())):
            break
        position = position + 1
        logits = graph(token[:, None], position)[:, -1]
    return sequences


def generate_tokens(model, input_ids: Tensor, max_new_tokens: int, pad_token_id: int | None,
                    temperature: float = 0.0, attention_mask: Tensor | None = None) -> Tensor:
    """`model.generate`'s tokens `[B, T + new]` for prompts `[B, T]` (left-padded where
    `attention_mask` has zeros), greedy at temperature 0, else sampled, ending at the
    generation config's end tokens: through `graphed_generate` where `decodes_with_graphs`,
    else through `model.generate` itself."""
    if decodes_with_graphs(model):
        return graphed_generate(model, input_ids, max_new_tokens, model.generation_config.eos_token_id, pad_token_id,
                                temperature, attention_mask)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    return model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                          pad_token_id=pad_token_id, **sampling)


def decodes_with_graphs(model) -> bool:
    """Whether a RecurFormer model decodes with `graphed_generate` where `model.generate` would
    run: on a GPU (on the CPU the compiled kernels' ordinary decode is the fast one), with a
    generation config that asks for nothing `graphed_generate` does not apply."""
    return (getattr(model.config, "model_type", None) == "recurformer" and model_device(model).type == "cuda"
            and not other_processors(model))
