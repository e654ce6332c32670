"""[ours] What replacing KV groups by a sliding window costs: the `ablation` and
`ablation-greedy` scorers' numbers.

A windowed group's query heads attend only to

    { j <= i :  i - j < window  or  j < sinks }

(exactly what the training-free `window` mixer computes with the same q/k/v weights and
RoPE), and a cost is an increase of the mean next-token NLL over the tokens at positions
>= `ablation_from` of each calibration sequence. Round 0 scores every group alone:

    cost(l, g) = NLL(group (l, g) windowed) - NLL(original)

Single costs do not add up (windowing many cheap groups together costs far more than the
sum), so with `ablation_rounds = k` the groups are chosen greedily in k rounds: round r
windows the cheapest groups of the rounds before it, `S_r`, the first
`floor(r / k * N + 1/2)` groups (the count `select` takes at beta = r / k), and scores every
remaining group with them windowed,

    marginal_r(l, g) = NLL(S_r and (l, g) windowed) - NLL(S_r windowed).

The last round ranks all remaining groups. A group's `order` (0 = replaced first) is the
chain these rounds build, so the top-beta set of any beta contains that of every smaller
beta; at beta = r / k it is exactly `S_r`, between two boundaries it is `S_r` plus the
cheapest of round r's marginal costs.

The model is never converted. One pass (with `S_r` windowed) stores every layer's input
hidden states; scoring a group of layer `l` reruns only layers `l..L-1` from there. The
groups of one layer (and all sequences) go through together as batch rows: row `b` also
windows group `groups[b // N]`, the attention function `Windowing.attention` (run through
`attention_hook`) windows just those query heads (with `ops.window`, the window mixer's own kernel). Each
finished layer of a round can be written to a checkpoint file, so that an interrupted run
resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm
from transformers.models.llama.modeling_llama import repeat_kv

from .attention_hook import attention_hook
from .config import ConfigError, groups_to_replace, option, require
from .data import DataError, check_length, count_tokens, token_sequences
from .device import to_model
from .files import write_json_atomic
from .mixers import MixerConfig
from .ops.window import window_attention
from .surgery import model_fingerprint

Group = tuple[int, int]  # (layer, kv_head)


@dataclass(frozen=True)
class AblationConfig:
    """How much calibration text the ablation scorers read, which tokens count, and how many
    greedy rounds `ablation-greedy` takes."""

    ablation_sequences: int = option(2, "ablation scorers: calibration sequences")
    ablation_seq_len: int = option(2048, "ablation scorers: tokens per calibration sequence")
    ablation_from: int = option(1024, "ablation scorers: score the NLL of tokens at positions >= this")
    # [ours] a group's cost of being cut to 64 tokens ranks the groups for any mixer (docs/analysis.md)
    ablation_window: int = option(64, "ablation scorers: the window (tokens) a group is cut to")
    ablation_sinks: int = option(MixerConfig.sinks, "ablation scorers: first tokens a windowed query still sees")
    ablation_rounds: int = option(4, "ablation-greedy scorer: rounds; round r windows the cheapest groups up to "
                                  "beta = r / rounds and re-scores the rest with them windowed")

    def __post_init__(self) -> None:
        require(self.ablation_sequences >= 1, f"--ablation-sequences must be >= 1, got {self.ablation_sequences}")
        require(1 <= self.ablation_from < self.ablation_seq_len,
                f"--ablation-from must be in [1, --ablation-seq-len), got {self.ablation_from}")
        require(self.ablation_window >= 1, f"--ablation-window must be >= 1, got {self.ablation_window}")
        require(self.ablation_sinks >= 0, f"--ablation-sinks must be >= 0, got {self.ablation_sinks}")
        require(self.ablation_rounds >= 1, f"--ablation-rounds must be >= 1, got {self.ablation_rounds}")

    @property
    def tokens(self) -> int:
        """Calibration tokens needed."""
        return self.ablation_sequences * self.ablation_seq_len


@dataclass
class Ablation:
    """What `measure_ablation` found, per group `[layers][kv_heads]`: `costs`, round 0's cost
    of windowing the group alone; `order`, when the rounds replace it (0 first); `marginal`,
    its cost in the round that ranked it. Per round r: `base[r]`, the NLL with `S_r` windowed
    (`base[0]`: the original model's), and `seconds[r]` (this call's part of the round)."""

    costs: list[list[float]]
    order: list[list[int]]
    marginal: list[list[float]]
    base: list[float]
    seconds: list[float]


def calibration_sequences(tokenizer, documents: list[str], config: AblationConfig, model_config, seed: int = 0) -> Tensor:
    """`[N, T]` calibration tokens for `measure_ablation`, drawn with `seed`; a one-line error
    saying how many tokens are needed when the documents are too short."""
    check_ablation(config, model_config)
    check_calibration_text(tokenizer, documents, config)
    return token_sequences(tokenizer, documents, config.ablation_seq_len, config.ablation_sequences, seed)


def check_ablation(config: AblationConfig, model_config) -> None:
    """What `measure_ablation` refuses that the model's config already shows: calibration
    sequences beyond its positions or its own sliding window, more greedy rounds than it has
    KV groups (`config`: the ablation as measured, `Needs.measurement`)."""
    check_length(config.ablation_seq_len, model_config)
    _check_window(model_config, config.ablation_seq_len)
    _check_rounds(config.ablation_rounds, model_config.num_hidden_layers * model_config.num_key_value_heads)


def check_calibration_text(tokenizer, documents, config: AblationConfig) -> None:
    """Refuse calibration text shorter than `config.tokens` (counting no further than that)."""
    tokens = count_tokens(tokenizer, documents, limit=config.tokens)
    if tokens < config.tokens:
        raise DataError(f"the ablation scorer needs {config.ablation_sequences} x {config.ablation_seq_len} = "
                        f"{config.tokens} tokens of calibration text, the data has {tokens} (--scorer recency needs less)")


def _check_rounds(rounds: int, groups: int) -> None:
    require(rounds <= groups, f"--ablation-rounds {rounds} must be <= the model's {groups} KV groups")


@dataclass
class Windowing:
    """Which groups `attention` windows: `fixed` `[layers, kv_heads]` bool in every row, and
    in `layer`, row b's group `groups[b]` too; `point` moves it between passes."""

    fixed: Tensor
    window: int
    sinks: int
    layer: int = -1
    groups: Tensor | None = None  # [B]

    def point(self, fixed: Tensor, layer: int = -1, groups: Tensor | None = None) -> None:
        self.fixed, self.layer, self.groups = fixed, layer, groups

    def rows(self, layer: int, batch: int) -> Tensor:
        """`[B, kv_heads]` bool: the groups windowed in each row of `layer`."""
        windowed = self.fixed[layer].expand(batch, -1).clone()
        if layer == self.layer:
            windowed[torch.arange(batch), self.groups] = True
        return windowed

    def attention(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        """Causal attention, with the groups `rows` names cut to the window.

        query `[B, H, T, D]`, key/value `[B, Hkv, T, D]` -> output `[B, T, H, D]`, None.
        Sequences are packed text without padding, so the mask is plain causal. The windowed
        (row, group) pairs go through `ops.window` together, as a batch of single-group rows; which
        they are is worked out on the host (`fixed` and `groups` live there).
        """
        size = module.num_key_value_groups
        out = F.scaled_dot_product_attention(query, repeat_kv(key, size), repeat_kv(value, size), is_causal=True,
                                             scale=scaling)
        rows, groups = self.rows(module.layer_idx, query.shape[0]).nonzero(as_tuple=True)  # of [B, Hkv]
        rows, groups = rows.to(query.device), groups.to(query.device)
        if len(rows):
            q = query.unflatten(1, (-1, size))[rows, groups].transpose(1, 2)  # [n, T, size, D]
            k, v = key[rows, groups][:, :, None], value[rows, groups][:, :, None]  # [n, T, 1, D]
            cut = window_attention(q, k, v, self.window, self.sinks, scaling)
            out = out.unflatten(1, (-1, size)).index_put((rows, groups), cut.transpose(1, 2)).flatten(1, 2)
        return out.transpose(1, 2).contiguous(), None


def _check_window(config, seq_len: int) -> None:
    """Refuse a model whose own sliding window is shorter than the calibration sequences."""
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < seq_len:
        raise ConfigError(f"ablation: the model has a sliding window of {window} tokens, shorter than the "
                          f"{seq_len}-token calibration sequences; use --ablation-seq-len <= {window}")


def counted_from(tokens: Tensor, start: int) -> Tensor:
    """`[N, T]` bool: the tokens at positions >= `start` of every sequence."""
    return (torch.arange(tokens.shape[1], device=tokens.device) >= start).expand(tokens.shape[0], -1)


def token_nll(model, hidden: Tensor, tokens: Tensor, counted: Tensor, chunk: int = 256) -> Tensor:
    """Mean NLL per row `[B]` of the tokens `counted` `[B, T]` (bool, never position 0) marks,
    each predicted from the hidden state `[B, T, d]` (last layer's output) of the one before it."""
    positions = counted.any(0).nonzero().squeeze(1)  # [P] positions some row counts
    total = torch.zeros(hidden.shape[0], dtype=torch.float64, device=hidden.device)
    for first in range(0, len(positions), chunk):
        at = positions[first:first + chunk]
        logits = model.lm_head(model.model.norm(hidden[:, at - 1])).float()  # [B, C, V]
        nll = F.cross_entropy(logits.transpose(1, 2), tokens[:, at], reduction="none")  # [B, C]
        total += (nll.double() * counted[:, at]).sum(1)
    return total / counted.sum(1)


def run_layers(model, hidden: Tensor, first: int, last: int, position_embeddings, positions: Tensor) -> Tensor:
    """Decoder layers `first..last-1` on hidden `[B, T, d]`."""
    for layer in model.model.layers[first:last]:
        out = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=position_embeddings)
        hidden = out[0] if isinstance(out, tuple) else out
    return hidden


