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
"""

from __future__ import annotations

import torch
from torch import Tensor

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
