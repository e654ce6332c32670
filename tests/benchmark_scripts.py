"""Import a script of `benchmarks/` as the module it is when run (`python -m
benchmarks.<room>.<name>`), with the repository root on `sys.path` while it is in use."""

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def benchmark_script(name: str) -> Iterator[ModuleType]:
    """The module `benchmarks.<name>` (`name`: `room.script`, e.g. `speed.bench`)."""
    sys.path.insert(0, str(ROOT))
    try:
        yield importlib.import_module(f"benchmarks.{name}")
    finally:
        sys.path.remove(str(ROOT))
