"""The SGLang releases the dump patch supports: the one list every check imports; and which target
(hsx.sglang_patch.TARGETS) a model needs and whether a release supports it.

Each was tested against the real files of its wheel: the patch against its model files, for every
target (tests/unit/test_patch_sglang_releases.py, tests/unit/test_sglang_fidelity_targets.py: the
anchors in the target's class and methods, the final normed state in scope at the forward's, the
patched file compiled); the server command line roles/sglang_server renders
against its server arguments, every ForwardBatch field and ForwardMode the dump hook reads against its
forward_batch_info.py, the client's routes and API key against its HTTP server
(tests/unit/test_sglang_fidelity.py, by AST). Floor 0.5.10: the first release whose ForwardBatch
carries `rids`, which the per-request split needs. A new upstream release is added here only after
those tests pass for it (adding it here is what makes them test it); one that fails them stays out,
and support_problem refuses it.

Part of the stdlib-only core: shipped to Ansible hosts as ansible.module_utils.hsx.sglang_versions.
"""

from __future__ import annotations

import os
import re

from .modelconfig import read_json
from .sglang_patch import DEFAULT_TARGET, PATCH_FILES, TARGETS

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


# Targets a supported release refuses, from which release on, and why (by name: `hsx patch` and the
# sglang_patch role fail before any change). tests/unit/test_sglang_fidelity_targets.py derives this
# from each release's files and must find exactly this.
TARGET_REFUSED_FROM: dict[str, tuple[str, str]] = {
    "qwen3": (
        "0.5.21",
        "its Qwen3Model (srt/models/qwen3.py) has a forward of its own, without the anchor"
        " `if len(aux_hidden_states) == 0:`",
    ),
}


class TargetError(ValueError):
    """The target cannot be decided: an unknown name or architecture, or an unreadable config.json."""


def target_problem(target: str, version: str | None) -> str | None:
    """None when `target` may be patched in SGLang `version` (its release support is
    support_problem's), else why not, naming the target and the release."""
    if target not in TARGETS:
        return f"unknown patch target {target!r} (known: {', '.join(sorted(TARGETS))})"
    refused = TARGET_REFUSED_FROM.get(target)
    key = release_key(base_version(version)) if version else None
    if refused and key is not None and key >= release_key(refused[0]):  # type: ignore[operator]
        return f"target {target} is refused in SGLang {version} (from {refused[0]} on): {refused[1]}"
    return None


def target_file(target: str) -> dict[str, str]:
    """{file (relative to the sglang package), model_class, patch (the named patch)} of a target."""
    if target not in TARGETS:
        raise TargetError(f"unknown patch target {target!r} (known: {', '.join(sorted(TARGETS))})")
    return PATCH_FILES[TARGETS[target]["file"]]


def target_for(architectures: list[str]) -> str:
    """The target of a model whose config.json lists `architectures` (the first one known)."""
    for arch in architectures:
        for name, spec in TARGETS.items():
            if arch in spec["architectures"]:
                return name
    known = sorted(a for spec in TARGETS.values() for a in spec["architectures"])
    raise TargetError(
        f"no patch target for architectures {architectures} (the dump patch knows {', '.join(known)})"
    )


def read_architectures(model_dir: str) -> list[str]:
    """config.json's `architectures` of the model in `model_dir` (a link to it is followed: a hub
    snapshot's files are links), read as data (modelconfig.read_json: a regular file of at most
    MAX_CONFIG_BYTES, JSON): a JSON object whose `architectures` is a non-empty list of strings;
    TargetError naming the file."""
    path = os.path.join(model_dir, "config.json")
    try:
        config = read_json(model_dir)
    except ValueError as exc:
        raise TargetError(str(exc)) from None
    archs = config.get("architectures") if isinstance(config, dict) else None
    if not (isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs)):
        raise TargetError(f"{path}: no `architectures` list of names (found {archs!r:.80})")
    return archs


def resolve_target(target: str | None, model_dir: str | None = None) -> str:
    """The target to patch: `target` itself when it names one; "auto" (or None) with a model
    directory: the one its config.json's architectures need; None without one: DEFAULT_TARGET."""
    if target and target != "auto":
        target_file(target)  # TargetError for an unknown name
        return target
    if model_dir:
        return target_for(read_architectures(model_dir))
    if target == "auto":
        raise TargetError("target auto needs the model's directory (its config.json names the architecture)")
    return DEFAULT_TARGET
