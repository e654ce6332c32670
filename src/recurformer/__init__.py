"""recurformer: replace recency-aware attention heads with recurrent (or windowed) mixers.

Importing the package registers the `recurformer` model type with transformers' Auto
classes, so `AutoModelForCausalLM.from_pretrained(dir)` loads a converted model.
"""

from .cache import HybridCache
from .config import ConfigError, ReplacementSpec
from .errors import RecurformerError
from .hub import resolve_model
from .mixers import (HeadShape, Mamba2Mixer, MambaMixer, Mixer, MixerConfig, WindowMixer, WindowRecurrentMixer,
                     build_mixer)
from .modeling import RecurFormerConfig, RecurFormerForCausalLM
from .ops.selective_scan import selective_scan
from .ops.ssd import ssd
from .scoring import HeadScores, analyze, make_scorer, select_heads
from .surgery import convert, parameter_report

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "HeadScores",
    "HeadShape",
    "HybridCache",
    "Mamba2Mixer",
    "MambaMixer",
    "Mixer",
    "MixerConfig",
    "RecurFormerConfig",
    "RecurFormerForCausalLM",
    "RecurformerError",
    "ReplacementSpec",
    "WindowMixer",
    "WindowRecurrentMixer",
    "analyze",
    "build_mixer",
    "convert",
    "make_scorer",
    "parameter_report",
    "resolve_model",
    "select_heads",
    "selective_scan",
    "ssd",
    "__version__",
]
