#!/usr/bin/env bash
# Build llama.cpp's native `llama-server` and `llama-bench` into .llama.cpp/bin/.
#
# Why: `decodekit bench-serve` needs the strongest CPU peer to compare against,
# and that is llama.cpp's own HTTP server with continuous batching
# (`llama-server -m MODEL.gguf -np 8 -cb ...`), not the llama-cpp-python
# bindings. `llama-bench` is built alongside for raw prompt/decode throughput.
#
# Where the sources come from: the llama-cpp-python source distribution vendors
# a complete llama.cpp tree (vendor/llama.cpp), and the machines this project
# runs on can reach package registries only (no git clone from GitHub). So the
# sdist is fetched with pip, unpacked, and its vendor/llama.cpp is built here.
#
# Build flags: GGML_NATIVE=OFF plus an explicit AVX/AVX2/FMA/F16C baseline, and
# AVX-512 (F, CD, VL, DQ, BW) where the building CPU has it, so the binary runs
# on any x86-64 machine of that level, not only the one it was built on
# (-march=native could pull in e.g. AVX512-VNNI/BF16/AMX that another host lacks). Static libllama/libggml
# (BUILD_SHARED_LIBS=OFF) so the two binaries can be copied around alone.
# No curl/HTTPS and no web-UI download (the build is offline-friendly; the
# benchmark talks plain HTTP to localhost).
#
# Usage:   bash scripts/build_llama_server.sh
# Env:     LLAMA_CPP_PYTHON_VERSION  llama-cpp-python sdist version (default 0.3.36)
#          JOBS                      parallel compile jobs (default 2)
# Output:  .llama.cpp/bin/llama-server, .llama.cpp/bin/llama-bench
# Exit:    0 built (or already present and working), 2 missing build tool.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${JOBS:-2}
ROOT=.llama.cpp
SDIST_DIR=$ROOT/sdist
SRC_DIR=$ROOT/src
BUILD_DIR=$ROOT/build
BIN_DIR=$ROOT/bin

# AVX-512 only where this CPU has it: a binary built with it dies with "Illegal instruction" on an
# AVX2 CPU (most laptops and desktops), and decodekit's kernels run at the AVX2 level there too.
AVX512=OFF
if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then AVX512=ON; fi

# --- idempotent: an existing, working binary built for this CPU's level is enough -
if [ -x "$BIN_DIR/llama-server" ] && [ "$(cat "$BIN_DIR/AVX512" 2>/dev/null)" = "$AVX512" ] \
        && "$BIN_DIR/llama-server" --version >/dev/null 2>&1; then
    echo "$(pwd)/$BIN_DIR/llama-server"
    exit 0
fi

# --- build tools ------------------------------------------------------------------
CMAKE=""
if command -v cmake >/dev/null 2>&1; then
    CMAKE=$(command -v cmake)
elif [ -x .venv/bin/cmake ]; then
    CMAKE=.venv/bin/cmake
elif [ -x .venv/bin/pip ]; then
    echo "cmake not on PATH; installing it into .venv from PyPI" >&2
    .venv/bin/pip install -q cmake || true
    [ -x .venv/bin/cmake ] && CMAKE=.venv/bin/cmake
fi
if [ -z "$CMAKE" ]; then
    echo "error: cmake is missing; install it with '.venv/bin/pip install cmake' (or 'apt-get install cmake')" >&2
    exit 2
fi

CXX_FOUND=""
for c in ${CXX:-} c++ g++ clang++; do
    if command -v "$c" >/dev/null 2>&1; then CXX_FOUND=$c; break; fi
done
CC_FOUND=""
for c in ${CC:-} cc gcc clang; do
    if command -v "$c" >/dev/null 2>&1; then CC_FOUND=$c; break; fi
done
if [ -z "$CXX_FOUND" ] || [ -z "$CC_FOUND" ]; then
    echo "error: a C/C++ compiler is missing (need both cc and c++); install it with 'apt-get install g++' (or 'apt-get install build-essential')" >&2
    exit 2
fi

GENERATOR=()
if ! command -v make >/dev/null 2>&1; then
    if command -v ninja >/dev/null 2>&1 || [ -x .venv/bin/ninja ]; then
        GENERATOR=(-G Ninja)
        if ! command -v ninja >/dev/null 2>&1; then
            GENERATOR+=(-DCMAKE_MAKE_PROGRAM="$(pwd)/.venv/bin/ninja")
        fi
    else
        echo "error: no build tool (make or ninja) is available; install one with 'apt-get install make' or '.venv/bin/pip install ninja'" >&2
        exit 2
    fi
fi

# --- sources: llama-cpp-python sdist -> vendor/llama.cpp ---------------------------
mkdir -p "$SDIST_DIR" "$SRC_DIR" "$BIN_DIR"
SDIST=$(ls "$SDIST_DIR"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)
if [ -z "$SDIST" ]; then
    echo "downloading llama-cpp-python==$VERSION sdist" >&2
    .venv/bin/pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$SDIST_DIR"
    SDIST=$(ls "$SDIST_DIR"/llama_cpp_python-"$VERSION".tar.gz)
fi

UNPACKED=$SRC_DIR/llama_cpp_python-$VERSION
if [ ! -f "$UNPACKED/vendor/llama.cpp/CMakeLists.txt" ]; then
    echo "unpacking $SDIST" >&2
    rm -rf "$UNPACKED"
    tar -xzf "$SDIST" -C "$SRC_DIR"
fi
LLAMA_SRC=$(dirname "$(find "$UNPACKED" -path '*/vendor/llama.cpp/CMakeLists.txt' -print -quit)")
if [ ! -f "$LLAMA_SRC/tools/server/CMakeLists.txt" ] && [ ! -f "$LLAMA_SRC/examples/server/CMakeLists.txt" ]; then
    echo "error: $LLAMA_SRC has no llama-server sources" >&2
    exit 1
fi
echo "llama.cpp sources: $LLAMA_SRC" >&2

# --- configure ---------------------------------------------------------------------
# Options that only exist in some llama.cpp versions are passed only when declared.
EXTRA=()
for opt in LLAMA_BUILD_TESTS LLAMA_BUILD_EXAMPLES LLAMA_BUILD_APP LLAMA_USE_PREBUILT_UI LLAMA_OPENSSL; do
    if grep -q "option($opt\b" "$LLAMA_SRC/CMakeLists.txt"; then
        EXTRA+=("-D$opt=OFF")
    fi
done

echo "llama.cpp instruction set: AVX2 + FMA + F16C, AVX-512 $AVX512" >&2

"$CMAKE" -S "$LLAMA_SRC" -B "$BUILD_DIR" ${GENERATOR[@]+"${GENERATOR[@]}"} \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF \
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=$AVX512 \
    -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF \
    ${EXTRA[@]+"${EXTRA[@]}"}

# --- build and install the two binaries ---------------------------------------------
start=$(date +%s)
"$CMAKE" --build "$BUILD_DIR" --config Release -j "$JOBS" --target llama-server llama-bench
echo "build took $(( $(date +%s) - start ))s" >&2

for b in llama-server llama-bench; do
    built=$(find "$BUILD_DIR" -type f -name "$b" -perm -u+x -print -quit)
    if [ -z "$built" ]; then
        echo "error: built $b not found under $BUILD_DIR" >&2
        exit 1
    fi
    cp -f "$built" "$BIN_DIR/$b"
done
echo "$AVX512" > "$BIN_DIR/AVX512"  # the level they were built for (a rebuild where it differs)

"$BIN_DIR/llama-server" --version
echo "$(pwd)/$BIN_DIR/llama-server"
