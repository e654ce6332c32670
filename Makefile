# Set-up and entry points. Every target creates the virtual environment first if needed.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU wheel pinned: an unpinned torch pulls several GB of CUDA packages.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
# Triton for the tests only: its interpreter runs the GPU's decode kernels on the CPU
# (tests/ops). 3.8 or later: 3.6's interpreter fails under numpy 2.4.
TRITON ?= triton>=3.8
TRITON_STAMP := $(VENV)/.triton

.PHONY: install test smoke test-all demo bench clean gpu-check engine engine-python engine-tests

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test,gguf,lora,eval,datasets]"
	touch $(STAMP)

# Where Triton cannot be installed the tests that need it are skipped, with a note.
$(TRITON_STAMP): $(STAMP)
	$(BIN)/pip install --quiet "$(TRITON)" || echo "Triton not installed: the checks of the GPU kernels in its interpreter will be skipped"
	touch $(TRITON_STAMP)

# The engine: llama.cpp with the recurformer architecture, built into ENGINE_DIR (docs/engine.md).
# Exit 3 means no C++ compiler or CMake here: the engine's tests are then skipped, with a note.
ENGINE_DIR ?= .engine
BUILD_ENGINE = PIP=$(BIN)/pip ENGINE_DIR=$(ENGINE_DIR) bash engine/build.sh
engine: install
	$(BUILD_ENGINE)

# The Python bindings of the same llama.cpp (llama-cpp-python, with its OpenAI-compatible server),
# installed into the virtual environment on the engine's libraries.
engine-python: install
	ENGINE_BINDINGS=1 $(BUILD_ENGINE)

# llama.cpp's own tests of architectures and memory on the patched build, recurformer included.
engine-tests: install
	ENGINE_TESTS=1 ENGINE_TARGETS=llama $(BUILD_ENGINE)
	$(BIN)/python -m pytest -q tests/test_engine_upstream.py

# The fast suite: tiny random models, no network, no real model. It builds what the engine's tests
# run first, where it can: the library, its parity tool, llama-server, llama-batched-bench, the
# Python bindings and llama.cpp's own tests of architectures and memory (tests/test_engine*.py).
test: install $(TRITON_STAMP)
	ENGINE_BINDINGS=1 ENGINE_TESTS=1 ENGINE_TARGETS="llama llama-server llama-batched-bench" $(BUILD_ENGINE) || [ $$? -eq 3 ]
	$(BIN)/python -m pytest -q -m "not real_model and not slow"

# The main job in miniature (`run --quick` on the real model), checked end to end. CI runs it.
smoke: install
	$(BIN)/python -m pytest -q -m smoke

# Everything, including tests that fetch and use the real SmolLM2-135M model (and the whole engine).
test-all: install
	ENGINE_BINDINGS=1 ENGINE_TESTS=1 $(BUILD_ENGINE) || [ $$? -eq 3 ]
	$(BIN)/python -m pytest -q

# The main job on the default model and the default corpora: ../shared/data where it exists,
# else the same texts from their public sources (docs/data.md). Another corpora folder with
# DATA=..., more flags with ARGS="--beta 0.75 ...".
DATA ?=
ARGS ?=
demo: install
	$(if $(DATA),RECURFORMER_DATA=$(DATA) )$(BIN)/recurformer run --model smollm2-135m --out runs/demo $(ARGS)

bench: install
	$(BIN)/python -m benchmarks.speed.bench

clean:
	rm -rf $(VENV) .pytest_cache

# On a machine with a CUDA GPU, no install needed beyond its own PyTorch, Triton and
# transformers (GPU_PYTHON): the tests marked cuda, then the GPU benchmark into GPU_OUT.
# About 10 minutes on one H100 (docs/gpu.md).
GPU_PYTHON ?= python3
GPU_OUT    ?= docs/results
gpu-check:
	GPU_PYTHON=$(GPU_PYTHON) GPU_OUT=$(GPU_OUT) bash benchmarks/gpu_check.sh
