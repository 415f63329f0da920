"""The recovery's metrics (roles/recover_report, tasks/metrics.yml): the real tasks, run by
ansible-playbook on this machine with the facts a recovery leaves, write hsx-recover.prom that
`promtool check metrics` passes and that says what happened; a link at its name is replaced. Failed
automatic recoveries (the self-healing rulebook's: hsx_selfheal=true) are counted in the file across
runs, and a recovery that succeeds sets the count back to 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from promtool import promtool

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

PLAY = """
- hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: The facts a recovery leaves
      ansible.builtin.set_fact:
        shard_verify_result: {skipped: false, bad_count: 3, missing_count: 1, quarantined_count: 3}
        gpu_reclaim_result:
          units_changed: [vllm.service, sglang-old.service]
          processes_ended: [{pid: 7}]
        gpu_reclaim_health_result:
          findings: >-
            {{ [{'gpu': 3, 'check': 'ecc', 'severity': 'fail', 'message': 'GPU 3: 2 uncorrectable'},
                {'gpu': 3, 'check': 'xid', 'severity': 'fail', 'message': 'GPU 3: XID 48'},
                {'gpu': 1, 'check': 'ecc', 'severity': 'warn', 'message': 'GPU 1: ECC is disabled'}]
               if failed | bool else [] }}
    - name: A failure, when asked
      ansible.builtin.set_fact:
        recover_report_failed_stage: 'job "x"'
        recover_report_failed_msg: "GPU health gate failed: GPU 3: \\"2\\" uncorrectable\\nECC"
      when: failed | bool
    - name: The metrics
      ansible.builtin.include_role:
        name: recover_report
        tasks_from: metrics
"""


def write_metrics(tmp_path: Path, failed: bool, automatic: bool = False) -> subprocess.CompletedProcess:
    (tmp_path / "play.yml").write_text(PLAY)
    env = dict(os.environ, ANSIBLE_ROLES_PATH=str(REPO / "roles"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCALHOST_WARNING="0", ANSIBLE_INVENTORY_UNPARSED_WARNING="0")
    extra = json.dumps({"hsx_metrics_textfile_dir": str(tmp_path / "textfile"), "failed": failed,
                        "hsx_selfheal": automatic, "ansible_python_interpreter": sys.executable})
    return subprocess.run([str(BIN / "ansible-playbook"), "-i", "localhost,", str(tmp_path / "play.yml"), "-e", extra],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def values(text: str) -> dict[str, tuple[dict, float]]:
    return {s.name: (s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.mark.parametrize("failed", [False, True])
def test_recovery_metrics_are_written_and_clean(tmp_path: Path, failed: bool) -> None:
    (tmp_path / "textfile").mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    (tmp_path / "textfile" / "hsx-recover.prom").symlink_to(victim)
    run = write_metrics(tmp_path, failed)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "changed=0" in run.stdout, run.stdout[-2000:]
    prom = tmp_path / "textfile" / "hsx-recover.prom"
    assert victim.read_text() == "keep\n" and not prom.is_symlink()
    assert sorted(p.name for p in prom.parent.iterdir()) == ["hsx-recover.prom"]
    text = prom.read_text()
    checked = promtool("check", "metrics", stdin=text.encode())
    assert checked.returncode == 0 and not checked.stdout.strip() and not checked.stderr.strip(), checked
    got = values(text)
    assert got["hsx_recover_success"][1] == (0 if failed else 1)
    assert ("hsx_recover_failed_stage" in got) == failed
    if failed:
        assert got["hsx_recover_failed_stage"][0] == {"stage": 'job "x"',
                                                      "reason": 'GPU health gate failed: GPU 3: "2" uncorrectable ECC'}
    assert got["hsx_recover_automatic"][1] == 0 and got["hsx_recover_automatic_failures"][1] == 0
    assert got["hsx_recover_shards_bad"][1] == 3 and got["hsx_recover_shards_missing"][1] == 1
    assert got["hsx_recover_shards_quarantined"][1] == 3
    assert got["hsx_recover_units_stopped"][1] == 2 and got["hsx_recover_gpu_processes_ended"][1] == 1
    assert got["hsx_recover_gpus_unhealthy"][1] == (1 if failed else 0)  # GPU 3 fails twice; a warning is no failure
    assert abs(got["hsx_recover_timestamp_seconds"][1] - prom.stat().st_mtime) < 120


def test_no_textfile_directory_no_metrics_and_no_failure(tmp_path: Path) -> None:
    run = write_metrics(tmp_path, False)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "is not a directory: no recovery metrics" in run.stdout
    assert not (tmp_path / "textfile").exists()


def test_failed_automatic_recoveries_are_counted_until_one_succeeds(tmp_path: Path) -> None:
    """What hsx-selfheal.rules.yml reads to leave a host alone: +1 per failed automatic recovery, a
    person's failed one leaves the count, any success sets it to 0."""
    (tmp_path / "textfile").mkdir()
    prom = tmp_path / "textfile" / "hsx-recover.prom"
    counts = []
    for failed, automatic in [(True, True), (True, True), (True, False), (True, True), (False, True), (True, True)]:
        run = write_metrics(tmp_path, failed, automatic)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
        got = values(prom.read_text())
        assert got["hsx_recover_automatic"][1] == (1 if automatic else 0)
        counts.append(got["hsx_recover_automatic_failures"][1])
    assert counts == [1, 2, 2, 3, 0, 1]
