"""examples/stage_data.yml, the documented way the model and the dataset reach the nodes (README,
"Provisioning the model and the dataset"), played on localhost (a local connection stands in for a node;
the sources are local paths, as storage mounted on the node): --check copies nothing and says what it would; a run copies them readable by others (the job's
account); a second run changes nothing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _rsync() -> str:
    """'' when rsync is here (installed first, with the lab's control packages, where root and apt allow)."""
    if shutil.which("rsync"):
        return ""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "rsync is not installed and cannot be here (needs root and apt): apt-get install rsync"
    sys.path.insert(0, str(ROOT / "tests" / "lab"))
    import lab_control  # make lab-ensure's package list (rsync among them)

    lab_control.ensure_control_packages()
    return "" if shutil.which("rsync") else "apt installed no rsync"


def test_stage_data_checks_copies_then_changes_nothing(tmp_path: Path) -> None:
    why = _rsync()
    if why:
        pytest.skip(why)
    source = tmp_path / "shared"
    (source / "model").mkdir(parents=True)
    (source / "model" / "config.json").write_text('{"model_type": "deepseek_v3"}\n')
    (source / "model" / "model-00001.safetensors").write_bytes(os.urandom(4096))
    (source / "model" / "model-00001.safetensors").chmod(0o600)  # as a download can leave it
    (source / "data.jsonl").write_text('{"id": "a", "conversations": []}\n')
    node = tmp_path / "node"
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(f"[extraction_nodes]\nnode-1 ansible_connection=local ansible_python_interpreter={sys.executable}\n"
                         f"[extraction_nodes:vars]\nhsx_become=false\nhsx_model_path={node}/models/m\n"
                         f"hsx_dataset_path={node}/datasets/d.jsonl\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")

    def play(*args: str) -> tuple[int, str, dict[str, int]]:
        proc = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory),
                               "-e", "stage_data_install_rsync=false", *args, str(ROOT / "examples" / "stage_data.yml")],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        m = re.search(r"^node-1\s+:\s+ok=(\d+)\s+changed=(\d+)", proc.stdout, re.M)
        return proc.returncode, proc.stdout, {"ok": int(m.group(1)), "changed": int(m.group(2))} if m else {}

    sources = ["-e", f"stage_data_model_source={source / 'model'}", "-e", f"stage_data_dataset_source={source / 'data.jsonl'}"]
    rc, out, recap = play("--check", *sources)
    assert rc == 0 and recap["changed"] > 0, out[-3000:]
    assert "model-00001.safetensors" in out and not node.exists(), out[-3000:]
    rc, out, recap = play(*sources)
    assert rc == 0 and recap["changed"] > 0, out[-3000:]
    copied = node / "models" / "m" / "model-00001.safetensors"
    assert copied.read_bytes() == (source / "model" / "model-00001.safetensors").read_bytes()
    assert copied.stat().st_mode & 0o777 == 0o644 and (node / "models" / "m").stat().st_mode & 0o777 == 0o755
    assert (node / "datasets" / "d.jsonl").read_text() == (source / "data.jsonl").read_text()
    rc, out, recap = play(*sources)
    assert rc == 0 and recap["changed"] == 0, out[-3000:]
