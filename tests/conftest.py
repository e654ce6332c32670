"""Shared fixtures; the tiny models themselves are built in tiny_models.py."""

import pytest
from tiny_models import ARCHITECTURES

from recurformer.ops import kernels


@pytest.fixture(params=sorted(ARCHITECTURES))
def arch(request):
    return request.param


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
