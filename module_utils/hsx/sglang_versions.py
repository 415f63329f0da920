"""The SGLang releases the dump patch supports: the one list every check imports.

Each was tested against the real files of its wheel: the patch against its deepseek_v2.py
(tests/unit/test_patch_sglang_releases.py); the server command line roles/sglang_server renders
against its server arguments, every ForwardBatch field and ForwardMode the dump hook reads against its
forward_batch_info.py, the client's routes and API key against its HTTP server
(tests/unit/test_sglang_fidelity.py, by AST). Floor 0.5.10: the first release whose ForwardBatch
carries `rids`, which the per-request split needs. A new upstream release is added here only after
those tests pass for it (adding it here is what makes them test it); one that fails them stays out,
and support_problem refuses it.

Part of the stdlib-only core: shipped to Ansible hosts as ansible.module_utils.hsx.sglang_versions.
"""

from __future__ import annotations

import re

SUPPORTED_VERSIONS: tuple[str, ...] = (
    "0.5.10",
    "0.5.10.post1",
    "0.5.11",
    "0.5.12",
    "0.5.12.post1",
    "0.5.13",
    "0.5.13.post1",
    "0.5.14",
    "0.5.15",
    "0.5.15.post1",
    "0.5.16",
    "0.5.17",
    "0.5.18",
    "0.5.19",
    "0.5.20",
    "0.5.21",
    "0.5.22",
    "0.5.23",
)
MIN_VERSION = "0.5.10"

# A release known to lack the anchors (the patch must refuse it).
UNSUPPORTED_EXAMPLE = "0.5.4"

_RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?$")


def release_key(version: str) -> tuple[int, int, int, int] | None:
    """(major, minor, patch, post) of a plain release string, None for anything else."""
    m = _RELEASE.match(version.strip())
    return tuple(int(g or 0) for g in m.groups()) if m else None  # type: ignore[return-value]


def base_version(version: str) -> str:
    """Drop a local build label: '0.5.23+cu129' -> '0.5.23'."""
    return version.strip().split("+", 1)[0]


def support_problem(version: str | None) -> str | None:
    """None when supported, else why not (for status output and role failures)."""
    if not version:
        return "SGLang version unknown"
    base = base_version(version)
    if base in SUPPORTED_VERSIONS:
        return None
    key = release_key(base)
    if key is None:
        return (
            f"SGLang {version} is not a release build; supported: {MIN_VERSION} .. {SUPPORTED_VERSIONS[-1]}"
        )
    if key < release_key(MIN_VERSION):  # type: ignore[operator]
        return f"SGLang {version} is older than {MIN_VERSION} (its ForwardBatch has no per-request ids)"
    return f"SGLang {version} is not in the tested list ({MIN_VERSION} .. {SUPPORTED_VERSIONS[-1]})"
