"""Runner artifacts: one retention rule, per kind (issue #30 item 12, first point).

`hsx fleet-status` keeps its newest 5 ad-hoc runs and recover/provision/rollout keep their newest 10
each, in the one shared `<reports>/.runner/artifacts`: a run of one kind never removes another
kind's. The fleet-status run here is real (ansible-runner, an inventory with no hosts).
"""

from __future__ import annotations

import time
from pathlib import Path

from extraction.fleet import fleetstatus, playbook
from extraction.fleet.playbook import private_data_dir


def _plant(artifacts: Path, kind: str, n: int, start: float) -> list[str]:
    names = []
    for i in range(n):
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(start + i))
        name = f"{stamp}-{kind}-{1000 + i}"
        (artifacts / name).mkdir(parents=True)
        (artifacts / name / "stdout").write_text("x")
        names.append(name)
    return names


def test_fleet_status_leaves_recover_and_rollout_artifacts_alone(tmp_path):
    pdd = private_data_dir(tmp_path)
    artifacts = pdd / "artifacts"
    old = time.time() - 86400
    recover = _plant(artifacts, "recover", 10, old)
    rollout = _plant(artifacts, "rollout_patch", 3, old + 100)
    inventory = tmp_path / "empty.ini"
    inventory.write_text("[nobody]\n")
    for _ in range(2):
        fleetstatus._adhoc(
            fleetstatus.StatusCollector(), "ansible.builtin.ping", "", [str(inventory)], None, False, tmp_path
        )
        time.sleep(1.1)  # idents are stamped to the second
    present = sorted(p.name for p in artifacts.iterdir())
    assert [n for n in recover + rollout if n not in present] == [], "fleet-status purged other kinds' runs"
    assert len([n for n in present if "-fleet-status-" in n]) == 2


def test_each_kind_keeps_its_own_newest(tmp_path):
    from extraction.fleet.playbook import prune_artifacts

    artifacts = tmp_path / "artifacts"
    old = time.time() - 86400
    recover = _plant(artifacts, "recover", 14, old)
    status = _plant(artifacts, "fleet-status-extraction_status", 8, old + 50)
    outsider = artifacts / "not-a-run"
    outsider.mkdir()
    link = artifacts / "19700101T000000Z-recover-1"
    link.symlink_to(outsider)  # a link is never followed nor removed
    removed = prune_artifacts(tmp_path, "recover", playbook.KEEP_ARTIFACTS)
    assert sorted(p.name for p in removed) == recover[:4]
    removed = prune_artifacts(tmp_path, "fleet-status", fleetstatus.KEEP_ARTIFACTS)
    assert sorted(p.name for p in removed) == status[:3]
    left = sorted(p.name for p in artifacts.iterdir())
    assert left == sorted(recover[4:] + status[3:] + ["not-a-run", link.name])
    assert playbook.KEEP_ARTIFACTS == 10 and fleetstatus.KEEP_ARTIFACTS == 5