def _checkpoint_key(model, tokens: Tensor, counted: Tensor | None, config: AblationConfig) -> dict:
    """What a checkpoint's costs depend on: the model's fingerprint, the tokens, which of them
    count (None: the default, `ablation_from` on) and the settings."""
    marks = b"" if counted is None else counted.cpu().numpy().tobytes()
    digest = hashlib.sha256(tokens.cpu().numpy().tobytes() + marks).hexdigest()[:16]
    return {"fingerprint": model_fingerprint(model), "tokens": digest, "shape": list(tokens.shape), **asdict(config)}


def _load_checkpoint(path: Path | None, key: dict) -> dict[int, dict[Group, float]]:
    """round -> {group: cost} scored so far."""
    if path is None or not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if data.get("key") != key:
        raise ConfigError(f"ablation checkpoint {path} was written for other settings or another model; delete it")
    done: dict[int, dict[Group, float]] = {}
    for c in data["costs"]:
        done.setdefault(c["round"], {})[(c["layer"], c["kv_head"])] = float(c["cost"])
    return done


def _score_round(model, tokens: Tensor, counted: Tensor, windowing: Windowing, fixed: Tensor, todo: list[Group],
                 costs: dict[Group, float], per_batch: int, saved: Callable[[], None], desc: str,
                 progress: bool) -> float:
    """Score each group of `todo` not yet in `costs` with the `fixed` `[layers, kv_heads]` groups
    windowed (`windowing`, the hooked attention's); fills `costs` (NLL increase over that
    base), calls `saved()` after each layer that scored any. Returns the base NLL."""
    count, length = tokens.shape
    layers = model.config.num_hidden_layers
    positions = torch.arange(length, device=tokens.device)[None]
    hidden = model.model.embed_tokens(tokens)
    position_embeddings = model.model.rotary_emb(hidden, positions)
    windowing.point(fixed)
    inputs = []  # inputs[l]: layer l's input [N, T, d]
    for layer in range(layers):
        inputs.append(hidden)
        hidden = run_layers(model, hidden, layer, layer + 1, position_embeddings, positions)
    base = token_nll(model, hidden, tokens, counted).mean().item()
    for layer in tqdm(range(layers), desc=desc, unit="layer", disable=not progress):
        left = [g for l, g in todo if l == layer and (l, g) not in costs]
        for first in range(0, len(left), per_batch):
            chosen = left[first:first + per_batch]
            rows = torch.tensor(chosen).repeat_interleave(count)  # row r windows chosen[r // N]
            windowing.point(fixed, layer, rows)
            out = run_layers(model, inputs[layer].repeat(len(chosen), 1, 1), layer, layers,
                              tuple(p.expand(len(rows), *p.shape[1:]) for p in position_embeddings), positions)
            nll = token_nll(model, out, tokens.repeat(len(chosen), 1), counted.repeat(len(chosen), 1)).view(len(chosen), count)
            for g, value in zip(chosen, nll.mean(1).tolist()):
                costs[(layer, g)] = value - base
        if left:
            saved()
    return base


