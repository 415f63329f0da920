#!/usr/bin/env bash
# Run every molecule scenario (or those named) and print `molecule: N passed, N failed`.
# Molecule is not a runner CI reads, so the count is ours; each scenario's log is kept.
set -u
cd "$(dirname "$0")/.."
logs=molecule/artifacts
mkdir -p "$logs"
scenarios=("$@")
if [ ${#scenarios[@]} -eq 0 ]; then
    for f in molecule/*/molecule.yml; do scenarios+=("$(basename "$(dirname "$f")")"); done
fi
passed=0; failed=0; failed_names=()
for s in "${scenarios[@]}"; do
    start=$(date +%s)
    if molecule test -s "$s" >"$logs/$s.log" 2>&1; then
        passed=$((passed + 1)); echo "molecule: $s passed ($(( $(date +%s) - start ))s)"
    else
        failed=$((failed + 1)); failed_names+=("$s")
        echo "molecule: $s FAILED ($(( $(date +%s) - start ))s); last lines of $logs/$s.log:"
        sed 's/\x1b\[[0-9;]*m//g' "$logs/$s.log" | grep -v '^\s*$' | tail -40
    fi
done
echo "molecule: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
