#!/usr/bin/env bash
# Smoke lane on the newest ansible-core (`make core-latest`; tools/collection/sanity.sh runs it on the
# collection it built): the project is developed and fully tested on constraints.txt's 2.19; this checks
# that the newest release (tools/collection/core-latest-constraints.txt, pinned) still loads it.
#   1. ansible-playbook --syntax-check of every playbook (the checkout's layout, its ansible.cfg);
#   2. ansible-doc of every module and every role of the generated collection (hsx.recovery.*);
#   3. one module run: hsx.recovery.extraction_status_info on localhost (no output there: state none).
# ansible-core 2.20+ needs Python 3.12+: python3.13/python3.12 on PATH, or one pyenv installed (chosen by
# running it: a pyenv shim can name one that is not installed). Its venv: .cache/ansible-core-latest,
# remade when the constraints change. Without such a Python it says so and exits 0 (nothing checked),
# or 2 with HSX_CORE_LATEST_REQUIRED=1.
# Usage: core_latest.sh [COLLECTIONS_PATH]  (a built collection's ansible_collections parent; default:
# build one into .cache/core-latest-collection with tools/collection/build.py). Exit 0 passed, 1 a check failed.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
constraints=tools/collection/core-latest-constraints.txt
venv=$ROOT/.cache/ansible-core-latest
py=
for cand in python3.13 python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[23]*/bin/python3.1[23]; do
    py=$("$cand" -c 'import sys; assert sys.version_info[:2] >= (3, 12); print(sys.executable)' 2>/dev/null) && break
done
if [ -z "$py" ]; then
    echo "core-latest: no Python 3.12+ here (python3.13/python3.12 on PATH or under pyenv): the smoke lane on" \
         "$(grep -m1 '^ansible-core==' $constraints) did not run" >&2
    [ "${HSX_CORE_LATEST_REQUIRED:-0}" = 1 ] && exit 2 || exit 0
fi
if ! cmp -s "$constraints" "$venv/.constraints" 2>/dev/null; then
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check -c "$constraints" ansible-core 2>&1 \
        | { grep -v '^WARNING: Location' >&2 || true; }
    cp "$constraints" "$venv/.constraints"
fi
out=${1:-}
if [ -z "$out" ]; then
    out=$ROOT/.cache/core-latest-collection
    "$ROOT/.venv/bin/python" tools/collection/build.py --out "$out" >/dev/null
fi
out=$(realpath "$out")
B=$venv/bin
# cryptography's own deprecation of DSA, printed at every start of ansible-core 2.21: not ours.
export PYTHONWARNINGS="ignore:DSA is deprecated"
version=$("$B/python" -c 'from ansible.release import __version__; print("ansible-core", __version__)')
rc=0
# The checkout's layout: ansible.cfg's roles, library, module_utils and filters; no inventory needed.
ANSIBLE_CONFIG=$ROOT/ansible.cfg "$B/ansible-playbook" -i localhost, --syntax-check recover.yml playbooks/*.yml \
    >/dev/null || { echo "core-latest: syntax-check failed on $version" >&2; rc=1; }
modules=$(for m in library/*.py; do m=${m##*/}; echo "hsx.recovery.${m%.py}"; done)
roles=$(for r in roles/*/meta/argument_specs.yml; do r=${r#roles/}; echo "hsx.recovery.${r%%/*}"; done)
export ANSIBLE_COLLECTIONS_PATH=$out
# shellcheck disable=SC2086 # one name per word
for kind in module role; do
    names=$modules; [ $kind = role ] && names=$roles
    doc=$(cd "$venv" && "$B/ansible-doc" -t $kind $names 2>&1) || { echo "$doc" >&2; rc=1; }
    # Errors, and warnings about our content (ansible-core 2.21 warns about its own internal collection).
    bad=$(grep -E '^\[ERROR\]|^\[WARNING\].*hsx' <<<"$doc" || true)
    [ -z "$bad" ] || { echo "$bad" >&2; rc=1; }
done
ran=$(cd "$venv" && "$B/ansible" localhost -i localhost, -c local -e ansible_python_interpreter="$B/python" \
      -m hsx.recovery.extraction_status_info -a "path=$ROOT/.cache/core-latest-no-output" 2>&1) || rc=1
grep -q '"state": "none"' <<<"$ran" || { echo "$ran" >&2; rc=1; }
echo "core-latest: $version: $( [ $rc = 0 ] && echo passed || echo FAILED) (syntax-check, ansible-doc of" \
     "$(wc -w <<<"$modules") modules and $(wc -w <<<"$roles") roles, one module run)"
exit $rc
