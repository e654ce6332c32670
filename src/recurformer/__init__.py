"""recurformer: replace recency-aware attention heads with Mamba blocks.

Public API only; see the README and docs/ for the method and our decisions.
"""

from .config import ConfigError, MixerConfig
from .mixers import MambaMixer, Mixer, build_mixer
from .ops.selective_scan import selective_scan

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "MixerConfig",
    "MambaMixer",
    "Mixer",
    "build_mixer",
    "selective_scan",
    "__version__",
]
