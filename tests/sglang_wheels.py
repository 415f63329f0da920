"""Real SGLang release files for tests, downloaded once and cached outside the repository.

`pip download --no-deps sglang==X` gives the wheel (a zip, ~40 MB); we keep only the few files the
tests read under $HSX_SGLANG_WHEELS (default ~/.cache/hsx/sglang-wheels)/<version>/, so CI re-runs
reuse them: the model files the patch targets (deepseek_v2.py, llama.py, qwen2.py, qwen3.py; kimi_k25.py,
which runs DeepSeek-V3 for Kimi-K2.5), the version files and aux_hidden_states.py by their base names (KEEP),
and the sources tests/unit/test_sglang_fidelity.py reads by AST (server arguments, ForwardBatch, the
HTTP server's routes and auth) under src/ at their package paths (KEEP_SRC). A cache made with other
KEEP lists is fetched again (.complete records them).

A release that cannot be fetched FAILS the test that needs it (require), so a CI run without the
registry says so instead of passing with skips; HSX_SGLANG_WHEELS_OPTIONAL=1 makes it a skip
(working offline without a cache).

    python tests/sglang_wheels.py            # prefetch every supported release (+ the refused one)
    python tests/sglang_wheels.py --check    # list registry releases missing from hsx/sglang_versions.py
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from fnmatch import fnmatchcase
from pathlib import Path

KEEP = {
    "sglang/srt/models/deepseek_v2.py": "deepseek_v2.py",
    "sglang/srt/models/llama.py": "llama.py",
    "sglang/srt/models/qwen2.py": "qwen2.py",
    "sglang/srt/models/qwen3.py": "qwen3.py",
    "sglang/srt/models/kimi_k25.py": "kimi_k25.py",
    "sglang/_version.py": "_version.py",
    "sglang/version.py": "version.py",
    "sglang/srt/layers/aux_hidden_states.py": "aux_hidden_states.py",
}
# Kept under src/ at their package paths (fnmatch patterns; a release lacks some of them).
KEEP_SRC = (
    "sglang/srt/server_args.py",
    "sglang/srt/arg_groups/arg_utils.py",
    "sglang/srt/arg_groups/argparse_actions.py",
    "sglang/srt/arg_groups/choices.py",
    "sglang/srt/arg_groups/fields/*.py",
    "sglang/srt/model_executor/cuda_graph_config.py",
    "sglang/srt/model_executor/forward_batch_info.py",
    "sglang/srt/entrypoints/http_server.py",
    "sglang/srt/utils/auth.py",
)
# Wheels are cp311 manylinux from 0.5.11 on; ask for that platform explicitly so a runner on
# another Python version still gets the same files.
PIP_PLATFORM = ["--only-binary=:all:", "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64"]

_failures: dict[str, str] = {}


def cache_root() -> Path:
    return Path(os.environ.get("HSX_SGLANG_WHEELS") or Path.home() / ".cache" / "hsx" / "sglang-wheels")


def _keep_mark() -> str:
    """What .complete records: the KEEP lists the cache was made with."""
    return "keep: " + " ".join(sorted(KEEP)) + " | " + " ".join(KEEP_SRC)


def _is_complete(dest: Path) -> bool:
    try:
        lines = (dest / ".complete").read_text().splitlines()
    except OSError:
        return False
    return _keep_mark() in lines


def release_dir(version: str) -> tuple[Path | None, str]:
    """The cached files of one release (downloading them if needed), or None and why not."""
    dest = cache_root() / version
    if _is_complete(dest):
        return dest, ""
    if version in _failures:
        return None, _failures[version]
    if len(_failures) >= 2:  # offline: do not spend a pip run on every remaining release
        return None, f"not tried after {len(_failures)} failed downloads ({next(iter(_failures.values()))})"
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hsx-wheel-", dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PIP_PLATFORM]
        cmd += [f"sglang=={version}", "-d", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            _failures[version] = f"pip download sglang=={version} failed: {exc}"
            return None, _failures[version]
        wheels = list(Path(tmp).glob("sglang-*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel"]
            _failures[version] = f"pip download sglang=={version} failed: {tail[0]}"
            return None, _failures[version]
        staging = Path(tmp) / "files"
        staging.mkdir()
        with zipfile.ZipFile(wheels[0]) as zf:
            names = set(zf.namelist())
            for member, name in KEEP.items():
                if member in names:
                    (staging / name).write_bytes(zf.read(member))
            for member in sorted(names):
                if any(fnmatchcase(member, pattern) for pattern in KEEP_SRC):
                    target = staging / "src" / member
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(zf.read(member))
        (staging / ".complete").write_text(f"{wheels[0].name}\n{_keep_mark()}\n")
        old = Path(tmp) / "old"
        if dest.exists():
            os.replace(dest, old)  # an older cache (other KEEP lists): removed with tmp
        os.replace(staging, dest)  # a concurrent run sees all files or none
    return dest, ""


def require(version: str) -> Path:
    """release_dir for pytest: FAILS the test, saying why, when the release is unavailable (a skip
    would let a CI run without the registry pass unchecked); HSX_SGLANG_WHEELS_OPTIONAL=1: skips."""
    import pytest

    path, why = release_dir(version)
    if path is None:
        msg = f"SGLang {version} files unavailable: {why}"
        if os.environ.get("HSX_SGLANG_WHEELS_OPTIONAL") == "1":
            pytest.skip(msg)
        pytest.fail(f"{msg} (HSX_SGLANG_WHEELS_OPTIONAL=1 skips instead)", pytrace=False)
    return path


def release_src(version: str) -> Path:
    """require(version)'s KEEP_SRC files: src/sglang/... as in the wheel."""
    return require(version) / "src"


def make_package(version: str, site: Path) -> Path:
    """A minimal installed `sglang` package tree (real files of the release) under `site`."""
    src = require(version)
    pkg = site / "sglang"
    (pkg / "srt" / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for name in (n for n in KEEP.values() if n not in ("_version.py", "version.py", "aux_hidden_states.py")):
        if (src / name).exists():  # the release's model files
            shutil.copy(src / name, pkg / "srt" / "models" / name)
    for name in ("_version.py", "version.py"):
        if (src / name).exists():
            shutil.copy(src / name, pkg / name)
    return pkg


def registry_versions() -> list[str] | None:
    """All sglang releases the registry lists, newest first; None when it cannot be asked."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", "sglang"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"Available versions:\s*(.+)", proc.stdout)
    return [v.strip() for v in m.group(1).split(",")] if m else None


def missing_releases() -> list[str] | None:
    """Registry releases >= the floor that hsx/sglang_versions.py does not list yet."""
    from hsx.sglang_versions import MIN_VERSION, SUPPORTED_VERSIONS, release_key

    listed = registry_versions()
    if listed is None:
        return None
    floor = release_key(MIN_VERSION)
    return sorted(
        (v for v in listed if (k := release_key(v)) and k >= floor and v not in SUPPORTED_VERSIONS),  # type: ignore[operator]
        key=release_key,  # type: ignore[arg-type, return-value]
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hsx.sglang_versions import SUPPORTED_VERSIONS, UNSUPPORTED_EXAMPLE

    if "--check" in sys.argv:
        missing = missing_releases()
        print("registry unreachable" if missing is None else f"not in hsx/sglang_versions.py: {missing or 'none'}")
        sys.exit(1 if missing else 0)
    bad = 0
    for v in (*SUPPORTED_VERSIONS, UNSUPPORTED_EXAMPLE):
        path, why = release_dir(v)
        print(f"{v}: {path or why}")
        bad += path is None
    sys.exit(1 if bad else 0)
