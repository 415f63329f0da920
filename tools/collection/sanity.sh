#!/usr/bin/env bash
# `ansible-test sanity` on the generated collection hsx.recovery (`make collection-sanity`, and a
# stage of tests/run_all.sh): every test ansible-test has for a collection, 0 errors. The only ignore
# lines are generated (build.py sanity_ignores): the shebangs of host-side python3 scripts in roles.
#
# ansible-test runs each test in a virtual environment of its own (~/.ansible/test/venv, reused by
# later runs), made without pip; it puts pip in with a get-pip.py script that it downloads once into
# ~/.ansible/test/cache/ - from a host our build machines cannot reach. We pre-seed that cache entry
# with tools/collection/get_pip_ensurepip.py (pip from ensurepip, then the pip version ansible-test
# wants from the configured package index: pip.conf / PIP_*), which gives the same venv. An entry a
# user put there themselves (the real get-pip.py) is left alone. The tests' own requirements then
# come from the configured index too.
#
# --local --python 3.11: the controller's Python (the lab's Debian bookworm hosts run 3.11 too); the
# modules' minimum (3.10) is declared in the collection's tests/config.yml.
#
# Then the checks ansible-test does not make, on the same generated collection: its documentation
# (modules, filters, roles' argument specs) by `antsibull-docs lint-collection-docs --plugin-docs`
# (the docs site's own linter), and Galaxy's import of its tarball (tools/collection/galaxy_import.py:
# galaxy-importer, locally, its ansible-test step off): metadata, role READMEs, docs, and ansible-lint's
# production profile on the roles and playbooks as they are installed (the collection layout, our
# filters by FQCN) - the collection's one ansible-lint pass (`make lint` lints the same sources in the
# project, with the yaml and var-naming rules Galaxy leaves out). The changelog is linted by
# ansible-test's own `changelog` test (changelogs/config.yaml is there).
#
# galaxy.yml's URLs: the project has none yet (pyproject.toml [project.urls]; `make release` refuses
# without them), and Galaxy requires a repository; this check's build fills the missing ones with
# build.py's PLACEHOLDER_URL (https://galaxy-import-check.invalid/..., a reserved name), never a real one.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=$PWD/.venv/bin
out=${HSX_COLLECTION_OUT:-$PWD/.cache/collection}
coll=$("$BIN/python" tools/collection/build.py --out "$out" --placeholder-urls)
import_dir=$(mktemp -d)
trap 'rm -rf "$import_dir"' EXIT
"$BIN/ansible-galaxy" collection build --output-path "$import_dir" "$coll" >/dev/null

pip_version=$("$BIN/python" -c 'import types
from ansible_test._internal.python_requirements import get_venv_packages
print(get_venv_packages(types.SimpleNamespace(version="3.11"))["pip"])')
cache=$HOME/.ansible/test/cache/get_pip_${pip_version//./_}.py
marker="A stand-in for the get-pip.py script ansible-test downloads"
if [ ! -e "$cache" ] || grep -q "$marker" "$cache"; then
    mkdir -p "$(dirname "$cache")"
    cp tools/collection/get_pip_ensurepip.py "$cache"
fi

# ansible-test takes a collection's files from git when a folder above it holds .git: here the
# checkout's, which ignores .cache/, so it would find nothing to test. The generated collection is
# made a repository of its own (nothing committed: git lists its untracked files), which stops the
# search there.
git -C "$coll" init -q
cd "$coll"
rc=0
PATH=$BIN:$PATH ANSIBLE_COLLECTIONS_PATH=$out "$BIN/antsibull-docs" lint-collection-docs --plugin-docs . || rc=1
# ansible-lint (run by galaxy-importer) installs the collection it lints into $HOME/.ansible/collections:
# it gets a HOME of its own, removed after, so the user's (and the next test's) collections path is left
# as it was (an hsx.recovery left there made test_collection's `ansible-galaxy collection install` a no-op).
# A full run only: `sanity.sh --test NAME` runs that ansible-test test alone.
if [ $# -eq 0 ]; then
    mkdir "$import_dir/home"
    (cd "$import_dir" && HOME=$import_dir/home PATH=$BIN:$PATH "$BIN/python" "${BIN%/.venv/bin}/tools/collection/galaxy_import.py" \
        "$import_dir"/hsx-recovery-*.tar.gz) || rc=1
fi
PATH=$BIN:$PATH "$BIN/ansible-test" sanity --local --python 3.11 --color no "$@" || rc=1
# The execution environment (execution-environment/): the collection's tarball and the hsx-control wheel
# built from this checkout, `ansible-builder create` of its definition, and ansible-builder's introspection
# of the built collection (no Python requirement an index would resolve; bindep.txt's packages). No image.
if [ $# -eq 0 ]; then
    "$BIN/python" "${BIN%/.venv/bin}/execution-environment/build.py" --check --out "$(dirname "$out")/ee" >/dev/null || rc=1
fi

# The modules' declared minimum, 3.10 (tests/config.yml): compile and import them there too, when
# this machine has that interpreter (on PATH, or one pyenv installed; chosen by running it, since a
# pyenv shim can name one that is not installed). 3.9 fails these (dataclass slots=True).
py310=
for cand in python3.10 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.10*/bin/python3.10; do
    py310=$("$cand" -c 'import sys; assert sys.version_info[:2] == (3, 10); print(sys.executable)' 2>/dev/null) \
        && break
done
if [ -n "$py310" ] && [ $# -eq 0 ]; then
    PATH=$(dirname "$py310"):$BIN:$PATH "$BIN/ansible-test" sanity --local --python 3.10 --color no --test compile --test import \
        || rc=1
else
    echo "collection sanity: no python3.10 here; the 3.10 compile/import check did not run"
fi
# The newest ansible-core's smoke lane on the same collection (tools/collection/core_latest.sh): syntax
# checks, ansible-doc of every module and role, one module run; about 7 s of CPU (its venv, once: 7 more).
if [ $# -eq 0 ]; then
    "${BIN%/.venv/bin}/tools/collection/core_latest.sh" "$out" || rc=1
fi
exit $rc
