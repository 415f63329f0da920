# Everything installs itself: `make test` and `make demo` need nothing but this checkout,
# root, and the machine's configured package sources.
SHELL := /bin/bash
VENV  := .venv
BIN   := $(VENV)/bin
STAMP := $(VENV)/.installed
# A pyenv shim can name a Python that is not installed: pick an interpreter by running it.
PYTHON := $(shell for p in python3.11 python3 /usr/bin/python3.11; do \
	$$p -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null && { command -v $$p; break; }; done)
export PATH := $(CURDIR)/$(BIN):$(PATH)
export HF_HUB_OFFLINE := 1

.PHONY: setup lab-ensure lint unit molecule integration test demo clean lab-down collection release sanity sglang-cpu core-latest

setup: $(STAMP)

$(STAMP): constraints.txt requirements-dev.txt pyproject.toml
	@test -n "$(PYTHON)" || { echo "make: no working Python 3.11 found" >&2; exit 2; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -r requirements-dev.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $@

lab-ensure: setup
	$(BIN)/python tests/lab/lab.py ensure

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ansible-lint --profile production -q

unit: setup
	$(BIN)/pytest tests/unit -q

# The Ansible collection hsx.recovery, generated from library/, module_utils/hsx/, filter_plugins/,
# roles/ and playbooks/ into .cache/collection (never kept in git), and its tarball
# (.cache/collection/dist/hsx-recovery-VERSION.tar.gz): tools/collection/build.py.
collection: setup
	$(BIN)/python tools/collection/build.py --tarball

# The tarball for publishing, as `collection` builds it, refused unless pyproject.toml's version is
# released (tools/collection/build.py --release) with no changelog fragment waiting, and its
# [project.urls] names Repository, Documentation and Issues (the project has none yet: it says how).
release: setup
	$(BIN)/python tools/collection/build.py --publish

# ansible-test sanity on the generated collection (a stage of `make test` too), its docs by
# antsibull-docs lint-collection-docs, and Galaxy's import of its tarball (galaxy-importer, with
# ansible-lint on its roles and playbooks).
sanity: setup
	tools/collection/sanity.sh

# The newest ansible-core (tools/collection/core-latest-constraints.txt, pinned; Python 3.12+, its own venv
# under .cache) beside constraints.txt's 2.19: syntax checks, ansible-doc, one module run. make sanity runs it too.
core-latest: setup
	HSX_CORE_LATEST_REQUIRED=1 tools/collection/core_latest.sh

molecule: lab-ensure sglang-cpu
	tests/molecule/run.sh

integration: lab-ensure
	$(BIN)/pytest tests/integration -q

# lint + unit + molecule + integration as stages on four workers (tests/stages.py); every lab is always
# torn down, also on failure. sglang-cpu: the
# molecule scenario sglang_server runs the released SGLang from its venv (once per machine).
test: lab-ensure sglang-cpu
	tests/run_all.sh

demo: lab-ensure
	tests/demo.sh

# The released SGLang 0.5.23 for its CPU path (tests/sglang_cpu), in a venv outside the checkout:
# $HSX_SGLANG_CPU_VENV, else /var/cache/hsx/sglang-0.5.23-cpu; pinned, a cache hit costs nothing
# (0.2 s), a miss about 6-11 min and 7.4 GB. Lab hosts see it read-only (tests/lab/lab.py up --venv).
sglang-cpu:
	@test -n "$(PYTHON)" || { echo "make: no working Python 3.11 found" >&2; exit 2; }
	$(PYTHON) tests/sglang_cpu/install.py

lab-down:
	$(BIN)/python tests/lab/lab.py down

clean: lab-down
	rm -rf $(VENV) .pytest_cache .ruff_cache reports
