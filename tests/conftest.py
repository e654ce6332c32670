"""Shared fixtures; the tiny models themselves are built in tiny_models.py."""

import pytest
from tiny_models import ARCHITECTURES


@pytest.fixture(params=sorted(ARCHITECTURES))
def arch(request):
    return request.param
