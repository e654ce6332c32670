"""`benchmarks/long_context/passkey_heatmap.py`: passkey results read, checked and counted per cell."""

import json

import pytest
from benchmark_scripts import benchmark_script


@pytest.fixture(scope="module")
def heatmap():
    with benchmark_script("long_context.passkey_heatmap") as module:
        yield module


def result(model, context, cells):
    return {"model": model, "task": "passkey", "context": context,
            "cells": [{"context": context, "depth": d, "n": n, "accuracy": a} for d, n, a in cells]}


def test_cells_are_counted_per_model_context_and_depth(heatmap, tmp_path):
    files = {
        "a-1k.json": result("a", 1024, [(0.1, 3, 1.0), (0.9, 3, 1 / 3)]),
        "a-2k.json": result("a", 2048, [(0.1, 3, 0.0)]),
        "b-1k.json": result("b", 1024, [(0.1, 2, 0.5)]),
        "b-1k-more.json": result("b", 1024, [(0.1, 3, 2 / 3)]),  # the same cell again: counts add
    }
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
    out = tmp_path / "heatmap.png"
    assert heatmap.main([*(str(tmp_path / n) for n in files), "--out", str(out)]) == 0
    assert out.stat().st_size > 0
    grid = heatmap.grids({m: [heatmap.read_result(tmp_path / n) for n in files if n.startswith(m)] for m in "ab"})
    assert grid["a"] == {(1024, 0.1): (3, 3), (1024, 0.9): (1, 3), (2048, 0.1): (0, 3)}
    assert grid["b"] == {(1024, 0.1): (3, 5)}


@pytest.mark.parametrize("content, message", [(None, "no such file"), ("{", "not JSON"),
                                              ('{"task": "ppl"}', "not the output")])
def test_a_missing_or_malformed_file_is_one_line_error(heatmap, tmp_path, content, message):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    out = tmp_path / "h.png"
    with pytest.raises(SystemExit, match=message):
        heatmap.main([str(path), "--out", str(out)])
    assert not out.exists()
