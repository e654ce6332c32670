"""`MixerConfig`: the hyper-parameters of a mixer, and which mixer kinds read which of them.

The kinds are this package's modules: each registers itself (`base.register_mixer`) with
the fields it reads (`Mixer.reads`). They live beside `MixerConfig` because its check of
`kind` needs them: importing `recurformer.mixers`, the only way to reach this module,
imports and registers every kind before any `MixerConfig` can be built.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..config import ConfigError, option, require
from ..ops.backends import BACKENDS, canonical

MIXER_KINDS: list[str] = []  # filled as each mixer kind registers (base.register_mixer)
# field -> the kinds that read it, filled from each kind's `Mixer.reads` as it registers
FIELD_READERS: dict[str, list[str]] = {}
SCAN_BACKENDS = BACKENDS  # the names of ops/backends.py
STATE_DTYPES = ("float32", "bfloat16", "float16")


AUTO = "auto"  # a shape field the mixer's geometry decides (mixers/shape.py)


def parse_ssd_state(text: str) -> int | str:
    """`--ssd-state`: a positive integer, `head_dim` or `auto`."""
    if text in ("head_dim", AUTO):
        return text
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"ssd_state must be 'auto', 'head_dim' or a positive integer, got {text!r}")
    return int(text)


def parse_window(text: str) -> int | str:
    """`--window`: `auto` or an integer (`MixerConfig` checks that it is positive)."""
    if text == AUTO:
        return text
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"window must be 'auto' or a positive integer, got {text!r}") from None


def kinds_reading(name: str) -> list[str]:
    """The registered mixer kinds that read the `MixerConfig` field `name` (their `Mixer.reads`)."""
    return list(FIELD_READERS.get(name, ()))


def _is_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


@dataclass
class MixerConfig:
    """Hyper-parameters of the mixer that replaces a layer's removed heads.

    A mixer stands in for the layer's replaced query heads and emits their channels
    (`d_out = replaced query heads * head_dim`). Each mixer kind declares the fields it
    reads (`Mixer.reads`, collected in `FIELD_READERS`); the others ignore them, so a config
    of one kind never fails on another kind's field values as long as they are in range,
    and a command-line value for a field its kind does not read is an error (`from_flags`).

    `mamba` (Mamba-1 / S6): inner width `expand * d_out` ([ours]: the mixer is sized by
    what it replaces, so a layer that loses more heads gets a wider mixer).
    `mamba2` (Mamba-2 / SSD): one SSD head per replaced query head, head size `head_dim`.
    `window`: the replaced heads' own softmax attention over the last `window` tokens and
    the first `sinks` tokens. `window+mamba`, `window+mamba2`: that window plus a recurrent
    branch of the named kind added through a gate that starts at zero (see docs/mixers.md);
    they read the window's fields and the recurrent kind's fields. `window+linear`: that
    window plus a linear attention over the tokens that left it, sharing the softmax
    normalizer (LoLCATs), mixed in through a gate that starts at zero.

    `state_dtype` is the dtype of a recurrent mixer's accumulated state (the SSM state of
    `mamba`, `mamba2` and their window+ kinds, the tail sums of `window+linear`), whatever the model's dtype: fp32 by default, as in mamba-ssm's
    kernels and flash-linear-attention, because a state rounded to bf16 at every decode
    step drifts from the prefill's fp32 scan (docs/precision.md). The update is computed in
    fp32 either way. Buffers that only hold past inputs (the conv window, the `window`
    mixer's keys and values) are not accumulators: they keep the activations' dtype.
    """

    # [ours] the default is the best-measured kind, not the paper's `mamba` (docs/mixers.md)
    kind: str = option("window+mamba2", "what replaces the heads (docs/mixers.md; the paper's: mamba)", flag="--mixer",
                      choices=lambda: MIXER_KINDS)
    # "mamba" and "mamba2" below include the recurrent branch of window+mamba and window+mamba2.
    d_state: int = 16  # mamba: state size per channel
    d_conv: int = 4  # mamba, mamba2: causal conv width
    expand: float = 1.0  # mamba
    dt_rank: int | str = "auto"  # mamba; "auto": ceil(d_in / 16), as in Mamba
    dt_min: float = 1e-3  # mamba, mamba2: range of the initial step sizes
    dt_max: float = 1e-1
    dt_init_floor: float = 1e-4
    conv_bias: bool = True  # mamba, mamba2
    proj_bias: bool = False  # mamba, mamba2: biases on in_proj and out_proj
    scan_backend: str = "auto"  # every kind: which kernels run it (ops/backends.py)
    ssd_state: int | str = option(AUTO, "mamba2 kinds: state size N per head (an integer, head_dim, or auto: "
                                  "head_dim for mamba2, head_dim / 4 for window+mamba2)", parse=parse_ssd_state,
                                  metavar="N")
    ssd_chunk: int = 64  # mamba2: chunk length of the chunked scan
    ssd_norm: bool = True  # mamba2: gated RMSNorm before out_proj (as Mamba-2), else a plain SiLU gate
    window: int | str = option(AUTO, "window mixers: tokens each query attends back, itself included (auto: the "
                               "default cache budget, docs/mixers.md)", parse=parse_window, metavar="W")
    sinks: int = option(4, "window mixers: first tokens every query also attends (attention sinks)")
    feature_dim: int | str = "head_dim"  # window+linear: each half of the feature map (F = 2 feature_dim)
    state_dtype: str = option("float32", "recurrent mixers: dtype of the accumulated state (docs/precision.md)")

    def __post_init__(self) -> None:
        require(self.kind in MIXER_KINDS, f"mixer kind: unknown {self.kind!r}; choose one of {', '.join(MIXER_KINDS)}")
        require(_is_int(self.d_state, 1), f"d_state must be a positive integer, got {self.d_state!r}")
        require(_is_int(self.d_conv, 1), f"d_conv must be a positive integer, got {self.d_conv!r}")
        require(isinstance(self.expand, (int, float)) and self.expand > 0, f"expand must be > 0, got {self.expand!r}")
        require(
            self.dt_rank == "auto" or _is_int(self.dt_rank, 1),
            f"dt_rank must be 'auto' or a positive integer, got {self.dt_rank!r}",
        )
        require(0 < self.dt_min <= self.dt_max, f"need 0 < dt_min <= dt_max, got dt_min={self.dt_min!r}, dt_max={self.dt_max!r}")
        require(self.dt_init_floor > 0, f"dt_init_floor must be > 0, got {self.dt_init_floor!r}")
        self.scan_backend = canonical(self.scan_backend)
        require(self.scan_backend in SCAN_BACKENDS, f"scan_backend: unknown {self.scan_backend!r}; choose one of {', '.join(SCAN_BACKENDS)}")
        require(
            self.ssd_state in ("head_dim", AUTO) or _is_int(self.ssd_state, 1),
            f"ssd_state must be 'auto', 'head_dim' or a positive integer, got {self.ssd_state!r}",
        )
        require(_is_int(self.ssd_chunk, 1), f"ssd_chunk must be a positive integer, got {self.ssd_chunk!r}")
        require(isinstance(self.ssd_norm, bool), f"ssd_norm must be true or false, got {self.ssd_norm!r}")
        require(self.window == AUTO or _is_int(self.window, 1),
                f"window must be 'auto' or a positive integer, got {self.window!r}")
        require(_is_int(self.sinks, 0), f"sinks must be a non-negative integer, got {self.sinks!r}")
        require(
            self.feature_dim == "head_dim" or _is_int(self.feature_dim, 1),
            f"feature_dim must be 'head_dim' or a positive integer, got {self.feature_dim!r}",
        )
        require(self.state_dtype in STATE_DTYPES,
                f"state_dtype: unknown {self.state_dtype!r}; choose one of {', '.join(STATE_DTYPES)}")

    def reads(self, name: str) -> bool:
        """Whether this config's kind reads the field `name`."""
        return self.kind in FIELD_READERS.get(name, ())

    @property
    def has_window(self) -> bool:
        """Whether the kind reads `window` and `sinks`."""
        return self.reads("window")

    @classmethod
    def from_flags(cls, kind: str, **given: Any) -> "MixerConfig":
        """The config of `kind` with the command-line values `given` (None: not given); a
        value for a field that `kind` does not read is an error rather than ignored."""
        given = {name: value for name, value in given.items() if value is not None}
        config = cls(kind=kind, **given)
        for name in given:
            require(config.reads(name),
                    f"--{name.replace('_', '-')} applies to --mixer {'|'.join(kinds_reading(name))}, not --mixer {kind}")
        return config

    def inner_width(self, d_out: int) -> int:
        """Channels of the recurrence for a mixer producing `d_out` channels."""
        return max(1, round(self.expand * d_out))

    def resolved_dt_rank(self, d_in: int) -> int:
        return math.ceil(d_in / 16) if self.dt_rank == "auto" else int(self.dt_rank)

    def resolved_ssd_state(self, head_dim: int) -> int:
        """The mamba2 state size N per head; [ours] `auto`: head_dim for `mamba2`, a quarter of
        it for a window's tail (`window+mamba2`: the window holds what is recent, docs/mixers.md)."""
        if self.ssd_state == AUTO:
            return max(1, head_dim // 4) if self.has_window else head_dim
        return head_dim if self.ssd_state == "head_dim" else int(self.ssd_state)

    @property
    def resolved(self) -> bool:
        """Whether no field the kind reads is left `auto` for the geometry to decide."""
        return not any(self.reads(name) and getattr(self, name) == AUTO for name in ("window", "ssd_state"))

    def resolved_feature_dim(self, head_dim: int) -> int:
        """The window+linear feature map's half width."""
        return head_dim if self.feature_dim == "head_dim" else int(self.feature_dim)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MixerConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        require(not unknown, f"mixer config: unknown field(s) {', '.join(unknown)}")
        return cls(**data)
