"""The dump patch against the real deepseek_v2.py of every supported SGLang release, and `hsx patch`.

Release files come from `pip download --no-deps sglang==X` (tests/sglang_wheels.py caches them);
a test skips, saying why, when its release cannot be downloaded.
"""

from __future__ import annotations

import argparse
import ast
import json
import shutil
import sys
from pathlib import Path

import pytest

from extraction.commands import patch as patch_command
from extraction.sglang import install
from hsx import patching, sglang_patch
from hsx.sglang_versions import SUPPORTED_VERSIONS, UNSUPPORTED_EXAMPLE

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sglang_wheels  # noqa: E402

V2 = patching.Patch.from_dict(sglang_patch.SGLANG_DUMP_PATCH)
V1 = patching.Patch.from_dict(sglang_patch.SGLANG_DUMP_PATCH_V1)


def _calls_in(tree: ast.Module, cls: str, method: str) -> str:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    return ast.unparse(item)
    raise AssertionError(f"{cls}.{method} not found")


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_patch_lifecycle_on_release(version, tmp_path):
    target = tmp_path / "deepseek_v2.py"
    shutil.copy(sglang_wheels.require(version) / "deepseek_v2.py", target)
    original = target.read_bytes()

    r = patching.apply_file(str(target), V1)
    assert r.changed and r.before == "unpatched"
    assert patching.examine(target.read_text(), V2).status == "outdated"
    r = patching.apply_file(str(target), V2)  # upgraded in place
    assert r.changed and r.before == "outdated" and r.found_version == "1"
    patched = target.read_text()
    assert "v=1 " not in patched and patched.count(f"v=2 sha={V2.digest}") == 2

    tree = ast.parse(patched)  # still parses, and the calls sit in DeepseekV2Model
    assert "self._hsx_dump = " in _calls_in(tree, "DeepseekV2Model", "__init__")
    fwd = _calls_in(tree, "DeepseekV2Model", "forward")
    assert fwd.index("self._hsx_dump.after_forward") < fwd.index("if len(aux_hidden_states) == 0")

    again = patching.apply_file(str(target), V2)
    assert not again.changed and again.before == "patched"
    r = patching.apply_file(str(target), V2, state="absent")
    assert r.changed and r.original_verified
    assert target.read_bytes() == original


def test_release_without_anchors_is_refused(tmp_path):
    target = tmp_path / "deepseek_v2.py"
    shutil.copy(sglang_wheels.require(UNSUPPORTED_EXAMPLE) / "deepseek_v2.py", target)
    before = target.read_bytes()
    assert patching.examine(before.decode(), V2).status == "unsupported"
    with pytest.raises(
        patching.PatchError, match=r"anchor of block init \('self.layers_to_capture = \[\]'\) not found"
    ):
        patching.apply_file(str(target), V2)
    assert target.read_bytes() == before


def test_every_registry_release_from_the_floor_is_listed():
    missing = sglang_wheels.missing_releases()
    if missing is None:
        pytest.skip("package registry unreachable: cannot list sglang releases")
    assert missing == [], (
        f"new SGLang releases {missing}: test them and add them to module_utils/hsx/sglang_versions.py"
    )


# ---------------------------------------------------------------- hsx patch


def hsx(argv: list[str]) -> int:
    """`hsx ARGV` through the patch command alone (cli.main would import every command's deps)."""
    parser = argparse.ArgumentParser(prog="hsx")
    patch_command.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture
def site(tmp_path):
    newest = SUPPORTED_VERSIONS[-1]
    sglang_wheels.make_package(newest, tmp_path / "lib" / "python3.11" / "site-packages")
    return tmp_path  # a venv-shaped prefix


