#!/usr/bin/env bash
# `make test`: lint, unit + integration tests in one pytest run, then the molecule scenarios.
# Every stage runs even when an earlier one failed; the lab is always torn down.
set -u
cd "$(dirname "$0")/.."
trap '.venv/bin/python tests/lab/lab.py down >/dev/null 2>&1 || true' EXIT
status=0
stage() { echo "=== $1"; shift; "$@" || { echo "=== FAILED: $*"; status=1; }; }
stage "lint: ruff" .venv/bin/ruff check .
stage "lint: ansible-lint (production profile)" .venv/bin/ansible-lint --profile production -q
stage "pytest: unit + integration" .venv/bin/pytest tests/unit tests/integration -q -p no:cacheprovider
stage "molecule" tests/molecule/run.sh
exit $status
