"""Which KV groups to replace, from statistics of the model's heads on real text.

`head_statistics.py` measures them (`analyze`, `analyze_text`), `head_scores.py` holds and
stores them (`HeadScores`), `scorers.py` ranks the groups (each scorer says what it needs
measured), `selection.py` takes the top `beta` fraction (`SelectionConfig`).
"""

from .head_scores import HeadScores
from .head_statistics import (AnalysisConfig, RecencyStatistics, analyze, analyze_text, record_ablation, stats_attention,
                              uniform_recency_ratio)
from .scorers import SCORERS, Needs, Scorer, make_scorer
from .selection import SelectionConfig, select_heads, select_layers

__all__ = [
    "SCORERS",
    "AnalysisConfig",
    "HeadScores",
    "Needs",
    "RecencyStatistics",
    "Scorer",
    "SelectionConfig",
    "analyze",
    "analyze_text",
    "make_scorer",
    "record_ablation",
    "select_heads",
    "select_layers",
    "stats_attention",
    "uniform_recency_ratio",
]
