#!/usr/bin/env bash
# Build llama.cpp's own benchmark as a comparison anchor for tools/bench_engine.py,
# outside the project's environment.
#
#   tools/llamacpp_anchor.sh            build (idempotent), then print where things are
#   tools/llamacpp_anchor.sh --print    only print where things are (exit 1 if not built)
#
# The source is the llama.cpp that llama-cpp-python vendors (its sdist, pinned
# below), so the anchor is the release Python users get. PyPI has no binary
# wheel of it for this platform, and the one prebuilt CPU build there needs a
# newer glibc than Debian 12 has. Rather than the whole Python binding, only
# two C++ tools are built, in about ten minutes on two cores:
#   - llama-bench: llama.cpp's own prompt-processing and generation benchmark,
#     the C++ engine with no Python in the loop, which is the strict baseline;
#   - llama-quantize: writes the F32, F16, BF16, Q8_0 and Q4_0 files the bench
#     compares each of our precisions against, from one source GGUF.
# Built with GGML_NATIVE, for the instruction set of the machine it runs on,
# as llama.cpp recommends for CPU inference.
#
# Last, it writes "$DIR/anchor.env", a shell file other tools source:
#   LLAMACPP_ANCHOR_DIR, LLAMACPP_VERSION, LLAMACPP_BENCH, LLAMACPP_QUANTIZE.
set -euo pipefail

VERSION="${LLAMACPP_PY_VERSION:-0.3.36}"
DIR="${LLAMACPP_ANCHOR_DIR:-$HOME/.cache/mooncaked-bench/llamacpp-$VERSION}"
PYTHON="${LLAMACPP_ANCHOR_PYTHON:-python3}"
JOBS="${LLAMACPP_ANCHOR_JOBS:-$(nproc)}"
ENV_FILE="$DIR/anchor.env"

log() { printf '[llamacpp-anchor] %s\n' "$*" >&2; }

if [[ "${1:-}" == "--print" ]]; then
    if [[ ! -f "$ENV_FILE" ]]; then
        log "not built: $ENV_FILE is missing; run $0"
        exit 1
    fi
    cat "$ENV_FILE"
    exit 0
fi

for tool in cmake make g++; do
    command -v "$tool" >/dev/null || { log "needs $tool on PATH"; exit 1; }
done

mkdir -p "$DIR"
SDIST="$DIR/llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
    log "downloading llama-cpp-python==$VERSION (source)"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary=:all: \
        -d "$DIR" "llama-cpp-python==$VERSION" >&2
fi
SRC="$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [[ ! -d "$SRC" ]]; then
    log "unpacking $SDIST"
    tar -xzf "$SDIST" -C "$DIR"
fi

BUILD="$SRC/build"
if [[ ! -x "$BUILD/bin/llama-bench" || ! -x "$BUILD/bin/llama-quantize" ]]; then
    log "building llama-bench and llama-quantize with $JOBS jobs (about ten minutes on two cores)"
    cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_APP=OFF >&2
    cmake --build "$BUILD" -j "$JOBS" --target llama-bench llama-quantize >&2
fi

COMMIT="$(cd "$SRC" && git rev-parse --short HEAD 2>/dev/null || echo unknown)"
cat >"$ENV_FILE" <<EOF
LLAMACPP_ANCHOR_DIR=$DIR
LLAMACPP_VERSION="llama-cpp-python $VERSION, llama.cpp $COMMIT"
LLAMACPP_BENCH=$BUILD/bin/llama-bench
LLAMACPP_QUANTIZE=$BUILD/bin/llama-quantize
EOF
log "built; $ENV_FILE:"
cat "$ENV_FILE"
