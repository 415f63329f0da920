#!/usr/bin/env bash
# `make test`: lint, the unit suite, the lab tests, the molecule scenarios, the collection.
#
# tests/stages.py runs them as stages on a few workers at once, the costliest first, each worker on its
# own lab (HSX_LAB_ID), so no lab test waits for another and the cores stay busy to the end; each
# stage's line says its wall time and CPU (own + its lab hosts'). The machine is shared by all: torch
# runs one thread per process here (OMP_NUM_THREADS=1, as the lab's jobs do:
# inventory/lab/group_vars/all/main.yml), since an OpenMP team of several threads on cores others hold
# waits at every barrier (tests/bench/bench_lab_threads.py: 3 extractions at once took 4.7x the wall
# time and 5.4x the CPU with torch's default threads on 2 cores). Every stage runs even when an earlier
# one failed; every lab is always torn down.
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
busy_cpu() { awk '$1 == "cpu" { printf "%.0f", ($2 + $3 + $4 + $7 + $8) / 100 }' /proc/stat; }  # user nice system irq softirq
busy0=$(busy_cpu)
status=0
# Controller-side assets every stage uses, built once before they start (the lab's: inventory/lab).
echo "=== setup: wheelhouse"
.venv/bin/hsx wheelhouse .cache/wheelhouse || { echo "=== FAILED: the wheelhouse"; status=1; }
.venv/bin/python tests/stages.py || status=1
echo "=== run_all.sh: $SECONDS s (the machine's CPU: $(($(busy_cpu) - busy0)) s busy of $((SECONDS * $(getconf _NPROCESSORS_ONLN))))"
exit $status
