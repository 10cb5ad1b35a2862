#!/bin/bash
# The integer kernel of this checkout against the same file at another commit, on all of SmolLM2's
# projections (random blocks), loaded side by side and timed pass by pass (scripts/integer_pass.c):
#
#   bash scripts/integer_pass.sh [REV] [THREADS] [PASSES]      # REV default HEAD, 2 threads, 40 passes
#   HOT=1 bash scripts/integer_pass.sh ...                     # weights from the caches instead of memory
#
# lib 0 is REV's gemm_q8.c, lib 1 this checkout's; each row says whether lib 1's output is lib 0's
# bit for bit. Needs a C compiler and a CPU with AVX512-VNNI.
set -euo pipefail
rev=${1:-HEAD}; threads=${2:-2}; passes=${3:-40}
here=$(cd "$(dirname "$0")/.." && pwd)
kernels=$here/src/decodekit/models/kernels
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
flags=(-O3 -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mfma -mf16c -mavx512vnni -fopenmp -shared -fPIC)
git -C "$here" show "$rev:src/decodekit/models/kernels/gemm_q8.c" > "$work/gemm_q8.c"
git -C "$here" show "$rev:src/decodekit/models/kernels/gguf.h" > "$work/gguf.h"
cc "${flags[@]}" -I"$work" "$work/gemm_q8.c" -o "$work/before.so" -lm
cc "${flags[@]}" -I"$kernels" "$kernels/gemm_q8.c" -o "$work/after.so" -lm
cc -O2 -mf16c -mavx512f "$here/scripts/integer_pass.c" -o "$work/integer_pass" -ldl
"$work/integer_pass" "$threads" "$passes" "$work/before.so" "$work/after.so"
