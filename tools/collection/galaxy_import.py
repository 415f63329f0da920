#!/usr/bin/env python3
"""Galaxy's import check of a collection tarball: galaxy-importer (the code Galaxy runs on every upload)
run locally, no containers, configured by tools/collection/galaxy-importer.cfg (GALAXY_IMPORTER_CONFIG
names another): its ansible-test step off, its ansible-lint on.

    galaxy_import.py DIST/hsx-recovery-VERSION.tar.gz

Exit status: 0 the import passes with nothing from its ansible-lint; 1 the import fails (galaxy-importer's
reason is printed: "'repository' is required", "No role readme found", ...), it logged an error (an
ansible-lint crash or timeout included), or its ansible-lint found something (each finding printed);
2 the argument is not a collection tarball's name. Other warnings (an ansible-test ignore file) are
printed and pass, as Galaxy lets them pass.

Galaxy itself only shows its ansible-lint's findings; here they fail, since this is the collection's one
ansible-lint pass (its production profile, as Galaxy runs it, on the tarball's content). galaxy-importer
says where its lint starts and ends only in two log lines (pinned in constraints.txt: LINT_START,
LINT_END); a missing pair fails the check rather than letting findings pass unseen.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LINT_START = "Linting collection via ansible-lint"
LINT_END = "...ansible-lint run complete"
# galaxy-importer gives its ansible-lint 180 s of wall time (Galaxy's servers); ~40 CPU-s here, which on a
# 2-core machine that `make test` loads with three lanes can take longer. Its other limits stay.
LINT_TIMEOUT_S = 900


def _longer_lint_timeout() -> None:
    """galaxy-importer's ansible-lint call (loaders/collection.py: Popen(...).communicate(timeout=180))
    waits up to LINT_TIMEOUT_S instead."""
    from galaxy_importer.loaders import collection as loader

    class _Popen(loader.Popen):
        def communicate(self, input=None, timeout=None):  # noqa: A002 (Popen's own name)
            return super().communicate(input, None if timeout is None else max(timeout, LINT_TIMEOUT_S))

    loader.Popen = _Popen


class _Recorder(logging.Handler):
    """Prints every record as galaxy-importer's CLI does and sorts the warnings and errors."""

    def __init__(self) -> None:
        super().__init__()
        self.in_lint = False
        self.lint_seen = False
        self.lint_findings: list[str] = []
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.levelno == logging.INFO:
            if not message.startswith("Loading "):  # one line per module, role, ... of the collection
                print(message)
            if message.startswith(LINT_START):
                self.in_lint = self.lint_seen = True
            elif message.startswith(LINT_END):
                self.in_lint = False
            return
        print(f"{record.levelname}: {message}")
        if record.levelno >= logging.ERROR:
            self.errors.append(message)
        elif self.in_lint:
            self.lint_findings.append(message)
        else:
            self.warnings.append(message)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].endswith(".tar.gz") or argv[0].count("-") < 2:
        print("usage: galaxy_import.py NAMESPACE-NAME-VERSION.tar.gz", file=sys.stderr)
        return 2
    os.environ.setdefault("GALAXY_IMPORTER_CONFIG", str(HERE / "galaxy-importer.cfg"))
    from galaxy_importer import __version__, collection, config
    from galaxy_importer.exceptions import ImporterError

    cfg = config.Config(config_data=config.ConfigFile.load())
    _longer_lint_timeout()
    if cfg.run_ansible_test or not cfg.run_ansible_lint:
        print(f"galaxy-import: {os.environ['GALAXY_IMPORTER_CONFIG']} must turn ansible-test off and ansible-lint on",
              file=sys.stderr)
        return 2
    tarball = Path(argv[0])
    namespace, name, version = tarball.name[: -len(".tar.gz")].split("-", 2)
    logger = logging.getLogger("hsx.galaxy_import")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    recorder = _Recorder()
    logger.addHandler(recorder)
    try:
        with open(tarball, "rb") as fh:
            data = collection.import_collection(fh, collection.CollectionFilename(namespace, name, version),
                                                logger=logger, cfg=cfg)
    except (ImporterError, OSError) as e:
        print(f"galaxy-import: FAILED: galaxy-importer {__version__} refuses {tarball.name}: {e}")
        return 1
    if not recorder.lint_seen:
        recorder.errors.append(f"galaxy-importer did not say '{LINT_START}': its ansible-lint did not run "
                               "(is ansible-lint on PATH?), or its log changed")
    if recorder.errors or recorder.lint_findings:
        print(f"galaxy-import: FAILED: {tarball.name}: {len(recorder.errors)} error(s), "
              f"{len(recorder.lint_findings)} ansible-lint finding(s) (above)")
        for message in recorder.errors:
            print(f"  error: {message}")
        return 1
    roles = [c for c in data["contents"] if c["content_type"] == "role"]
    print(f"galaxy-import: {tarball.name} imports with galaxy-importer {__version__}: {len(data['contents'])} "
          f"contents ({len(roles)} roles, each with its README), ansible-lint found nothing, "
          f"{len(recorder.warnings)} other warning(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
