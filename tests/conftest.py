"""Shared fixtures; the tiny models themselves are built in tiny_models.py."""

import os

# No test reaches the Hugging Face hub: a hub id resolves from the cache or fails at once.
# Set before transformers and huggingface_hub are imported, which read it at import.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from tiny_models import ARCHITECTURES  # noqa: E402

from recurformer.ops import kernels


@pytest.fixture(params=sorted(ARCHITECTURES))
def arch(request):
    return request.param


# Tests marked `cuda` need a CUDA GPU: skipped without one (CI), run by `make gpu-check`.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (make gpu-check)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=DEVICES)
def device(request):
    """Each test that takes it runs on the CPU, and on the GPU where there is one."""
    return torch.device(request.param)


@pytest.fixture(scope="session")
def compiled():
    """The compiled kernels, built once per test session (or found in the build cache);
    skips when there is no C++ compiler or RECURFORMER_KERNELS=torch. With a compiler, a
    build that fails is a test failure, not a skip."""
    if kernels.mode() == "torch":
        pytest.skip("RECURFORMER_KERNELS=torch")
    try:
        kernels.compiler()
    except kernels.BuildError as error:
        pytest.skip(str(error))
    lib = kernels.library()
    assert lib is not None, "the compiled kernels did not build (see the notice on stderr)"
    return lib
