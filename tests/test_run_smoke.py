"""CI smoke test: `recurformer run --quick` end to end on the real SmolLM2-135M model.

Checks the pipeline, not the numbers: every stage ran, the report and metrics are complete
and well-formed, the plots are images, and a re-run skips every finished stage.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from recurformer.data import corpora_folder
from recurformer.run import RUN_SCHEMA

pytestmark = [pytest.mark.real_model, pytest.mark.smoke]

DATA = corpora_folder().resolve()  # where `recurformer run` would look from here
STAGES = ["resolve", "analyze", "convert", "plan", "transfer", "lm", "evaluate", "bench", "report"]
PNG = b"\x89PNG\r\n\x1a\n"


def recurformer(*args):
    env = {**os.environ, "RECURFORMER_DATA": str(DATA)}
    return subprocess.run([sys.executable, "-m", "recurformer.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=900)


def test_quick_run_end_to_end(tmp_path):
    out = tmp_path / "quick"
    done = recurformer("run", "--quick", "--out", out)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wrote" in done.stdout and "report.md" in done.stdout

    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["schema"] == RUN_SCHEMA and metrics["quick"] is True
    for key in ("ppl_original", "ppl_final", "cache_ratio", "decode_speedup", "prefill_time_ratio"):
        assert isinstance(metrics[key], float) and math.isfinite(metrics[key]) and metrics[key] > 0, key
    for key in ("ppl_ood_original", "ppl_ood_final", "ppl_baseline", "ppl_ood_baseline", "ppl_far_final",
                "ppl_far_baseline", "agreement_kl_final", "agreement_kl_baseline"):
        assert isinstance(metrics[key], float) and math.isfinite(metrics[key]) and metrics[key] >= 0, key
    for key in ("hashhop_original", "hashhop_final", "mqar_original", "mqar_final", "agreement_top1_final"):
        assert 0.0 <= metrics[key] <= 1.0, key
    for key in ("ruler_original", "ruler_final", "ruler_baseline"):  # RULER's scale
        assert 0.0 <= metrics[key] <= 100.0, key
    assert (metrics["ruler_tasks"], metrics["ruler_problems"], metrics["ruler_context"]) == (3, 1, 384)
    assert metrics["mixer"] == "window+mamba2" and metrics["baseline_window"] > 64  # the tail's bytes buy a longer window
    assert metrics["replaced_groups"] == 45 and metrics["transfer_steps"] == metrics["lm_steps"] == 2
    # Half the KV groups are gone: the converted model's K/V is half the original's.
    bench = json.loads((out / "bench.json").read_text())
    final = [r for r in bench["measurements"] if r["model"] == "final"]
    original = [r for r in bench["measurements"] if r["model"] == "original"]
    assert [2 * r["kv_bytes"] for r in final] == [r["kv_bytes"] for r in original]

    report = (out / "report.md").read_text()
    assert "Quick run" in report and "## Summary" in report and f"{metrics['ppl_original']:.2f}" in report
    assert "| window at equal cache |" in report and "perplexity, out-of-domain text" in report
    assert "RULER mix in held-out text" in report and "passkey" not in report
    for image in ("heads.png", "loss.png", "bench.png"):
        assert f"]({image})" in report
        assert (out / image).read_bytes()[:8] == PNG
    assert sorted(p.stem for p in (out / "stages").glob("*.json")) == sorted(STAGES)
    card = (out / "final" / "README.md").read_text()  # the final model's card, with the run's numbers
    assert "base_model: \"HuggingFaceTB/SmolLM2-135M-Instruct\"" in card and "A quick run" in card
    assert f"{metrics['ppl_final']:.2f} ({metrics['ppl_ratio']:.3f}x)" in card
    assert f"{metrics['transfer_tokens']:,} tokens" in card and f"{metrics['lm_tokens']:,} tokens" in card

    markers = {p.name: p.stat().st_mtime_ns for p in (out / "stages").iterdir()}
    again = recurformer("run", "--quick", "--out", out)
    assert again.returncode == 0, again.stderr[-2000:]
    assert {p.name: p.stat().st_mtime_ns for p in (out / "stages").iterdir()} == markers

    other = recurformer("run", "--quick", "--beta", "0.75", "--out", out)
    assert other.returncode == 2 and "belongs to a different configuration (beta: 0.5 there, 0.75 here)" in other.stderr
