"""The benchmark scripts, in rooms: `speed/`, `quality/`, `long_context/`, `retrieval/`,
`peers/` (docs/benchmarks.md lists every script and what it writes). Each runs from the
repository root as a module, e.g. `python -m benchmarks.speed.bench`."""
