#!/usr/bin/env bash
# `make test`: lint, unit + integration tests in one pytest run, and the molecule scenarios.
#
# Two lanes at once, each on its own lab (HSX_LAB_ID): pytest on the default lab, molecule on lab
# $HSX_MOLECULE_LAB_ID (9). Most of a lab test's wall time is waiting (SSH round trips, systemd,
# a job making progress), so the lanes overlap well even on 2 cores. Every stage runs even when an
# earlier one failed; both labs are always torn down.
set -u
cd "$(dirname "$0")/.."
molecule_lab=${HSX_MOLECULE_LAB_ID:-9}
[ "$molecule_lab" = "${HSX_LAB_ID:-}" ] && molecule_lab=8
molecule_log=.cache/molecule-lane.log
molecule_pid=
cleanup() {
    if [ -n "$molecule_pid" ] && kill -0 "$molecule_pid" 2>/dev/null; then
        pkill -TERM -P "$molecule_pid" 2>/dev/null; kill "$molecule_pid" 2>/dev/null
    fi
    .venv/bin/python tests/lab/lab.py down >/dev/null 2>&1 || true
    HSX_LAB_ID=$molecule_lab .venv/bin/python tests/lab/lab.py down >/dev/null 2>&1 || true
}
trap cleanup EXIT
status=0
# Each stage says how long it took (the run's time budget is watched: docs/benchmarks.md).
stage() {
    local name=$1 t0=$SECONDS; shift
    echo "=== $name"
    "$@" || { echo "=== FAILED: $*"; status=1; }
    echo "=== $name: $((SECONDS - t0)) s"
}

# Controller-side assets both lanes use, built once before they start.
stage "setup: wheelhouse" .venv/bin/hsx wheelhouse .cache/wheelhouse  # the lab's (inventory/lab)

mkdir -p .cache
echo "=== molecule: started beside pytest on lab $molecule_lab (log: $molecule_log)"
HSX_LAB_ID=$molecule_lab tests/molecule/run.sh >"$molecule_log" 2>&1 &
molecule_pid=$!

stage "lint: ruff" .venv/bin/ruff check .
stage "lint: ansible-lint (production profile)" .venv/bin/ansible-lint --profile production -q
stage "pytest: unit + integration" .venv/bin/pytest tests/unit tests/integration -q -p no:cacheprovider \
    --durations=12

echo "=== molecule (lab $molecule_lab)"
wait "$molecule_pid"
molecule_rc=$?
molecule_pid=
cat "$molecule_log"
echo "=== run_all.sh: $SECONDS s"
[ "$molecule_rc" -eq 0 ] || { echo "=== FAILED: molecule"; status=1; }
exit $status
