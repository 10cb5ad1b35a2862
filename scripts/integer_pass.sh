#!/bin/bash
# The integer kernel of this checkout against the same file at another commit, on all of SmolLM2's
# projections (random blocks), loaded side by side and timed pass by pass (scripts/integer_pass.c):
#
#   bash scripts/integer_pass.sh [REV] [THREADS] [PASSES]      # REV default HEAD, 2 threads, 40 passes
#   HOT=1 bash scripts/integer_pass.sh ...                     # weights from the caches instead of memory
#
#   LEVEL=avx2 bash scripts/integer_pass.sh ...               # the AVX2 build (any AVX2 CPU)
#   PERF="perf record -o F" bash scripts/integer_pass.sh ...  # the harness run under a profiler
#
# lib 0 is REV's gemm_q8.c, lib 1 this checkout's, both compiled with the flags decodekit builds the
# kernel with at that level (kernels.build.compiler_flags, read from this checkout); each row says
# whether lib 1's output is lib 0's bit for bit. Needs the install's .venv and a C compiler; the
# default level, avx512, needs a CPU with AVX512-VNNI (`decodekit profile` times whichever build the
# CPU runs).
set -euo pipefail
rev=${1:-HEAD}; threads=${2:-2}; passes=${3:-40}
here=$(cd "$(dirname "$0")/.." && pwd)
kernels=$here/src/decodekit/models/kernels
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
level=${LEVEL:-avx512}
read -r -a flags < <(PYTHONPATH="$here/src" "$here/.venv/bin/python" -c \
    "from decodekit.models.kernels.build import compiler_flags; print(*compiler_flags('gemm_q8', '$level'))")
git -C "$here" show "$rev:src/decodekit/models/kernels/gemm_q8.c" > "$work/gemm_q8.c"
for header in $(git -C "$here" ls-tree --name-only "$rev" src/decodekit/models/kernels/ | grep '\.h$'); do
    git -C "$here" show "$rev:$header" > "$work/$(basename "$header")"
done
cc "${flags[@]}" -I"$work" "$work/gemm_q8.c" -o "$work/before.so"
cc "${flags[@]}" -I"$kernels" "$kernels/gemm_q8.c" -o "$work/after.so"
cc -O2 -mf16c "-m${level/avx512/avx512f}" "$here/scripts/integer_pass.c" -o "$work/integer_pass" -ldl -Wl,--no-as-needed -lm  # the libraries take libm from the process, as in Python
${PERF:-} "$work/integer_pass" "$threads" "$passes" "$work/before.so" "$work/after.so"
