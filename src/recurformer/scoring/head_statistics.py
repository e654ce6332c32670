"""Head statistics on real text: `analyze` (the recency ratios and sink mass of every head) and
`analyze_text` (with, for the scorers that need them, the groups' ablation costs).

**[paper]** A head is recency aware when its attention mass sits on the last few tokens:

    RR_h(w) = mean over queries i of  sum_{j : i-w < j <= i} A_h[i, j]

**[ours]** Besides RR at the chosen window `w` (default 16) we report w = 4 and 64, the
sink mass (attention on the first token, mean over queries) and the sink-excluded
recency ratio (the same sum without token 0, renormalized by the mass off the sink `1 - A[i, 0]`, over queries
i >= 1): a head that parks its mass on the first token is not local, and a high sink mass
would otherwise hide that. All queries count, including the first `w` (for which the
window covers the whole prefix), exactly as in the formula above.

Statistics are accumulated while the model runs, one layer's attention at a time: an
attention function (`attention_hook`) computes the softmax probabilities of the layer, adds
their band sums to running totals, and returns the same output eager attention would.
KV-group scores are the mean over the group's query heads.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers.models.llama.modeling_llama import repeat_kv

from ..ablation import Ablation, AblationConfig, calibration_sequences, measure_ablation
from ..attention_hook import attention_hook
from ..config import ConfigError, option, require
from ..data import check_length, token_sequences
from ..device import to_model
from ..retrieval_probe import probe_sequences
from ..surgery import model_fingerprint
from .head_scores import HeadScores

DEFAULT_WINDOWS = (4, 16, 64)


def uniform_recency_ratio(length: int, window: int) -> float:
    """RR(w) of a head attending uniformly to its causal prefix over `length` tokens: the
    floor a recency-aware head must beat (query i puts min(i, w) / i of its mass in the window)."""
    return statistics.fmean(min(i, window) / i for i in range(1, length + 1))


class RecencyStatistics:
    """Running sums of the statistics, per layer and query head.

    `add(layer, probs)` takes one layer's attention probabilities `[B, H, T, T]` (causal,
    rows summing to 1) on any device, and adds each sequence's per-head means to the sums,
    kept on the host.
    """

    def __init__(self, num_layers: int, num_heads: int, windows: tuple[int, ...]):
        self.windows = tuple(sorted(set(windows)))
        self.sums = {name: torch.zeros(num_layers, num_heads, dtype=torch.float64) for name in self.names()}
        self.sequences = [0] * num_layers

    def names(self) -> list[str]:
        return ["sink"] + [f"rr_{w}" for w in self.windows] + [f"rr_{w}_no_sink" for w in self.windows]

    @torch.no_grad()
    def add(self, layer: int, probs: Tensor) -> None:
        batch, _, length, _ = probs.shape
        probs = probs.float()
        sink = probs[..., :, 0]  # [B, H, T]
        # The mass off the sink, summed directly: 1 - A[i, 0] cancels badly when A[i, 0] ~ 1.
        rest = probs[..., 1:, 1:].sum(-1).clamp_min(torch.finfo(probs.dtype).tiny)  # [B, H, T-1]
        first = torch.arange(length, device=probs.device)
        # band[..., i] = sum over 0 < j <= i, j > i - d of A[i, j], grown one diagonal at a time.
        # The sink (column 0) is kept out and added back where the window covers it: summing
        # it in and subtracting it later would cancel catastrophically when A[i, 0] ~ 1.
        band = torch.zeros_like(sink)
        for d in range(max(self.windows)):
            if d + 1 < length:
                band[..., d + 1:] += torch.diagonal(probs, offset=-d, dim1=-2, dim2=-1)[..., 1:]
            if d + 1 in self.windows:
                w = d + 1
                with_sink = band + sink * (first < w)
                self.sums[f"rr_{w}"][layer] += with_sink.mean(-1).sum(0).double().cpu()
                if length > 1:
                    self.sums[f"rr_{w}_no_sink"][layer] += (band[..., 1:] / rest).mean(-1).sum(0).double().cpu()
        self.sums["sink"][layer] += sink.mean(-1).sum(0).double().cpu()
        self.sequences[layer] += batch

    def means(self) -> dict[str, list[list[float]]]:
        counts = torch.tensor(self.sequences, dtype=torch.float64).clamp_min(1)[:, None]
        return {name: (total / counts).tolist() for name, total in self.sums.items()}


def stats_attention(stats: RecencyStatistics, module, query, key, value, attention_mask, scaling, dropout=0.0,
                    **kwargs):
    """Eager causal attention that also feeds `stats` (bound with `functools.partial`).

    query `[B, H, T, D]`, key/value `[B, Hkv, T, D]` -> output `[B, T, H, D]`, None.
    Sequences are packed text without padding, so the mask is plain causal.
    """
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)).float() * scaling
    length = scores.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=scores.device).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    stats.add(module.layer_idx, probs)
    output = torch.matmul(probs.to(value.dtype), value)
    return output.transpose(1, 2).contiguous(), None



@torch.no_grad()
def analyze(
    model,
    sequences: Tensor,
    window: int = 16,
    windows: tuple[int, ...] = DEFAULT_WINDOWS,
    batch_size: int = 1,
    model_name: str = "",
    data: list[str] | None = None,
    progress: bool = True,
) -> HeadScores:
    """Run `model` over `sequences` `[N, T]` and return its per-head statistics."""
    if window < 1:
        raise ConfigError(f"window must be >= 1, got {window}")
    config = model.config
    stats = RecencyStatistics(config.num_hidden_layers, config.num_attention_heads, tuple(windows) + (window,))
    model.eval()
    with attention_hook(model, partial(stats_attention, stats)):
        for start in tqdm(range(0, len(sequences), batch_size), desc="analyze", unit="batch", disable=not progress):
            model(*to_model(model, sequences[start:start + batch_size]), use_cache=False)
    return HeadScores(
        model=model_name, num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, window=window, windows=sorted(set(windows) | {window}),
        sequences=len(sequences), seq_len=sequences.shape[1], heads=stats.means(), data=list(data or []),
    )


@dataclass(frozen=True)
class AnalysisConfig:
    """How much text `analyze` reads, and the window of the recency ratio that ranks groups."""

    window: int = option(16, "recency window w (tokens) of the ratio that ranks the groups",
                         flag="--recency-window", aliases=("--window",), metavar="W")
    sequences: int = option(32, "number of sequences to score")
    seq_len: int = option(1024, "tokens per sequence")
    batch_size: int = option(1, "sequences per forward pass")

    def __post_init__(self) -> None:
        for name in ("window", "sequences", "seq_len", "batch_size"):
            value = getattr(self, name)
            flag = "--recency-window" if name == "window" else f"--{name.replace('_', '-')}"
            require(value >= 1, f"{flag} must be >= 1, got {value}")


def analyze_text(model, tokenizer, documents: list[str], config: AnalysisConfig, seed: int = 0, model_name: str = "",
                 data: list[str] | None = None, ablation: AblationConfig | None = None,
                 checkpoint: str | Path | None = None, probes: tuple[str, ...] = ("text",)) -> HeadScores:
    """Score every head of `model` on `config.sequences` x `config.seq_len` tokens of
    `documents`, drawn with `seed`; the scores record the model's fingerprint. With
    `ablation`, also each group's cost on each of `probes`: `text`, its `ablation` cost;
    `retrieval`, its `ablation_retrieval` cost, the same windowing measured on the answers
    of the retrieval probe built in the calibration text (`retrieval_probe.py`). Each probe
    resumes through its own checkpoint (`ablation_checkpoints`)."""
    check_length(config.seq_len, model.config)
    tokens = token_sequences(tokenizer, documents, config.seq_len, config.sequences, seed)
    calibration = None if ablation is None else calibration_sequences(tokenizer, documents, ablation, model.config, seed)
    scores = analyze(model, tokens, window=config.window, windows=DEFAULT_WINDOWS, batch_size=config.batch_size,
                     model_name=model_name, data=data)
    scores.fingerprint = model_fingerprint(model)
    if ablation is not None:
        for probe, resume in zip(probes, ablation_checkpoints(checkpoint, probes)):
            tokens, counted = calibration, None
            if probe == "retrieval":
                vocabulary = " ".join(tokenizer.batch_decode(calibration))
                tokens, counted = probe_sequences(tokenizer, calibration, vocabulary, seed)
            result = measure_ablation(model, tokens, ablation, checkpoint=resume, counted=counted)
            record_ablation(scores, result, ablation, probe)
    return scores


def ablation_checkpoints(checkpoint: str | Path | None, probes: tuple[str, ...]) -> list[Path | None]:
    """Where each probe's ablation resumes from: `checkpoint` for the first, beside it
    (`NAME.retrieval.json`) for the others."""
    if checkpoint is None:
        return [None] * len(probes)
    path = Path(checkpoint)
    return [path if i == 0 else path.with_suffix(f".{probe}{path.suffix}") for i, probe in enumerate(probes)]


def record_ablation(scores: HeadScores, result: Ablation, config: AblationConfig, probe: str = "text") -> None:
    """Put `result` into `scores`: the group statistics `ablation` (round 0's single costs;
    `ablation_retrieval` when measured on the retrieval `probe`) and, after more than one
    round, `ablation_order` and `ablation_marginal`; the settings, the probe, the base NLL of
    each round and the seconds under `scores.ablation` (after a second probe: both probes'
    names, its base NLL as `PROBE_base_nll` and the seconds of both)."""
    scores.groups["ablation" if probe == "text" else "ablation_retrieval"] = result.costs
    earlier = scores.ablation.get("probe")
    if earlier is not None and probe not in earlier.split("+"):
        scores.ablation = {**scores.ablation, "probe": f"{earlier}+{probe}", f"{probe}_base_nll": result.base[0],
                           "seconds": scores.ablation["seconds"] + sum(result.seconds)}
        return
    if config.ablation_rounds > 1:
        scores.groups["ablation_order"] = [[float(o) for o in row] for row in result.order]
        scores.groups["ablation_marginal"] = result.marginal
    scores.ablation = {**asdict(config), "probe": probe, "base_nll": result.base[0], "seconds": sum(result.seconds),
                       **({"round_base_nll": result.base, "round_seconds": result.seconds}
                          if config.ablation_rounds > 1 else {})}


