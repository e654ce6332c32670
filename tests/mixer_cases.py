"""Small mixers of every kind, and rotary embeddings for them, shared by the mixer tests."""

from __future__ import annotations

import torch

from recurformer.mixers import MIXER_KINDS, HeadShape, MixerConfig, build_mixer

D_IN = 24
HEADS = HeadShape(num_q_heads=4, num_kv_heads=2, head_dim=8)

# Windows shorter than the test sequences, so that the ring buffer wraps.
CONFIGS = {
    "mamba-naive": MixerConfig(kind="mamba", d_state=8, scan_backend="naive"),
    "mamba-torch": MixerConfig(kind="mamba", d_state=8, scan_backend="torch"),
    "mamba2-naive": MixerConfig(kind="mamba2", scan_backend="naive"),
    "mamba2-torch": MixerConfig(kind="mamba2", ssd_chunk=8, scan_backend="torch"),
    "mamba2-gate-only": MixerConfig(kind="mamba2", ssd_state=5, ssd_norm=False, ssd_chunk=8),
    "window": MixerConfig(kind="window", window=6, sinks=2),
    "window-no-sinks": MixerConfig(kind="window", window=5, sinks=0),
    "window+mamba2": MixerConfig(kind="window+mamba2", window=6, sinks=2, ssd_chunk=8),
    "window+mamba": MixerConfig(kind="window+mamba", window=5, sinks=0, d_state=8),
    "window+linear": MixerConfig(kind="window+linear", window=6, sinks=2, feature_dim=5),
    "window+linear-no-sinks": MixerConfig(kind="window+linear", window=4, sinks=0),
}
# Every registered kind without a case above gets one, in its default shape at test sizes.
CONFIGS |= {kind: MixerConfig(kind=kind, window=6, sinks=2, ssd_chunk=8, feature_dim=5)
            for kind in MIXER_KINDS if kind not in {c.kind for c in CONFIGS.values()}}


def make_mixer(case: str, heads: HeadShape = HEADS, seed: int = 0):
    """The mixer of `case`, with its decays, skips and gates (window+*) randomized so that
    they matter."""
    torch.manual_seed(seed)
    mixer = build_mixer(D_IN, heads, CONFIGS[case])
    with torch.no_grad():
        for module in mixer.modules():
            if hasattr(module, "A_log"):
                module.D.normal_()
                module.A_log.add_(torch.randn_like(module.A_log) * 0.3)
        if hasattr(mixer, "gate"):
            mixer.gate.normal_()
        if hasattr(mixer, "feature_map"):
            mixer.feature_map.normal_()
    return mixer


def rope(positions: torch.Tensor, head_dim: int = HEADS.head_dim, base: float = 10000.0):
    """Llama's rotary (cos, sin) `[B, T, head_dim]` for integer `positions` `[B, T]`."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions[..., None].float() * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def positions_for(batch: int, length: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + length).expand(batch, length)
