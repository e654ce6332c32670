"""kvpress's scorers on the kept heads of a converted model: the composition of our conversion
with a token-eviction press (docs/results/long-context.md, "Retrieval at equal cache bytes").

kvpress (its own environment, `benchmarks/peers/`) hooks Hugging Face attention modules; our
`HybridAttention` is not one, so the presses' scores are computed by us again, from kvpress
0.5.5's description and source (read, not copied), for the kept heads only: `knorm`, `snapkv`,
`tova` and `expected-attention` as `recurformer.eviction` scores them (the streaming task's
eviction uses the same), with the prefill as the chunk just fed, and here:

- `kvzip`: how much reconstructing the context needs each key (KVzip, arXiv 2505.23416): after
  the prefill, the model is asked to repeat the context, in chunks of 2,048 tokens (each replay
  from a copy of the prefilled cache: "Repeat the previous context exactly." or, after the
  first, "Repeat the part of the previous context exactly, starting with" and the previous
  chunk's last 8 tokens, then the chat template's assistant turn, then the chunk); a key's score
  is the most attention any replay query of its group pays it, the softmax taken over the 4
  sinks, the chunk and the replay itself. As kvpress, the first tokens that the chat template's
  user prefix would take are not replayed (they score 0) and the 4 first tokens are always
  kept.

A press acts after the prefill of the context (kvpress compresses each layer right after it
ran, which is the same: a layer's prefill output does not depend on what its cache keeps
afterwards); the replaced heads' mixer state is not touched. How many tokens a head keeps of
the context's `L` (`allocation`):
- `head`: every kept head of every layer keeps its `int(L * keep)` best-scored tokens;
- `global`: the tokens of all kept heads of all layers are ranked together and the
  `int(L * keep)` x (kept heads) best kept, so one head may keep more than another, as
  kvpress's KVzip ranks them. The cache then holds, per layer, as many slots as the head that
  keeps most and hides the others' extra slots from attention (`HybridLayer.keep_tokens` with
  counts), as kvpress hides them: the bytes counted are those of the kept tokens.
`tests/test_ruler_peers.py` checks each scorer against kvpress's formulas on a tiny model.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import Tensor
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from recurformer.attention import HybridAttention
from recurformer.cache import CACHE_ARGUMENT
from recurformer.eviction import SINKS, queries, score

PRESSES = ("knorm", "snapkv", "tova", "expected-attention", "kvzip")
ALLOCATIONS = ("head", "global")
REPLAY_CHUNK, REPLAY_OVERLAP = 2048, 8
FIRST_REPLAY = "\n\nRepeat the previous context exactly."
LATER_REPLAY = "\n\nRepeat the part of the previous context exactly, starting with"


class Replay:
    """KVzip's replay prompts as ids: the chat template's user prefix length (tokens of the
    context not replayed), the first and later chunks' requests and the assistant turn."""

    def __init__(self, tokenizer) -> None:
        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        self.prefix, suffix = 0, "\n"
        if tokenizer.chat_template is not None:  # the user turn's text before and after a stand-in context
            stand_in, marker = "dummy context", "\n" + "#" * 13
            turn = tokenizer.apply_chat_template([{"role": "user", "content": stand_in + marker}],
                                                 add_generation_prompt=True, tokenize=False)
            before, suffix = turn.split(marker)
            self.prefix = len(encode(before.split(stand_in)[0]))
        self.first, self.later, self.suffix = encode(FIRST_REPLAY), encode(LATER_REPLAY), encode(suffix)

    def chunks(self, ids: list[int]) -> list[tuple[int, int, list[int]]]:
        """(start, end, replay ids) of each chunk of the context `ids` that is replayed."""
        out = []
        for start in range(self.prefix, len(ids), REPLAY_CHUNK):
            end = min(start + REPLAY_CHUNK, len(ids))
            request = self.first if start == self.prefix else \
                self.later + ids[max(self.prefix, start - REPLAY_OVERLAP):start]
            out.append((start, end, request + self.suffix + ids[start:end]))
        return out


def replay_scores(module: HybridAttention, hidden: Tensor, keys: Tensor, position_embeddings: tuple[Tensor, Tensor],
                  start: int, end: int) -> Tensor:
    """KVzip's scores `[B, Hkv_kept, end - start]` of the context keys `start ... end - 1`:
    `hidden` `[B, R, hidden]` is the replay's input to the layer, `keys` `[B, Hkv_kept, L + R, D]`
    the cache after it (the context's `L` keys, then the replay's)."""
    batch, replay = hidden.shape[:2]
    q = queries(module, hidden)
    q, _ = apply_rotary_pos_emb(q, q, *position_embeddings)
    sinks = min(SINKS, start)
    subset = torch.cat([keys[:, :, :sinks], keys[:, :, start:end], keys[:, :, -replay:]], dim=2)
    logits = q @ subset.repeat_interleave(module.num_key_value_groups, dim=1).transpose(2, 3)
    logits = logits / math.sqrt(module.head_dim)
    logits[..., -replay:] += torch.full((replay, replay), float("-inf")).triu(1)
    weights = logits.softmax(dim=-1)[..., sinks:sinks + end - start]  # [B, Hq, R, end - start]
    return weights.view(batch, keys.shape[1], module.num_key_value_groups, replay, -1).amax(dim=(2, 3))


