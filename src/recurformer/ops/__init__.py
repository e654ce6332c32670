"""Numeric kernels. Every fast op has a naive twin with the same signature (the oracle)."""
