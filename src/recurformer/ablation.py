"""[ours] What replacing one KV group by a sliding window costs: the `ablation` scorer's numbers.

For every KV group `(layer, kv_head)` alone, the group's query heads attend only to

    { j <= i :  i - j < window  or  j < sinks }

(exactly what the training-free `window` mixer computes with the same q/k/v weights and
RoPE), and the cost is the increase of the mean next-token NLL over the tokens at
positions >= `ablation_from` of each calibration sequence:

    cost(l, g) = mean NLL(group (l, g) windowed) - mean NLL(original)

The model is never converted. One plain pass stores every layer's input hidden states;
ablating a group of layer `l` reruns only layers `l..L-1` from the stored input of layer
`l`. The groups of one layer (and all sequences) go through together as batch rows: row
`r` windows group `groups[r // N]`, the attention function registered as
`ABLATION_ATTENTION` masks just that group's query heads. Finished layers can be written to
a checkpoint file so that an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm
from transformers import AttentionInterface
from transformers.models.llama.modeling_llama import repeat_kv

from .config import ConfigError, MixerConfig, option, require
from .data import DataError, check_length, token_sequences, tokenize_documents
from .files import write_json_atomic
from .surgery import model_fingerprint

ABLATION_ATTENTION = "recurformer_group_ablation"
_WINDOW = MixerConfig(kind="window")


@dataclass(frozen=True)
class AblationConfig:
    """How much calibration text the `ablation` scorer reads, and which tokens count."""

    ablation_sequences: int = option(2, "ablation scorer: calibration sequences")
    ablation_seq_len: int = option(2048, "ablation scorer: tokens per calibration sequence")
    ablation_from: int = option(1024, "ablation scorer: score the NLL of tokens at positions >= this")
    ablation_window: int = option(_WINDOW.window, "ablation scorer: the window (tokens) a group is cut to")
    ablation_sinks: int = option(_WINDOW.sinks, "ablation scorer: first tokens a windowed query still sees")

    def __post_init__(self) -> None:
        require(self.ablation_sequences >= 1, f"--ablation-sequences must be >= 1, got {self.ablation_sequences}")
        require(1 <= self.ablation_from < self.ablation_seq_len,
                f"--ablation-from must be in [1, --ablation-seq-len), got {self.ablation_from}")
        require(self.ablation_window >= 1, f"--ablation-window must be >= 1, got {self.ablation_window}")
        require(self.ablation_sinks >= 0, f"--ablation-sinks must be >= 0, got {self.ablation_sinks}")

    @property
    def tokens(self) -> int:
        """Calibration tokens needed."""
        return self.ablation_sequences * self.ablation_seq_len


def calibration_sequences(tokenizer, documents: list[str], config: AblationConfig, model_config, seed: int = 0) -> Tensor:
    """`[N, T]` calibration tokens for `ablation_costs`, drawn with `seed`; a one-line error
    saying how many tokens are needed when the documents are too short."""
    check_length(config.ablation_seq_len, model_config)
    _check_window(model_config, config.ablation_seq_len)
    ids = tokenize_documents(tokenizer, documents)
    if len(ids) < config.tokens:
        raise DataError(f"the ablation scorer needs {config.ablation_sequences} x {config.ablation_seq_len} = "
                        f"{config.tokens} tokens of calibration text, the data has {len(ids)}")
    return token_sequences(tokenizer, documents, config.ablation_seq_len, config.ablation_sequences, seed)


# The layer being ablated and, per batch row, the KV group it windows; None outside a run.
_target: tuple[int, Tensor, int, int] | None = None  # (layer, groups per row [B], window, sinks)


def window_mask(length: int, window: int, sinks: int, device=None) -> Tensor:
    """`[T, T]` bool, True where query i may see key j: j <= i and (i - j < window or j < sinks)."""
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None]
    return (j <= i) & ((i - j < window) | (j < sinks))


def _ablation_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Causal attention; in the target layer, row b's KV group `groups[b]` is windowed.

    query `[B, H, T, D]`, key/value `[B, Hkv, T, D]` -> output `[B, T, H, D]`, None.
    Sequences are packed text without padding, so the mask is plain causal.
    """
    size = module.num_key_value_groups
    out = F.scaled_dot_product_attention(query, repeat_kv(key, size), repeat_kv(value, size), is_causal=True,
                                         scale=scaling)
    if _target is not None and module.layer_idx == _target[0]:
        _, groups, window, sinks = _target
        rows = torch.arange(query.shape[0], device=query.device)
        heads = groups[:, None] * size + torch.arange(size, device=query.device)  # [B, size]
        q = query[rows[:, None], heads]  # [B, size, T, D]
        k, v = key[rows, groups][:, None], value[rows, groups][:, None]  # [B, 1, T, D]
        mask = window_mask(query.shape[2], window, sinks, query.device)
        windowed = F.scaled_dot_product_attention(q, k.expand_as(q), v.expand_as(q), attn_mask=mask, scale=scaling)
        out = out.clone()
        out[rows[:, None], heads] = windowed
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ABLATION_ATTENTION, _ablation_attention)


