"""roles/sglang_patch choosing the model file from the model (issue #49 item 2), run for real by
ansible-playbook on this machine: each host (connection local) has its own package tree of real
release files (tests/sglang_wheels.py make_package, with the dist-info a pip install leaves) and
its own interpreter that imports it, and a model directory whose config.json names the
architecture. The role as recover.yml runs it, sglang_patch_target left at auto.
(The molecule scenario tests/molecule/sglang_patch runs it on lab hosts with pip-installed wheels.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sglang_wheels  # noqa: E402

from hsx.sglang_versions import SUPPORTED_VERSIONS  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
NEWEST = SUPPORTED_VERSIONS[-1]

PLAY = """
- hosts: all
  gather_facts: false
  tasks:
    - name: The patch stage, as recover.yml runs it
      block:
        - name: Patch
          ansible.builtin.include_role:
            name: sglang_patch
      rescue:
        - name: Note why
          ansible.builtin.set_fact:
            failed_msg: "{{ ansible_failed_result.msg }}"
    - name: What the test reads
      ansible.builtin.copy:
        dest: "{{ out_dir }}/{{ inventory_hostname }}.json"
        mode: "0600"
        content: "{{ {'result': sglang_patch_result | default(none), 'failed': failed_msg | default(none)} | to_json }}"
      check_mode: false
      changed_when: false
"""


def node(tmp_path: Path, name: str, architecture: str) -> tuple[dict, Path]:
    """Host vars of a node with SGLang NEWEST installed and a model of `architecture`; its package."""
    site = tmp_path / name / "site-packages"
    pkg = sglang_wheels.make_package(NEWEST, site)
    (site / f"sglang-{NEWEST}.dist-info").mkdir()
    (site / f"sglang-{NEWEST}.dist-info" / "METADATA").write_text(f"Name: sglang\nVersion: {NEWEST}\n")
    python = tmp_path / name / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    model = tmp_path / name / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": [architecture], "hidden_size": 64}))
    hostvars = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "hsx_sglang_venv": "",
        "sglang_patch_python": str(python),
        "hsx_model_path": str(model),
        "sglang_patch_backup": False,
    }
    return hostvars, pkg


def play(tmp_path: Path, hosts: dict[str, dict], *args: str) -> subprocess.CompletedProcess:
    out = tmp_path / "seen"
    out.mkdir(exist_ok=True)
    inventory = {"all": {"hosts": hosts, "vars": {"out_dir": str(out)}}}
    (tmp_path / "inventory.yml").write_text(yaml.safe_dump(inventory))
    (tmp_path / "play.yml").write_text(PLAY)
    env = dict(
        os.environ,
        ANSIBLE_ROLES_PATH=str(REPO / "roles"),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_LOCALHOST_WARNING="0",
        ANSIBLE_LIBRARY=str(REPO / "library"),
        ANSIBLE_MODULE_UTILS=str(REPO / "module_utils"),
        ANSIBLE_FILTER_PLUGINS=str(REPO / "filter_plugins"),
    )
    return subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "-i",
            str(tmp_path / "inventory.yml"),
            str(tmp_path / "play.yml"),
            *args,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def seen(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / "seen" / f"{name}.json").read_text())


def models(pkg: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((pkg / "srt" / "models").iterdir())}


def test_the_role_patches_the_file_the_model_needs(tmp_path):
    llama, llama_pkg = node(tmp_path, "llama-node", "LlamaForCausalLM")
    qwen3, qwen3_pkg = node(tmp_path, "qwen3-node", "Qwen3ForCausalLM")
    before = {"llama": models(llama_pkg), "qwen3": models(qwen3_pkg)}
    run = play(tmp_path, {"llama-node": llama, "qwen3-node": qwen3})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]

    got = seen(tmp_path, "llama-node")
    assert got["failed"] is None, got
    result = got["result"]
    assert (result["target"], result["model_class"], result["patch_name"]) == (
        "llama",
        "LlamaModel",
        "sglang_dump_hook_llama",
    )
    assert (
        result["file"] == str(llama_pkg / "srt/models/llama.py")
        and result["changed"]
        and result["after"] == "patched"
    )
    after = models(llama_pkg)
    assert [n for n in after if after[n] != before["llama"][n]] == ["llama.py"]
    assert "# >>> hsx-patch hsx-sglang-dump-llama block=init v=1 " in after["llama.py"].decode()
    assert (llama_pkg / "hsx_dump_hook.py").is_file() and (llama_pkg / "hsx_dump_format.py").is_file()

    # Qwen3 in 0.5.21+: refused by name, before anything changed.
    got = seen(tmp_path, "qwen3-node")
    assert got["result"] is None and got["failed"], got
    assert f"Refusing to patch SGLang {NEWEST} on qwen3-node" in got["failed"]
    assert "target qwen3): " in got["failed"] and "target qwen3 is refused in SGLang" in got["failed"]
    assert models(qwen3_pkg) == before["qwen3"] and not (qwen3_pkg / "hsx_dump_hook.py").exists()

    # A second run changes nothing (the llama host; the qwen3 host still refused).
    again = play(tmp_path, {"llama-node": llama})
    assert again.returncode == 0 and "changed=0" in again.stdout, again.stdout[-3000:]
    assert not seen(tmp_path, "llama-node")["result"]["changed"]
