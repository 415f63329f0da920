"""library/source_patch.py choosing SGLang's model file from the target (issue #49 item 2): driven
through AnsibleModule with patch_module_args on a package tree of real release files
(tests/sglang_wheels.py make_package), as the sglang_patch role calls it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from ansible.module_utils.testing import patch_module_args
from ansible_modules import load_module

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import sglang_wheels  # noqa: E402

from hsx.sglang_versions import SUPPORTED_VERSIONS  # noqa: E402

source_patch = load_module("source_patch")
NEWEST, OLDEST = SUPPORTED_VERSIONS[-1], SUPPORTED_VERSIONS[0]


def run_module(capsys, **args) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        source_patch.main()
    return json.loads(capsys.readouterr().out)


def _model(path: Path, arch: str) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": [arch]}))
    return str(path)


def _files(pkg: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((pkg / "srt" / "models").iterdir())}


def test_the_model_chooses_the_file_and_its_patch(capsys, tmp_path):
    pkg = sglang_wheels.make_package(NEWEST, tmp_path / "site")
    before = _files(pkg)
    args = dict(
        sglang_package=str(pkg), sglang_target="auto", sglang_model=_model(tmp_path / "m", "Qwen2ForCausalLM")
    )
    r = run_module(capsys, **args, sglang_version=NEWEST, _ansible_check_mode=True)
    assert (r["changed"], r["before"], r["path"]) == (True, "unpatched", str(pkg / "srt/models/qwen2.py"))
    assert (r["sglang_target"], r["model_class"], r["patch_name"]) == (
        "qwen2",
        "Qwen2Model",
        "sglang_dump_hook_qwen2",
    )
    assert _files(pkg) == before  # check mode
    r = run_module(capsys, **args, sglang_version=NEWEST)
    assert (
        r["changed"]
        and "# >>> hsx-patch hsx-sglang-dump-qwen2 block=init v=1 "
        in (pkg / "srt/models/qwen2.py").read_text()
    )
    # The role's act and verify steps address the same file by path and named patch.
    r = run_module(capsys, path=r["path"], patch=r["patch_name"])
    assert not r["changed"] and r["before"] == "patched"
    r = run_module(capsys, **args, state="absent")
    assert r["changed"] and r["original_verified"] and _files(pkg) == before
    # Unset: deepseek_v2 (the first target), as before #49.
    r = run_module(capsys, sglang_package=str(pkg), _ansible_check_mode=True)
    assert (r["sglang_target"], r["path"]) == ("deepseek_v2", str(pkg / "srt/models/deepseek_v2.py"))


def test_refusals_change_nothing(capsys, tmp_path):
    pkg = sglang_wheels.make_package(NEWEST, tmp_path / "site")
    before = _files(pkg)
    qwen3 = _model(tmp_path / "q3", "Qwen3ForCausalLM")
    r = run_module(
        capsys, sglang_package=str(pkg), sglang_target="auto", sglang_model=qwen3, sglang_version=NEWEST
    )
    assert r["failed"] and r["sglang_target"] == "qwen3"
    assert (
        f"target qwen3 is refused in SGLang {NEWEST} (from 0.5.21 on)" in r["msg"]
        and "nothing changed" in r["msg"]
    )
    r = run_module(capsys, sglang_package=str(pkg), sglang_target="auto", sglang_version=NEWEST)
    assert r["failed"] and "target auto needs the model's directory" in r["msg"]
    mistral = _model(tmp_path / "mi", "MistralForCausalLM")
    r = run_module(capsys, sglang_package=str(pkg), sglang_target="auto", sglang_model=mistral)
    assert r["failed"] and "no patch target for architectures ['MistralForCausalLM']" in r["msg"]
    r = run_module(capsys, sglang_package=str(pkg), sglang_target="llama", patch="sglang_dump_hook")
    assert (
        r["failed"]
        and "patch sglang_dump_hook is not srt/models/llama.py's (sglang_dump_hook_llama" in r["msg"]
    )
    r = run_module(capsys, sglang_package=str(pkg), path=str(pkg / "srt/models/llama.py"))
    assert r["failed"] and "mutually exclusive" in r["msg"]
    assert _files(pkg) == before
    old = sglang_wheels.make_package(OLDEST, tmp_path / "old")  # qwen3 through qwen2.py, to 0.5.20
    r = run_module(capsys, sglang_package=str(old), sglang_target="qwen3", sglang_version=OLDEST)
    assert r["changed"] and r["path"] == str(old / "srt/models/qwen2.py")


def test_ansible_doc_names_the_targets(module_doc):
    options = module_doc("source_patch")["doc"]["options"]
    assert set(options["sglang_target"]["choices"]) == {"auto", "deepseek_v2", "llama", "qwen2", "qwen3"}
    assert {"sglang_dump_hook_llama", "sglang_dump_hook_qwen2"} <= set(options["patch"]["choices"])