def _check_window(config, seq_len: int) -> None:
    """Refuse a model whose own sliding window is shorter than the calibration sequences."""
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < seq_len:
        raise ConfigError(f"ablation: the model has a sliding window of {window} tokens, shorter than the "
                          f"{seq_len}-token calibration sequences; use --ablation-seq-len <= {window}")


def _token_nll(model, hidden: Tensor, tokens: Tensor, start: int, chunk: int = 256) -> Tensor:
    """Mean NLL per row `[B]` of tokens[:, start:] predicted from hidden `[B, T, d]` (last layer's output)."""
    total = torch.zeros(hidden.shape[0], dtype=torch.float64)
    for first in range(start - 1, tokens.shape[1] - 1, chunk):
        last = min(first + chunk, tokens.shape[1] - 1)
        logits = model.lm_head(model.model.norm(hidden[:, first:last])).float()  # [B, C, V]
        nll = F.cross_entropy(logits.transpose(1, 2), tokens[:, first + 1:last + 1], reduction="none")  # [B, C]
        total += nll.double().sum(1)
    return total / (tokens.shape[1] - start)


def _run_layers(model, hidden: Tensor, first: int, last: int, position_embeddings, positions: Tensor) -> Tensor:
    """Decoder layers `first..last-1` on hidden `[B, T, d]`."""
    for layer in model.model.layers[first:last]:
        out = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=position_embeddings)
        hidden = out[0] if isinstance(out, tuple) else out
    return hidden


def _checkpoint_key(model, tokens: Tensor, config: AblationConfig) -> dict:
    """What a checkpoint's costs depend on: the model's fingerprint, the tokens and the settings."""
    return {"fingerprint": model_fingerprint(model), "tokens": hashlib.sha256(tokens.numpy().tobytes()).hexdigest()[:16],
            "shape": list(tokens.shape), **asdict(config)}


def _load_checkpoint(path: Path | None, key: dict) -> dict[tuple[int, int], float]:
    if path is None or not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if data.get("key") != key:
        raise ConfigError(f"ablation checkpoint {path} was written for other settings or another model; delete it")
    return {(c["layer"], c["kv_head"]): float(c["cost"]) for c in data["costs"]}


@torch.no_grad()
def ablation_costs(
    model,
    tokens: Tensor,
    config: AblationConfig = AblationConfig(),
    groups_per_batch: int | None = None,
    checkpoint: str | Path | None = None,
    progress: bool = True,
) -> tuple[list[list[float]], float]:
    """Cost of windowing each KV group alone, `[layers][kv_heads]` (NLL nats), and the base NLL.

    tokens `[N, T]` calibration sequences; `groups_per_batch` groups of one layer per pass
    (default: all of the layer's groups). With `checkpoint`, each finished layer is written
    there and a later call on the same model, tokens and settings skips it.
    """
    global _target
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    count, length = tokens.shape
    _check_window(model.config, length)
    require(config.ablation_from < length, f"--ablation-from {config.ablation_from} must be < the sequence length {length}")
    per_batch = groups_per_batch or kv_heads
    checkpoint = Path(checkpoint) if checkpoint is not None else None
    key = _checkpoint_key(model, tokens, config)
    done = _load_checkpoint(checkpoint, key)
    previous = model.config._attn_implementation
    model.config._attn_implementation = ABLATION_ATTENTION
    try:
        model.eval()
        positions = torch.arange(length)[None]
        hidden = model.model.embed_tokens(tokens)
        position_embeddings = model.model.rotary_emb(hidden, positions)
        inputs = []  # inputs[l]: layer l's input [N, T, d]
        for layer in range(layers):
            inputs.append(hidden)
            hidden = _run_layers(model, hidden, layer, layer + 1, position_embeddings, positions)
        base = _token_nll(model, hidden, tokens, config.ablation_from).mean().item()
        for layer in tqdm(range(layers), desc="ablation", unit="layer", disable=not progress):
            todo = [g for g in range(kv_heads) if (layer, g) not in done]
            for first in range(0, len(todo), per_batch):
                chosen = todo[first:first + per_batch]
                rows = torch.tensor(chosen).repeat_interleave(count)  # row r windows chosen[r // N]
                _target = (layer, rows, config.ablation_window, config.ablation_sinks)
                try:
                    out = _run_layers(model, inputs[layer].repeat(len(chosen), 1, 1), layer, layers,
                                      tuple(p.expand(len(rows), *p.shape[1:]) for p in position_embeddings), positions)
                finally:
                    _target = None
                nll = _token_nll(model, out, tokens.repeat(len(chosen), 1), config.ablation_from).view(len(chosen), count)
                for g, value in zip(chosen, nll.mean(1).tolist()):
                    done[(layer, g)] = value - base
            if checkpoint is not None and todo:
                write_json_atomic(checkpoint, {"key": key, "costs": [
                    {"layer": l, "kv_head": g, "cost": c} for (l, g), c in sorted(done.items())]})
    finally:
        _target = None
        model.config._attn_implementation = previous
    return [[done[(l, g)] for g in range(kv_heads)] for l in range(layers)], base

