#!/usr/bin/env bash
# The engine: llama.cpp with the `recurformer` architecture (docs/engine.md).
#
# Fetches the llama.cpp source vendored in the llama-cpp-python sdist on PyPI (pinned), applies
# engine/recurformer.patch and builds the CPU binaries into ENGINE_DIR (default .engine, git-ignored):
# ENGINE_DIR/llama.cpp (the patched source, with its converter) and ENGINE_DIR/build/bin (llama-cli,
# llama-server, llama-bench, llama-perplexity, llama-batched-bench, llama-quantize, recurformer-logits).
# A second run reuses what is there; a changed patch re-extracts the source and rebuilds.
# ENGINE_BINDINGS=1 then installs the same sdist's Python bindings (llama_cpp, with its server) into
# PIP's environment, on this build's libraries instead of a copy of their own.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
ENGINE_DIR=$(realpath -m "${ENGINE_DIR:-$ROOT/.engine}")
PIP=${PIP:-pip}
[[ "$PIP" != */* ]] || PIP=$(realpath -m "$PIP")  # a path is taken from where the script is run
JOBS=${JOBS:-$(nproc)}
VERSION=0.3.36
SDIST=llama_cpp_python-$VERSION.tar.gz
PATCH=$ROOT/engine/recurformer.patch
# ENGINE_TARGETS=llama builds the library alone (enough for the parity tool: make test)
TARGETS=${ENGINE_TARGETS:-llama-cli llama-completion llama-server llama-bench llama-perplexity llama-batched-bench llama-quantize}
# ENGINE_TESTS=1 adds llama.cpp's own tests of architectures and memory (tests/test_engine_upstream.py)
UPSTREAM_TESTS="test-llama-archs test-save-load-state test-recurrent-state-rollback test-state-restore-fragmented"
[ "${ENGINE_TESTS:-0}" = 1 ] && TARGETS="$TARGETS $UPSTREAM_TESTS"

mkdir -p "$ENGINE_DIR"
cd "$ENGINE_DIR"

[ -f "$SDIST" ] || "$PIP" download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d .

# the source, patched; re-extracted whenever the patch changes
STAMP=llama.cpp/.recurformer-patch
WANT=$(sha256sum "$PATCH" | cut -d' ' -f1)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    rm -rf llama.cpp src.tmp
    mkdir src.tmp
    tar xzf "$SDIST" -C src.tmp "llama_cpp_python-$VERSION/vendor/llama.cpp"
    mv "src.tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" llama.cpp
    rm -rf src.tmp llama.cpp/.git  # a git submodule's pointer, to a repository the sdist does not carry
    patch --quiet -p1 -d llama.cpp < "$PATCH"
    echo "$WANT" > "$STAMP"
fi

# the converter (recurformer export) needs only the source; the binaries need a compiler
for tool in cmake c++; do
    if ! command -v "$tool" > /dev/null; then
        echo "engine: source patched, binaries not built: no '$tool' on this machine (apt-get install g++ cmake)" >&2
        exit 3
    fi
done

# compiler output goes to build.log; its tail is shown when the build fails
failed() { tail -20 build.log >&2; echo "engine: the build failed (all of it in $ENGINE_DIR/build.log)" >&2; exit 1; }
echo "engine: building $TARGETS in $ENGINE_DIR/build (a first build takes minutes)" >&2
[ -f build/CMakeCache.txt ] || cmake -S llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > build.log 2>&1 || failed
if [ "${ENGINE_TESTS:-0}" = 1 ] && ! grep -q '^LLAMA_BUILD_TESTS:BOOL=ON' build/CMakeCache.txt; then
    cmake -S llama.cpp -B build -DLLAMA_BUILD_TESTS=ON >> build.log 2>&1 || failed
fi
cmake --build build -j "$JOBS" --target $TARGETS >> build.log 2>&1 || failed

# the parity tool, against the patched library
[ build/bin/recurformer-logits -nt "$ROOT/engine/logits.cpp" ] && [ build/bin/recurformer-logits -nt build/bin/libllama.so ] ||
c++ -O2 -std=c++17 "$ROOT/engine/logits.cpp" -o build/bin/recurformer-logits \
    -I llama.cpp/include -I llama.cpp/ggml/include -L build/bin -lllama -lggml -lggml-base \
    -Wl,-rpath,"$ENGINE_DIR/build/bin"

echo "engine: built in $ENGINE_DIR/build/bin"

# the bindings: their Python code only (LLAMA_BUILD=OFF), their library folder a link to this build
if [ "${ENGINE_BINDINGS:-0}" = 1 ]; then
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$PIP" install --quiet --no-cache-dir "$SDIST[server]" >> build.log 2>&1 || failed
    SITE=$("$PIP" show llama_cpp_python | sed -n 's/^Location: //p')
    rm -rf "$SITE/llama_cpp/lib"  # a link, or the libraries of a build of the bindings' own
    ln -s "$ENGINE_DIR/build/bin" "$SITE/llama_cpp/lib"
    echo "engine: Python bindings llama_cpp $VERSION installed, on the libraries in $ENGINE_DIR/build/bin"
fi
