"""The README's numbers are the numbers of the files it cites: each row of its two tables is
rebuilt here from the JSON named in the row's source column."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
RUN = "docs/results/example-run/metrics.json"
BENCH = "docs/results/bench.json"


def table_rows(heading: str) -> dict[str, list[str]]:
    """The rows of the first table after the line starting with `heading`: first cell -> cells."""
    lines = README[README.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def load(path: str) -> dict:
    return json.loads((ROOT / path).read_text())


def quality_rows(m: dict) -> dict[str, list[str]]:
    """measure -> (original, converted, window at equal bytes) as the README shows them."""
    def ppl(key: str) -> list[str]:
        o, f, b = m[f"{key}_original"], m[f"{key}_final"], m[f"{key}_baseline"]
        return [f"{o:.2f}", f"{f:.2f} ({f / o:.3f}x)", f"{b:.2f} ({b / o:.3f}x)"]
    mib = 2 ** 20
    return {
        "perplexity, held-out text": ppl("ppl"),
        "perplexity, out-of-domain text (never trained on)": ppl("ppl_ood"),
        f"perplexity beyond {m['ppl_far_from']:,} tokens (held-out, {m['ppl_far_context']:,}-token sequences)": ppl("ppl_far"),
        f"RULER mix at {m['ruler_context']:,} tokens ({m['ruler_tasks']} needle tasks x {m['ruler_problems']} problems, 0-100)":
            [f"{m['ruler_original']:.1f}", f"{m['ruler_final']:.1f}", f"{m['ruler_baseline']:.1f}"],
        f"cache at {m['bench_context']:,} tokens": [f"{m['cache_bytes_original'] / mib:.1f} MiB",
                                                    f"{m['cache_bytes_final'] / mib:.1f} MiB ({m['cache_ratio']:.3f}x)",
                                                    "same bytes"],
        f"decode tokens/s at {m['bench_context']:,} tokens":
            [f"{m['decode_tokens_per_s_original']:.1f}",
             f"{m['decode_tokens_per_s_final']:.1f} ({m['decode_speedup']:.2f}x; "
             f"{m['decode_speedup_vs_static_cache']:.2f}x against a static cache)", ""],
        "`make demo`, minutes on 2 cores": ["", f"{m['total_minutes']:.1f}", ""],
    }


def speed_rows(bench: dict) -> dict[str, list[str]]:
    """variant -> decode speed-up against the static-cache original at each context, batch 1."""
    rows = {}
    for ratio in bench["ratios"]:
        if ratio["baseline"] != "original+static-cache" or ratio.get("batch", 1) != 1:
            continue
        kind, beta = re.fullmatch(r"(.+)-beta([0-9.]+)", Path(ratio["model"]).name).groups()  # the variant's folder
        rows.setdefault(f"`{kind}`, beta {beta}", {})[ratio["context"]] = f"{ratio['decode_speedup']:.2f}x"
    return {name: [cells[c] for c in sorted(cells)] for name, cells in rows.items()}


def test_the_quality_table_is_the_example_runs_metrics():
    shown = table_rows("| measure | original | converted | window, equal bytes | source |")
    expected = quality_rows(load(RUN))
    assert set(shown) == set(expected)
    for measure, cells in expected.items():
        assert shown[measure][:3] == cells, measure
        assert shown[measure][3] == f"`{RUN}`"


def test_the_speed_table_is_the_benchmarks_ratios():
    shown = table_rows("| decode speed-up |")
    expected = speed_rows(load(BENCH))
    assert shown and set(shown) <= set(expected)
    for name, cells in shown.items():
        assert cells[:-1] == expected[name], name
        assert cells[-1] == f"`{BENCH}`"


@pytest.mark.parametrize("path", re.findall(r"`((?:docs|benchmarks|src|tests)/[^`* ]+)`", README))
def test_every_file_the_readme_names_exists(path):
    assert (ROOT / path.rstrip("/")).exists(), path
