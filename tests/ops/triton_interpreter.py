"""Running a Triton kernel's check on the CPU, through Triton's interpreter.

The interpreter is chosen when a kernel is defined (`TRITON_INTERPRET=1` at import), so a
check runs in a subprocess of its own; tests that use it are skipped where Triton is not
installed (CI)."""

import importlib.util
import os
import subprocess
import sys

import pytest

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


def worst_error(script: str) -> float:
    """Run `script` (which prints the worst relative error it found last) in the interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.split()[-1])
