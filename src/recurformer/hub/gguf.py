"""The offline route's second half: a GGUF checkpoint read and dequantized by transformers.

transformers reads the GGUF file (`from_pretrained(dir, gguf_file=...)`, which needs the
`gguf` package) and dequantizes every tensor to float32; the tokenizer comes from the same
file.
"""

from __future__ import annotations

import importlib.util
import io
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from .pypi import say
from .registry import ModelResolutionError


@contextmanager
def quiet_loading(progress: bool) -> Iterator[None]:
    """Without `progress`, no progress bars while transformers loads: its own bars are
    switched off through its logging API, and the GGUF dequantization bar (a bare tqdm on
    stderr) writes into a discarded buffer."""
    if progress:
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with redirect_stderr(io.StringIO()):
            yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def load_gguf(path: Path, progress: bool):
    """(model in float32, tokenizer) read from the GGUF file at `path`."""
    if importlib.util.find_spec("gguf") is None:
        raise ModelResolutionError(
            "the 'gguf' package is needed to convert the downloaded model: pip install 'recurformer[gguf]'"
        )
    say(progress, f"converting {path.name} (dequantizing to float32)")
    with quiet_loading(progress):
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model, tokenizer
