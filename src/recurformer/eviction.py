"""[ours] Token eviction on the heads that keep a KV cache: hold a fixed budget while text streams in.

A converted model's kept heads still cache every token; so does every head of the original.
To hold a fixed memory budget however long a stream grows (the cache must also hold what is
generated: long answers, agents' logs, long chats), an eviction policy ("press", after
kvpress) drops tokens online, before it knows what will be asked. `Eviction` does that on
any model whose attention is `HybridAttention` (a converted model; the original as
`as_hybrid` makes it, all heads kept): after each chunk fed, every kept head keeps the
`keep` tokens its press scores highest. The replaced heads' fixed-size state is not touched.

The presses' scores, read from kvpress 0.5's descriptions and sources (not copied) and from
their papers, computed from the layer's inputs of the last 64 tokens fed (`hidden`: as
kvpress's decoding press buffers its recent hidden states) and the head's cached keys and
values (RoPE applied):

- `streaming` (StreamingLLM, arXiv 2309.17453): the 4 first tokens (sinks) and the most recent;
- `knorm`: the negated L2 norm of each key;
- `keydiff` (arXiv 2504.15364): the negated cosine between each key and the mean of the
  head's normalized keys (distinctive keys are kept);
- `tova` (arXiv 2401.06104): the attention of the last query, averaged over all query heads of
  the layer; the last token is always kept;
- `snapkv` (arXiv 2404.14469): the attention of the last 64 queries to the earlier keys,
  averaged over those queries, smoothed by a 5-wide average pool, averaged over the group's
  query heads; the last 64 tokens are always kept;
- `expected-attention` (kvpress): the attention that the mean and covariance of the recent
  queries (pre-RoPE, the first 4 of them excluded), rotated by the average RoPE of the next
  512 positions, would pay to each key, softmaxed over the keys, averaged over the group,
  times the value's norm; the 4 first tokens are always kept. [ours] The next positions start
  at the stream's true position; kvpress 0.5's decoding press starts them at its buffer's length.

`tests/test_eviction.py` checks each score against its formula and the eviction against
the full cache where nothing is evicted.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .attention import HybridAttention
from .config import ConfigError, ReplacementSpec
from .modeling import RecurFormerForCausalLM
from .surgery import convert

PRESSES = ("streaming", "knorm", "keydiff", "tova", "snapkv", "expected-attention")
SNAP_WINDOW, SNAP_KERNEL = 64, 5
RECENT = SNAP_WINDOW  # the tokens whose layer inputs an eviction scores with
FUTURE_POSITIONS, SINKS = 512, 4


def queries(module: HybridAttention, hidden: Tensor) -> Tensor:
    """Pre-RoPE queries `[B, Hq_kept, T, D]` of the kept heads for `hidden` `[B, T, hidden]`."""
    batch, length = hidden.shape[:2]
    return module.q_proj(hidden).view(batch, length, -1, module.head_dim).transpose(1, 2)


def window_attention(module: HybridAttention, hidden: Tensor, keys: Tensor, window: int, cos: Tensor,
                     sin: Tensor) -> Tensor:
    """Attention `[B, Hq_kept, window, T - window]` of the last `window` queries to the keys
    before them (causal inside the window, softmax over all keys): the window is the last
    `window` of the `T` keys."""
    q = queries(module, hidden[:, -window:])
    q, _ = apply_rotary_pos_emb(q, q, cos[:, -window:], sin[:, -window:])
    expanded = keys.repeat_interleave(module.num_key_value_groups, dim=1)
    logits = q @ expanded.transpose(2, 3) / math.sqrt(module.head_dim)
    length = keys.shape[2]
    logits = logits + torch.full_like(logits, float("-inf")).triu(length - window + 1)
    return logits.softmax(dim=-1)[..., :-window]


def average_rope(rotary, mu: Tensor, start: int, count: int) -> Tensor:
    """The rotation `[D, D]` that RoPE applies, averaged over positions `start ... start + count - 1`."""
    cos, sin = rotary(mu, torch.arange(start, start + count, device=mu.device)[None])
    cos, sin = cos[0], sin[0]  # [count, D]
    dim = cos.shape[-1]
    swap = torch.zeros(dim, dim, dtype=cos.dtype, device=cos.device)
    swap[dim // 2:, :dim // 2], swap[:dim // 2, dim // 2:] = torch.eye(dim // 2), -torch.eye(dim // 2)
    eye = torch.eye(dim, dtype=cos.dtype, device=cos.device)
    return (cos[:, None] * eye + sin[:, None] * swap).mean(dim=0)


def _pin_last(scores: Tensor, count: int) -> Tensor:
    """`scores` `[B, H, T - count]` padded with `count` scores above all others (always kept)."""
    return F.pad(scores, (0, count), value=scores.max().item() + 1 if scores.numel() else 1.0)


def score(press: str, module: HybridAttention, hidden: Tensor, keys: Tensor, values: Tensor,
          position_embeddings: tuple[Tensor, Tensor], rotary, position: int) -> Tensor:
    """Scores `[B, Hkv_kept, T]` of the kept heads' cached keys/values `[B, Hkv_kept, T, D]`
    (higher: keep); `hidden` `[B, N, hidden]` is the layer's input of the last `N` tokens fed
    (the last `N` of the `T`), `position_embeddings` theirs, `position` the stream's next position."""
    batch, heads, length, dim = keys.shape
    groups = module.num_key_value_groups
    if press == "streaming":
        scores = torch.arange(length, dtype=keys.dtype, device=keys.device).expand(batch, heads, length).clone()
        scores[..., :SINKS] = float(length)
        return scores
    if press == "knorm":
        return -keys.norm(dim=-1)
    if press == "keydiff":
        anchor = F.normalize(keys, p=2, dim=-1).mean(dim=2, keepdim=True)
        return -F.cosine_similarity(keys, anchor, dim=-1)
    if press in ("snapkv", "tova"):
        window = SNAP_WINDOW if press == "snapkv" else 1
        weights = window_attention(module, hidden, keys, window, *position_embeddings).mean(dim=-2)
        if press == "snapkv":
            weights = F.avg_pool1d(weights, kernel_size=SNAP_KERNEL, padding=SNAP_KERNEL // 2, stride=1)
            scores = weights.view(batch, heads, groups, length - window).mean(dim=2)
        else:
            scores = weights.mean(dim=1, keepdim=True).expand(batch, heads, length - window)
        return _pin_last(scores, window)
    if press == "expected-attention":
        q = queries(module, hidden[:, SINKS:] if hidden.shape[1] > SINKS else hidden)
        mu = q.mean(dim=2, keepdim=True)
        centered = q - mu
        cov = torch.einsum("bnsi,bnsj->bnij", centered, centered) / q.shape[2]
        rotation = average_rope(rotary, mu, position, FUTURE_POSITIONS)
        mu, cov = mu.squeeze(2) @ rotation.T, rotation @ cov @ rotation.T
        k = keys[:, :, SINKS:].repeat_interleave(groups, dim=1).transpose(2, 3)  # [B, Hq, D, T - sinks]
        logits = (mu[:, :, None] @ k).squeeze(2) / math.sqrt(dim)
        logits = logits + torch.einsum("bhin,bhij,bhjn->bhn", k, cov, k) / dim / 2
        scores = logits.softmax(dim=-1).view(batch, heads, groups, length - SINKS).mean(dim=2)
        scores = scores * values[:, :, SINKS:].norm(dim=-1)
        return F.pad(scores, (SINKS, 0), value=scores.max().item() + 1)
    raise ConfigError(f"unknown press {press!r}; choose one of {', '.join(PRESSES)}")


def least_kept(press: str) -> int:
    """The fewest tokens per head `press` can keep: more than StreamingLLM's sinks, more than
    SnapKV's window of always-kept tokens, else one."""
    return {"streaming": SINKS + 1, "snapkv": SNAP_WINDOW + 1}.get(press, 1)


def as_hybrid(model) -> RecurFormerForCausalLM:
    """`model` itself if converted, else the original as a conversion that replaces no group
    (every head kept: the same outputs, in a `HybridCache` that eviction can act on)."""
    if isinstance(model, RecurFormerForCausalLM):
        return model
    text = model.config.get_text_config()
    return convert(model, ReplacementSpec(text.num_hidden_layers, text.num_key_value_heads, [])).eval()


class Eviction:
    """A press on the kept heads of `model` (a `RecurFormerForCausalLM`): remembers each
    attention layer's inputs of the last `RECENT` tokens fed and, called with the cache after
    a forward, keeps the `keep` best-scored tokens of every kept head. Every layer then counts
    `keep` tokens; the tokens that follow must be given their positions (`position_ids`).
    `reset` before a new stream."""

    def __init__(self, model: RecurFormerForCausalLM, press: str, keep: int) -> None:
        if press not in PRESSES:
            raise ConfigError(f"unknown press {press!r}; choose one of {', '.join(PRESSES)}")
        if keep < least_kept(press):
            raise ConfigError(f"the {press} press must keep at least {least_kept(press)} tokens per head, got {keep}")
        self.press, self.keep = press, keep
        self.rotary = model.get_decoder().rotary_emb
        self.modules = model.hybrid_attentions()
        self.inputs: dict[int, tuple[Tensor, tuple[Tensor, Tensor]]] = {}
        self.hooks = [m.register_forward_pre_hook(self._remember, with_kwargs=True) for m in self.modules]

    def remove(self) -> None:
        """Unhook from the model."""
        for hook in self.hooks:
            hook.remove()
        self.reset()

    def reset(self) -> None:
        """Forget the inputs remembered (a new stream starts)."""
        self.inputs.clear()

    def _remember(self, module, args, kwargs) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"]
        if module.layer_idx in self.inputs:
            before, (cos_before, sin_before) = self.inputs[module.layer_idx]
            hidden, cos, sin = (torch.cat(pair, dim=1) for pair in ((before, hidden), (cos_before, cos),
                                                                     (sin_before, sin)))
        self.inputs[module.layer_idx] = (hidden[:, -RECENT:], (cos[:, -RECENT:], sin[:, -RECENT:]))

    @torch.no_grad()
    def __call__(self, cache, position: int) -> bool:
        """Evict down to `keep` tokens in every layer of `cache` (a `HybridCache` right after a
        forward) if it holds more; `position`: the stream's next position. True if it evicted."""
        if cache.layers[0].tokens <= self.keep:
            return False
        for module in self.modules:
            layer = cache.layers[module.layer_idx]
            if module.has_attention:
                hidden, embeddings = self.inputs[module.layer_idx]
                scores = score(self.press, module, hidden, layer.keys, layer.values, embeddings, self.rotary, position)
                index = scores.topk(self.keep, dim=-1).indices.sort(dim=-1).values
            else:  # no kept heads: no K/V, but the layer counts the tokens (the attention mask's past length)
                index = torch.zeros(layer.keys.shape[0], 0, self.keep, dtype=torch.long, device=layer.keys.device)
            layer.keep_tokens(index)
        return True
