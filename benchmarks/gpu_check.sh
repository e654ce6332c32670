#!/usr/bin/env bash
# `make gpu-check`: on a machine with a CUDA GPU, the tests marked cuda (kernels against their
# oracles, decode against the full forward, padded batches, save and load, bf16), then the
# GPU benchmark (benchmarks/speed/gpu.py) into $GPU_OUT. Runs from a checkout with no install:
# the package from src/, the machine's own python3 with PyTorch, Triton and transformers.
# BENCH_ARGS passes more flags to the benchmark (--models, --modes, ...); TESTS_TIMEOUT (240 s) and
# BENCH_DEADLINE_S (270 s, after which no new section starts) keep the whole within ten minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_PYTHON:-python3}
OUT=${GPU_OUT:-docs/results}
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/src:$PWD" PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
mkdir -p "$OUT"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.cuda.get_device_name(0))" || exit 2
"$PY" -c "import recurformer" 2>/dev/null || {
    echo "gpu-check: recurformer does not import with this python (it needs transformers >= 5.20; found" \
        "$("$PY" -c 'import transformers; print(transformers.__version__)' 2>&1 | tail -1)): put a newer" \
        "transformers wheel on PYTHONPATH" >&2
    exit 2
}
# Six workers where pytest-xdist is installed: Triton compiles side by side (56 s on a fresh H200; in one process an H100 took about 190 s).
workers=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 6")
timeout ${TESTS_TIMEOUT:-240} "$PY" -m pytest -q -m cuda -p no:cacheprovider --durations=8 $workers ${GPU_TESTS:-tests/test_device*.py} 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
tests=${PIPESTATUS[0]}
"$PY" -m benchmarks.speed.gpu --out "$OUT" --deadline-s ${BENCH_DEADLINE_S:-270} ${BENCH_ARGS:-} 2>&1 | tee "$OUT/gpu-bench.log" | grep -v "^\[" | tail -20
bench=${PIPESTATUS[0]}
echo "gpu-check: tests exit $tests, benchmark exit $bench"
exit $(( tests || bench ))
