"""Benchmark scripts; see docs/benchmarks.md."""