@torch.no_grad()
def measure_ablation(
    model,
    tokens: Tensor,
    config: AblationConfig = AblationConfig(),
    groups_per_batch: int | None = None,
    checkpoint: str | Path | None = None,
    progress: bool = True,
    counted: Tensor | None = None,
) -> Ablation:
    """The costs and the greedy order of `config.ablation_rounds` rounds (module docstring).

    tokens `[N, T]` calibration sequences; `counted` `[N, T]` bool, the tokens whose NLL
    makes the cost (default: positions >= `config.ablation_from`; the `retrieval` probe's
    answers, `retrieval_probe.py`); `groups_per_batch` groups of one layer per pass
    (default: all of the layer's groups). With `checkpoint`, each finished layer of a round
    is written there and a later call on the same model, tokens and settings skips it.
    """
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    everything = [(l, g) for l in range(layers) for g in range(kv_heads)]
    rounds = config.ablation_rounds
    _check_rounds(rounds, len(everything))
    _check_window(model.config, tokens.shape[1])
    require(config.ablation_from < tokens.shape[1],
            f"--ablation-from {config.ablation_from} must be < the sequence length {tokens.shape[1]}")
    checkpoint = Path(checkpoint) if checkpoint is not None else None
    key = _checkpoint_key(model, tokens, counted, config)
    if counted is None:
        counted = counted_from(tokens, config.ablation_from)
    require(counted.shape == tokens.shape and counted.dtype == torch.bool and not counted[:, 0].any()
            and bool(counted.any(1).all()), "ablation: `counted` must mark, in every sequence, tokens after the first")
    tokens, counted = to_model(model, tokens, counted)
    done = _load_checkpoint(checkpoint, key)

    def saved() -> None:
        if checkpoint is not None:
            write_json_atomic(checkpoint, {"key": key, "costs": [
                {"round": r, "layer": l, "kv_head": g, "cost": c}
                for r in sorted(done) for (l, g), c in sorted(done[r].items())]})

    chosen: list[Group] = []  # S_r, in replacement order
    marginal: dict[Group, float] = {}
    base, seconds = [], []
    windowing = Windowing(torch.zeros(layers, kv_heads, dtype=torch.bool), config.ablation_window, config.ablation_sinks)
    model.eval()
    with attention_hook(model, windowing.attention):
        for r in range(rounds):
            start = time.perf_counter()
            fixed = torch.zeros(layers, kv_heads, dtype=torch.bool)
            for l, g in chosen:
                fixed[l, g] = True
            todo = [g for g in everything if g not in marginal]
            costs = done.setdefault(r, {})
            desc = "ablation" if rounds == 1 else f"ablation round {r + 1}/{rounds}"
            base.append(_score_round(model, tokens, counted, windowing, fixed, todo, costs, groups_per_batch or kv_heads,
                                     saved, desc, progress))
            seconds.append(time.perf_counter() - start)
            take = len(todo) if r == rounds - 1 else groups_to_replace(len(everything), (r + 1) / rounds) - len(chosen)
            for group in sorted(todo, key=lambda g: (costs[g], g))[:take]:
                chosen.append(group)
                marginal[group] = costs[group]
    order = {g: i for i, g in enumerate(chosen)}
    return Ablation(costs=[[done[0][(l, g)] for g in range(kv_heads)] for l in range(layers)],
                    order=[[order[(l, g)] for g in range(kv_heads)] for l in range(layers)],
                    marginal=[[marginal[(l, g)] for g in range(kv_heads)] for l in range(layers)],
                    base=base, seconds=seconds)
