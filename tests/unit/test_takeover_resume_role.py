"""Issue #39 review items 3 and 8, at role level on a local stand-in host (systemd is the lab's:
tests/integration/test_fleet.py runs the whole takeover on real hosts).

3: roles/extraction_job's preflight compares the buckets the job last ran with (OUTPUT/buckets.json,
written at each start) with the rendered ones: a job running (or finished with) other buckets is
restarted (started), whether or not its config changed in this run, so a takeover interrupted after
the config was written and before the restart is completed by a rerun.
8: a rerun of playbooks/takeover.yml for a retired host that answers again (a network partition:
it was up all along) reaches play 3, which stops its job.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_takeover_play import IDS, flat, plant_output, takeover

from hsx.status import write_json_atomic

ROOT = Path(__file__).resolve().parents[2]


def preflight(tmp: Path, rendered: str | None) -> str:
    """The preflight (--check) on a local host whose output is tmp/out; its verdicts, one line."""
    py = sys.executable
    inventory = {"all": {"hosts": {"n1": {"ansible_connection": "local", "ansible_python_interpreter": py}},
                         "vars": {"hsx_output_dir": str(tmp / "out"), "hsx_venv": str(tmp / "venv"),
                                  "hsx_model_path": "/m", "hsx_dataset_path": "/d.jsonl",
                                  "hsx_job_unit": "hsx-test-no-such-unit.service"}}}
    (tmp / "inventory.json").write_text(json.dumps(inventory))
    tasks = [{"ansible.builtin.include_role": {"name": "extraction_job", "tasks_from": "preflight"}},
             {"ansible.builtin.debug": {"msg": "VERDICT stale={{ _extraction_job_assign_stale }} "
                                               "complete={{ _extraction_job_complete }}"}}]
    play = [{"hosts": "all", "gather_facts": False, "become": False, "tasks": tasks,
             "vars": {"extraction_job_fleet_assign": rendered, "extraction_job_config_changed": False}}]
    (tmp / "play.yml").write_text(json.dumps(play))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    proc = subprocess.run([str(Path(py).parent / "ansible-playbook"), "-i", str(tmp / "inventory.json"),
                           str(tmp / "play.yml"), "--check"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return re.search(r"VERDICT (stale=\w+ complete=\w+)", proc.stdout).group(1)


@pytest.mark.parametrize(("rendered", "verdict"), [
    ("0-1", "stale=False complete=True"),  # ran what it is given, and finished it: nothing to do
    ("0-1,4-5", "stale=True complete=False"),  # given more (a takeover): started again, resumes
    (None, "stale=False complete=True"),  # no fleet split: as before
])
def test_a_job_that_last_ran_other_buckets_is_started_again(tmp_path, rendered, verdict) -> None:
    plant_output(tmp_path / "out", "0-1", IDS[:4])  # buckets.json: the job last ran 0-1
    write_json_atomic(str(tmp_path / "out" / "status.json"), {"state": "done", "total": 4, "done": 4})
    assert preflight(tmp_path, rendered) == verdict


def test_a_takeover_rerun_for_a_retired_host_that_answers_reaches_its_job(tmp_path) -> None:
    fleet = {"buckets": 6, "created": "x", "epoch": 1, "hosts": {"n1": "0-3", "n2": "", "n3": "4-5"},
             "retired": ["n2"], "history": []}
    (tmp_path / "fleet.json").write_text(json.dumps(fleet))
    plant_output(tmp_path / "n1", "0-3", [])
    plant_output(tmp_path / "n2", "2-3", [])  # partitioned while taken over: it ran on
    proc = takeover(tmp_path, "n2", "--check")
    assert proc.returncode == 0, proc.stdout[-3000:]
    out = flat(proc.stdout)
    assert "Nothing to move: n2 is already taken over (epoch 1)" in out, out[-3000:]
    play3 = out.split("PLAY [The host taken over runs nothing")[1]
    assert re.search(r"TASK \[extraction_job : Read the unit\] \** ok: \[n2\]", play3), play3[:3000]
    assert "TASK [extraction_job : Stop the job and keep it from starting at boot]" in play3
