"""The dump patch against the real model files of every supported SGLang release (deepseek_v2.py,
and llama.py and qwen2.py for the targets beyond DeepSeek: issue #49 item 2), and `hsx patch`.

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


OTHER_FILES = [name for name in sglang_patch.PATCH_FILES if name != "deepseek_v2"]


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
@pytest.mark.parametrize("name", OTHER_FILES)
def test_other_model_files_lifecycle_on_release(version, name, tmp_path):
    """Applied (two blocks, its own patch id), applied again (no change), reverted byte for byte;
    where the blocks sit and what they see: test_sglang_fidelity_targets.py."""
    info = sglang_patch.PATCH_FILES[name]
    patch = patching.Patch.from_dict(sglang_patch.NAMED_PATCHES[info["patch"]])
    target = tmp_path / Path(info["file"]).name
    shutil.copy(sglang_wheels.require(version) / target.name, target)
    original = target.read_bytes()
    r = patching.apply_file(str(target), patch)
    assert r.changed and r.before == "unpatched"
    patched = target.read_text()
    assert patched.count(f"# >>> hsx-patch hsx-sglang-dump-{name} block=") == 2
    assert "self._hsx_dump_class = __class__" in _calls_in(
        ast.parse(patched), info["model_class"], "__init__"
    )
    assert not patching.apply_file(str(target), patch).changed
    assert patching.examine(patched, V2).status == "unpatched"  # DeepSeek's patch id: not in this file
    r = patching.apply_file(str(target), patch, state="absent")
    assert r.changed and r.original_verified and target.read_bytes() == original


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
    assert (pkg / sglang_patch.TARGET).read_bytes() == before and not (
        pkg / sglang_patch.HOOK_FILENAME
    ).exists()


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


# ---------------------------------------------------------------- hsx patch, targets beyond DeepSeek


def _model_dir(path: Path, *architectures: str) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": list(architectures), "hidden_size": 64}))
    return path


def test_hsx_patch_targets_chosen_by_the_model_several_in_one_install(site, tmp_path, capsys):
    pkg = install.find_package(site)
    files = {name: pkg / info["file"] for name, info in sglang_patch.PATCH_FILES.items()}
    originals = {name: f.read_bytes() for name, f in files.items()}
    llama = _model_dir(tmp_path / "llama-3", "LlamaForCausalLM")
    assert hsx(["patch", "apply", "--sglang", str(site), "--model", str(llama), "--no-backup"]) == 0
    out = capsys.readouterr().out
    assert "srt/models/llama.py (target llama): unpatched -> patched: changed (hook module deployed)" in out
    assert files["deepseek_v2"].read_bytes() == originals["deepseek_v2"]
    rc, st = _status(capsys, site)  # no --target: deepseek_v2, as before #49
    assert rc == 1 and (st["target"], st["summary"]) == ("deepseek_v2", "unpatched")
    capsys.readouterr()
    assert hsx(["patch", "status", "--sglang", str(site), "--model", str(llama), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert (st["target"], st["file"], st["summary"]) == ("llama", "srt/models/llama.py", "patched (v1)")

    assert hsx(["patch", "apply", "--sglang", str(site), "--target", "qwen2", "--no-backup"]) == 0
    assert "target qwen2): unpatched -> patched: changed\n" in capsys.readouterr().out  # the hook was there
    assert hsx(["patch", "apply", "--sglang", str(site), "--target", "qwen2"]) == 0
    assert "no change" in capsys.readouterr().out

    # Reverting one target keeps the hook the other still calls; the last revert removes it.
    assert hsx(["patch", "revert", "--sglang", str(site), "--target", "llama", "--no-backup"]) == 0
    out = capsys.readouterr().out
    assert "hook module kept: srt/models/qwen2.py still call it" in out
    assert all((pkg / name).exists() for name in install.DEPLOYED)
    assert hsx(["patch", "revert", "--sglang", str(site), "--target", "qwen2", "--no-backup"]) == 0
    assert "(hook module removed)" in capsys.readouterr().out
    assert not any((pkg / name).exists() for name in install.DEPLOYED)
    assert {name: f.read_bytes() for name, f in files.items()} == originals


def test_hsx_patch_refuses_a_target_its_release_refuses_by_name(tmp_path, capsys):
    """Qwen3: through qwen2.py's Qwen2Model to 0.5.20; from 0.5.21 its Qwen3Model has a forward
    of its own without the anchor, refused (also with --force) before anything changes."""
    newest = sglang_wheels.make_package(SUPPORTED_VERSIONS[-1], tmp_path / "new")
    before = {p: p.read_bytes() for p in (newest / "srt" / "models").iterdir()}
    qwen3 = _model_dir(tmp_path / "qwen3", "Qwen3ForCausalLM")
    for extra in ([], ["--force"]):
        assert hsx(["patch", "apply", "--sglang", str(newest), "--model", str(qwen3), *extra]) == 1
        err = capsys.readouterr().err
        assert f"target qwen3 is refused in SGLang {SUPPORTED_VERSIONS[-1]} (from 0.5.21 on)" in err, err
        assert "Qwen3Model (srt/models/qwen3.py) has a forward of its own" in err and "nothing changed" in err
    assert {p: p.read_bytes() for p in before} == before and not (
        newest / sglang_patch.HOOK_FILENAME
    ).exists()
    rc, st = _status(capsys, newest.parent)
    assert rc == 1 and st["summary"] == "unpatched"  # deepseek_v2: the default target, unaffected

    oldest = sglang_wheels.make_package(SUPPORTED_VERSIONS[0], tmp_path / "old")
    assert hsx(["patch", "apply", "--sglang", str(oldest), "--target", "qwen3", "--no-backup"]) == 0
    assert "srt/models/qwen2.py (target qwen3): unpatched -> patched" in capsys.readouterr().out


def test_hsx_patch_model_it_cannot_place_is_a_usage_error(site, tmp_path, capsys):
    pkg = install.find_package(site)
    before = {p: p.read_bytes() for p in (pkg / "srt" / "models").iterdir()}
    mistral = _model_dir(tmp_path / "mistral", "MistralForCausalLM")
    assert hsx(["patch", "apply", "--sglang", str(site), "--model", str(mistral)]) == 2
    err = capsys.readouterr().err
    assert "no patch target for architectures ['MistralForCausalLM']" in err and "LlamaForCausalLM" in err
    assert hsx(["patch", "apply", "--sglang", str(site), "--model", str(tmp_path / "nowhere")]) == 2
    assert "nowhere/config.json: cannot read the model's config" in capsys.readouterr().err
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"architectures": "LlamaForCausalLM"}')
    assert hsx(["patch", "status", "--sglang", str(site), "--model", str(tmp_path / "odd")]) == 2
    assert "no `architectures` list of names" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in before} == before and not (pkg / sglang_patch.HOOK_FILENAME).exists()
