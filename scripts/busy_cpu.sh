#!/usr/bin/env bash
# Run a command and report its wall time and the machine-wide busy CPU-seconds meanwhile (from
# /proc/stat before and after: user, nice, system, irq and softirq of every core), which counts the
# processes a command starts but does not wait for (servers, Ray workers) too.
#   bash scripts/busy_cpu.sh .venv/bin/python -m pytest -q -n 2 --dist loadfile
set -uo pipefail
busy() { awk '/^cpu /{print $2+$3+$4+$7+$8; exit}' /proc/stat; }
idle() { awk '/^cpu /{print $5+$6; exit}' /proc/stat; }
b0=$(busy); i0=$(idle); t0=$(date +%s.%N)
"$@"
status=$?
b1=$(busy); i1=$(idle); t1=$(date +%s.%N)
tick=$(getconf CLK_TCK)
awk -v w="$t1-$t0" -v t0="$t0" -v t1="$t1" -v b="$((b1 - b0))" -v i="$((i1 - i0))" -v k="$tick" \
    'BEGIN{printf "wall %.1f s, busy CPU %.0f s, idle CPU %.0f s\n", t1 - t0, b / k, i / k}' >&2
exit $status