class KeptPress:
    """A press on the kept heads of a converted model: remembers each attention layer's last
    input (the prefill's, when called right after it) and compresses its cache."""

    def __init__(self, model, press: str, keep: float, tokenizer=None, allocation: str = "head") -> None:
        if press not in PRESSES:
            raise ValueError(f"unknown press {press!r}; choose from {', '.join(PRESSES)}")
        if allocation not in ALLOCATIONS:
            raise ValueError(f"unknown allocation {allocation!r}; choose from {', '.join(ALLOCATIONS)}")
        if not 0 < keep <= 1:
            raise ValueError(f"keep must be in (0, 1], got {keep}")
        if press == "kvzip" and tokenizer is None:
            raise ValueError("the kvzip press needs the tokenizer (its replay prompts)")
        self.model, self.press, self.keep, self.allocation = model, press, keep, allocation
        self.rotary = model.get_decoder().rotary_emb
        self.inputs: dict[int, tuple[Tensor, tuple[Tensor, Tensor]]] = {}
        self.modules = model.hybrid_attentions()
        self.hooks = [m.register_forward_pre_hook(self._remember, with_kwargs=True) for m in self.modules]
        self.replay = Replay(tokenizer) if press == "kvzip" else None
        self.ids: list[int] = []  # the last forward's input ids: the context's, right after its prefill
        if self.replay is not None:
            self.hooks.append(model.register_forward_pre_hook(self._remember_ids, with_kwargs=True))

    def remove(self) -> None:
        """Unhook from the model."""
        for hook in self.hooks:
            hook.remove()
        self.inputs.clear()

    def _remember(self, module, args, kwargs) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        self.inputs[module.layer_idx] = (hidden, kwargs["position_embeddings"])

    def _remember_ids(self, model, args, kwargs) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        self.ids = ids[0].tolist()

    @torch.no_grad()
    def kvzip_scores(self, cache, length: int) -> dict[int, Tensor]:
        """KVzip's scores `{layer: [B, Hkv_kept, length]}` of the kept heads in `cache` (just
        prefilled with the context, which it leaves as it is; sinks not yet raised)."""
        if len(self.ids) != length:
            raise ValueError(f"the last forward fed {len(self.ids)} ids, not the context's {length}")
        modules = {m.layer_idx: m for m in self.modules if m.has_attention}
        scores = {layer: torch.zeros(cache.layers[layer].keys.shape[:2] + (length,)) for layer in modules}
        context = self.ids
        for start, end, replay in self.replay.chunks(context):
            copied = copy.deepcopy(cache)
            positions = torch.arange(length, length + len(replay))[None]
            self.model(input_ids=torch.tensor([replay]), position_ids=positions, use_cache=True, logits_to_keep=1,
                       **{CACHE_ARGUMENT: copied})
            for layer, values in scores.items():
                hidden, position_embeddings = self.inputs[layer]
                values[..., start:end] = replay_scores(modules[layer], hidden, copied.layers[layer].keys,
                                                       position_embeddings, start, end)
        self.ids = context  # the replays' forwards were remembered too
        return scores

    @torch.no_grad()
    def __call__(self, cache, length: int) -> None:
        """Keep `int(length * keep)` tokens of every kept head in `cache` (a `HybridCache` just
        prefilled with `length` tokens), or as many on average (`allocation` "global")."""
        kept = int(length * self.keep)
        if self.replay is not None:
            scores = self.kvzip_scores(cache, length)
            for values in scores.values():
                values[..., :SINKS] = float("inf")
        else:
            scores = {}
            for module in (m for m in self.modules if m.has_attention):
                hidden, position_embeddings = self.inputs[module.layer_idx]
                layer = cache.layers[module.layer_idx]
                scores[module.layer_idx] = score(self.press, module, hidden, layer.keys, layer.values,
                                                 position_embeddings, self.rotary, length)
        if self.allocation == "global":
            chosen = global_selection(scores, kept)
        else:
            chosen = {layer: (values.topk(kept, dim=-1).indices.sort(dim=-1).values, None)
                      for layer, values in scores.items()}
        width = next(iter(chosen.values()))[0].shape[-1] if chosen else kept
        for module in self.modules:
            layer = cache.layers[module.layer_idx]
            # a layer without kept heads has no K/V, but it counts the tokens: the attention mask's past length
            index, counts = chosen.get(module.layer_idx, (torch.zeros(layer.keys.shape[0], 0, width, dtype=torch.long),
                                                          None))
            layer.keep_tokens(index, counts)
        self.inputs.clear()


def global_selection(scores: dict[int, Tensor], kept: int) -> dict[int, tuple[Tensor, Tensor]]:
    """The `kept` x (heads) best of all heads' scores ranked together (`scores` `{layer:
    [B, Hkv_kept, L]}`) -> `{layer: (index [B, Hkv_kept, n], counts [B, Hkv_kept])}`: each head's
    chosen tokens first, in order, then its others up to `n`, the most any head keeps."""
    layers = sorted(scores)
    flat = torch.cat([scores[layer] for layer in layers], dim=1)  # [B, H, L]
    batch, heads, length = flat.shape
    best = flat.flatten(1).topk(min(kept * heads, heads * length), dim=-1).indices
    chosen = torch.zeros(batch, heads * length, dtype=torch.bool).scatter_(1, best, True).view(batch, heads, length)
    counts = chosen.sum(-1)
    order = (~chosen).long() * length + torch.arange(length)  # chosen first, each part by position
    index = order.sort(dim=-1).values[..., :int(counts.max())] % length
    out, start = {}, 0
    for layer in layers:
        width = scores[layer].shape[1]
        out[layer] = (index[:, start:start + width], counts[:, start:start + width])
        start += width
    return out
