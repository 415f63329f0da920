"""The GPU health gate as the playbooks run it (roles/gpu_reclaim, tasks_from health_gate, the entry
point provision.yml imports; recover.yml runs the same health.yml): real ansible-playbook on this
machine, the module reading the TEST-ONLY recorded NVML (tests/fakes/nvml/pynvml.py, NOT NVML: there
is no GPU here) put first on the module's PYTHONPATH. A healthy recorded H100 passes and changes
nothing, in check mode too; one uncorrectable ECC error stops the host with the finding; a host
without a driver passes unless GPUs are required; DCGM's diagnostic (the TEST-ONLY recorded `dcgmi`,
tests/fakes/dcgm/dcgmi, NOT DCGM) runs at the level the role's settings give and a failing one stops
the host naming the test; without dcgmi the result says it is absent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
FAKE = REPO / "tests" / "fakes" / "nvml"
DCGMI = REPO / "tests" / "fakes" / "dcgm" / "dcgmi"

PLAY = """
- hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: The gate
      ansible.builtin.import_role:
        name: gpu_reclaim
        tasks_from: health_gate
    - name: Show the result
      ansible.builtin.debug:
        msg: "RESULT {{ gpu_reclaim_health_result | to_json }}"
"""


def play(tmp_path: Path, gpus: list[dict] | None = None, *args: str, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "play.yml").write_text(PLAY)
    fake = tmp_path / "gpus.json"
    fake.write_text(json.dumps(gpus if gpus is not None else [{}]))
    run_env = dict(os.environ, ANSIBLE_ROLES_PATH=str(REPO / "roles"), ANSIBLE_LIBRARY=str(REPO / "library"),
                   ANSIBLE_MODULE_UTILS=str(REPO / "module_utils"), ANSIBLE_NOCOLOR="1",
                   ANSIBLE_LOCALHOST_WARNING="0", ANSIBLE_INVENTORY_UNPARSED_WARNING="0", ANSIBLE_CALLBACK_RESULT_FORMAT="json",
                   PYTHONPATH=str(FAKE), HSX_FAKE_NVML=str(fake), **env)
    extra = json.dumps({"ansible_python_interpreter": sys.executable})
    return subprocess.run([str(BIN / "ansible-playbook"), "-i", "localhost,", str(tmp_path / "play.yml"),
                           "-e", extra, *args], cwd=REPO, env=run_env, capture_output=True, text=True, timeout=300)


def result(run: subprocess.CompletedProcess) -> dict:
    line = next(x for x in run.stdout.splitlines() if '"msg": "RESULT ' in x)
    return json.loads(json.loads("{" + line.strip() + "}")["msg"][len("RESULT "):])


def test_a_healthy_gpu_passes_and_changes_nothing_in_check_mode_too(tmp_path):
    for args in ((), ("--check",)):
        run = play(tmp_path, None, *args)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
        assert "changed=0" in run.stdout
        got = result(run)
        assert got["passed"] is True and got["gpus"][0]["pcie_width"] == 16 and got["gpus"][0]["remap_failed"] is False


def test_an_uncorrectable_ecc_error_stops_the_host_with_the_finding(tmp_path):
    run = play(tmp_path, [{}, {"bus": "00000000:00:07.0", "ecc_uncorrected": 2}], "-e", "gpu_reclaim_expected_gpus=2")
    assert run.returncode == 2, run.stdout[-3000:]
    assert "GPU health gate failed: GPU 1: 2 uncorrectable ECC errors since the driver loaded" in run.stdout
    assert "The GPUs passed the health gate" in run.stdout and "failed=1" in run.stdout


def test_a_missing_gpu_stops_the_host_and_no_driver_passes_unless_gpus_are_required(tmp_path):
    run = play(tmp_path, [{}], "-e", "gpu_reclaim_expected_gpus=8")
    assert run.returncode == 2 and "1 GPUs present, 8 expected" in run.stdout, run.stdout[-3000:]
    run = play(tmp_path, None, HSX_FAKE_NVML_NO_DRIVER="1")
    assert run.returncode == 0 and result(run)["passed"] is True, run.stdout[-3000:]
    run = play(tmp_path, None, "-e", "gpu_reclaim_require_gpus=true", HSX_FAKE_NVML_NO_DRIVER="1")
    assert run.returncode == 2 and "GPU health: NVML could not start" in run.stdout, run.stdout[-3000:]


def test_dcgm_diag_runs_at_the_roles_level_and_a_failing_one_stops_the_host(tmp_path):
    calls = tmp_path / "dcgmi.calls"
    run = play(tmp_path, None, "-e", f"gpu_reclaim_dcgmi_path={DCGMI}", "-e", "gpu_reclaim_dcgm_diag_level=2",
               HSX_FAKE_DCGMI_LOG=str(calls))
    assert run.returncode == 0 and "changed=0" in run.stdout, run.stdout[-3000:]
    got = result(run)
    assert got["dcgm"]["state"] == "passed" and got["dcgm"]["level"] == 2 and calls.read_text() == "diag -r 2 -j\n"
    run = play(tmp_path, None, "-e", f"gpu_reclaim_dcgmi_path={DCGMI}", HSX_FAKE_DCGMI="fail")
    assert run.returncode == 2, run.stdout[-3000:]
    assert "dcgmi diag -r 1 failed: software (GPU0: Fail): GPU 0 had memory errors" in run.stdout
    # no dcgmi on the PATH: absent, said, not a failure; off: not run
    run = play(tmp_path, None)
    assert run.returncode == 0 and result(run)["dcgm"]["state"] == "absent", run.stdout[-3000:]
    run = play(tmp_path, None, "-e", f"gpu_reclaim_dcgmi_path={DCGMI}", "-e", "gpu_reclaim_dcgm_diag=off",
               HSX_FAKE_DCGMI="fail")
    assert run.returncode == 0 and result(run)["dcgm"]["state"] == "off", run.stdout[-3000:]
