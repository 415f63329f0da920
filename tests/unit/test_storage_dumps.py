"""storage_guard sizes the dump directory from the run (issue #29 item 2), run by Ansible on this
machine against a real tmpfs (/dev/shm): room for the dumps in flight keeps them in RAM; too many
requests in flight (the same numbers x 100,000) fall back to the data mount, saying so with the
numbers; a choice the deployed job's config records is kept (a rollout must not move the server's
dumps away from where the job reads them) unless storage_guard_dump_redecide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir() or os.statvfs(SHM).f_bavail == 0, reason="needs a tmpfs /dev/shm")


def test_dump_dir_sized_from_the_run(tmp_path):
    ram, config = str(SHM / f"hsx-test-dumps-{os.getpid()}"), tmp_path / "extract.yaml"
    config.write_text(f"dump_dir: {ram}\n")
    model = tmp_path / "model"
    model.mkdir()
    # Kimi-K2.5's shape: hidden in text_config.
    (model / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 7168}}))
    base = {"hsx_data_mount": "/", "hsx_output_dir": str(tmp_path / "out"), "hsx_backend": "sglang",
            "hsx_model_path": str(model), "hsx_max_length": 64, "hsx_layers": "auto", "hsx_dtype": "bf16",
            "storage_guard_write_probe": False, "hsx_dump_dir": ram, "hsx_dump_budget_mb": 1,
            "hsx_config_path": str(tmp_path / "none.yaml")}
    cases = {"fits": {"hsx_concurrency": 8}, "falls_back": {"hsx_concurrency": 800000},
             "kept": {"hsx_concurrency": 800000, "hsx_config_path": str(config)},
             "redecided": {"hsx_concurrency": 800000, "hsx_config_path": str(config),
                           "storage_guard_dump_redecide": True}}
    plays = [{"name": case, "hosts": "localhost", "gather_facts": False, "vars": {**base, **extra},
              "roles": ["storage_guard"],
              "post_tasks": [{"ansible.builtin.copy": {"content": "{{ {'in_use': hsx_dump_dir_in_use, "
                                                                  "'dumps': storage_guard_result.dumps} | to_json }}",
                                                       "dest": str(tmp_path / f"{case}.json"), "mode": "0600"}}]}
             for case, extra in cases.items()]
    (tmp_path / "play.yml").write_text(json.dumps(plays))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                           "-e", f"ansible_python_interpreter={sys.executable}", str(tmp_path / "play.yml")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    got = {case: json.loads((tmp_path / f"{case}.json").read_text()) for case in cases}
    # One sample: 64 tokens x (7168 x (1 + 3) x 2 B + 8) = 3,670,528 bytes; x 8 in flight x margin 2.
    fits = got["fits"]["dumps"]
    assert got["fits"]["in_use"] == ram and fits["in_ram"] and not fits["fallback"]
    assert int(fits["sample_bytes"]) == 64 * (7168 * 4 * 2 + 8) and int(fits["need_bytes"]) == 8 * 3670528 * 2
    assert fits["message"].startswith(f"dumps in RAM at {ram}: 8 requests in flight x ")
    back = got["falls_back"]
    assert back["in_use"] == "//hsx/dumps" and back["dumps"]["fallback"]
    assert "dumps FELL BACK to //hsx/dumps on the data disk" in back["dumps"]["message"]
    assert "800000 requests in flight" in back["dumps"]["message"] and "budget" in back["dumps"]["message"]
    assert got["kept"]["in_use"] == ram and got["kept"]["dumps"]["message"].startswith(f"dumps kept at {ram}")
    assert got["redecided"]["in_use"] == "//hsx/dumps"