def _status(capsys, path) -> tuple[int, dict]:
    capsys.readouterr()
    rc = hsx(["patch", "status", "--sglang", str(path), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_hsx_patch_status_apply_revert(site, capsys):
    pkg = install.find_package(site)
    target = pkg / sglang_patch.TARGET
    original = target.read_bytes()
    rc, st = _status(capsys, site)
    assert rc == 1 and st["summary"] == "unpatched" and st["version"] == SUPPORTED_VERSIONS[-1]

    assert hsx(["patch", "apply", "--sglang", str(site), "--check", "--diff"]) == 0
    out = capsys.readouterr().out
    assert "would change (hook module deployed)" in out and "+        self._hsx_dump = " in out
    assert target.read_bytes() == original and not (pkg / sglang_patch.HOOK_FILENAME).exists()

    assert hsx(["patch", "apply", "--sglang", str(pkg), "--no-backup"]) == 0
    rc, st = _status(capsys, pkg)
    assert rc == 0 and st["summary"] == "patched (v2)" and st["hook"] == "current"
    assert (pkg / sglang_patch.HOOK_FILENAME).read_bytes() == install.HOOK_SOURCE.read_bytes()
    assert (pkg / sglang_patch.FORMAT_FILENAME).read_bytes() == install.FORMAT_SOURCE.read_bytes()
    assert hsx(["patch", "apply", "--sglang", str(site)]) == 0
    assert "no change" in capsys.readouterr().out

    (pkg / sglang_patch.HOOK_FILENAME).write_text("# stale\n")
    rc, st = _status(capsys, site)
    assert rc == 1 and st["summary"] == "patched (v2), but the hook files are different (hsx_dump_hook.py)"
    (pkg / sglang_patch.FORMAT_FILENAME).unlink()  # the format the hook imports, checked the same
    rc, st = _status(capsys, site)
    assert rc == 1 and st["hook"] == "missing (hsx_dump_format.py)"
    assert hsx(["patch", "apply", "--sglang", str(site)]) == 0
    assert _status(capsys, site)[1]["hook"] == "current"

    assert hsx(["patch", "revert", "--sglang", str(site), "--no-backup"]) == 0
    assert target.read_bytes() == original
    assert not any((pkg / name).exists() for name in install.DEPLOYED)
    assert list(target.parent.glob("*.hsx-bak")) == []


def test_hsx_patch_status_outdated_and_upgrade(site, capsys):
    pkg = install.find_package(site)
    patching.apply_file(str(pkg / sglang_patch.TARGET), V1)
    rc, st = _status(capsys, site)
    assert rc == 1 and st["status"] == "outdated" and st["found_version"] == "1"
    assert st["summary"].startswith("outdated (holds v1")
    assert hsx(["patch", "apply", "--sglang", str(site)]) == 0
    assert "outdated -> patched: changed" in capsys.readouterr().out
    assert _status(capsys, site)[1]["summary"] == "patched (v2)"


def test_hsx_patch_refuses_unsupported_versions_before_any_change(site, capsys):
    pkg = install.find_package(site)
    (pkg.parent / "sglang-0.5.99.dist-info").mkdir()
    (pkg.parent / "sglang-0.5.99.dist-info" / "METADATA").write_text("Name: sglang\nVersion: 0.5.99\n")
    before = (pkg / sglang_patch.TARGET).read_bytes()
    rc, st = _status(capsys, site)
    assert (
        rc == 1
        and st["summary"] == "unsupported (SGLang 0.5.99 is not in the tested list (0.5.10 .. 0.5.23))"
    )
    assert hsx(["patch", "apply", "--sglang", str(site)]) == 1
    assert "nothing changed (--force to patch anyway)" in capsys.readouterr().err
    assert (pkg / sglang_patch.TARGET).read_bytes() == before and not (pkg / sglang_patch.HOOK_FILENAME).exists()


def test_hsx_patch_refuses_release_without_anchors(tmp_path, capsys):
    pkg = sglang_wheels.make_package(UNSUPPORTED_EXAMPLE, tmp_path)
    rc, st = _status(capsys, tmp_path)
    assert rc == 1 and st["summary"].startswith("unsupported (SGLang 0.5.4 is older than 0.5.10")
    assert hsx(["patch", "apply", "--sglang", str(pkg), "--force"]) == 1
    assert "not found" in capsys.readouterr().err
    assert not (pkg / sglang_patch.HOOK_FILENAME).exists()


def test_hsx_patch_bad_path_is_a_usage_error(tmp_path, capsys):
    assert hsx(["patch", "status", "--sglang", str(tmp_path)]) == 2
    assert "no sglang package" in capsys.readouterr().err


def test_find_package_by_asking_a_python(site, monkeypatch):
    pkg = install.find_package(site)
    monkeypatch.setenv("PYTHONPATH", str(pkg.parent))
    assert install.find_package(sys.executable) == pkg
    monkeypatch.setenv("PYTHONPATH", str(site))  # no sglang importable there
    with pytest.raises(install.InstallError, match="has no importable sglang"):
        install.find_package(sys.executable)
