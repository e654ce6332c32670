"""Shared fixtures; the tiny models themselves are built in tiny_models.py."""

import os

# No test reaches the Hugging Face hub: a hub id resolves from the cache or fails at once.
# Set before transformers and huggingface_hub are imported, which read it at import.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
from tiny_models import ARCHITECTURES  # noqa: E402


@pytest.fixture(params=sorted(ARCHITECTURES))
def arch(request):
    return request.param
