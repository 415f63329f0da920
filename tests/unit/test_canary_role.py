"""The canary in a recovery (roles/extraction_job tasks/canary.yml, roles/recover_report), run for real by
ansible-playbook on this machine: one host per case, each on its own copy of a real tiny extraction, with
the facts the role's preflight leaves and recover.yml's stage mechanism (recover_stage; the rescue's
recover_report `failed`) around it, then the report's dump, summary and metrics as recover.yml makes
them. Passed -> the stage goes back to job; weights perturbed -> the host fails at stage canary, naming
the samples and the error, and hsx-recover.prom says mismatch; a fresh output, the setting off and check
mode -> nothing runs, and each says why."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import test_canary
import yaml
from hsx_run_helpers import make_cfg
from prometheus_client.parser import text_string_to_metric_families
from promtool import promtool
from test_canary import perturb_weights, tree

from extraction.canary.result import CANARY_NAME
from hsx.index import read_index

extracted = test_canary.extracted  # the fixture: a real tiny extraction, once for this module
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

PLAY = """
- hosts: all
  gather_facts: false
  tasks:
    - name: "Stage: job (recover.yml)"
      ansible.builtin.set_fact:
        recover_stage: job
    - name: The canary, as recover.yml runs it (a failure rescued and recorded with its stage)
      block:
        - name: Canary
          ansible.builtin.include_role:
            name: extraction_job
            tasks_from: canary
      rescue:
        - name: Record where and why this host failed
          ansible.builtin.include_role:
            name: recover_report
            tasks_from: failed
    - name: What the test reads
      ansible.builtin.copy:
        dest: "{{ out_dir }}/{{ inventory_hostname }}.json"
        mode: "0600"
        content: >-
          {{ {'result': extraction_job_canary_result | default(none), 'stage': recover_stage,
              'failed_stage': recover_report_failed_stage | default(none),
              'failed_msg': recover_report_failed_msg | default(none)} | to_json }}
      delegate_to: localhost
      check_mode: false
    - name: Dump this host's results for the report
      ansible.builtin.include_role:
        name: recover_report
      vars:
        recover_report_run_dir: "{{ out_dir }}/report"
    - name: Build the report
      ansible.builtin.include_role:
        name: recover_report
        tasks_from: build
      vars:
        recover_report_run_dir: "{{ out_dir }}/report"
        recover_report_hosts: "{{ ansible_play_hosts_all }}"
      run_once: true
    - name: The recovery's metrics
      ansible.builtin.include_role:
        name: recover_report
        tasks_from: metrics
      when: not ansible_check_mode
"""


def host(config: Path | None, done: int = 8, **more: object) -> dict:
    """Host vars of a node whose preflight found a stopped job and `done` indexed samples."""
    return {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "extraction_job_hardening": False,  # no account to run as here: the job would run as root too
        "extraction_job_venv": str(BIN.parent),
        "extraction_job_config_path": str(config) if config else "/nonexistent/job.yml",
        "extraction_job_output_dir": str(config.parent / "out") if config else "/nonexistent",
        "extraction_job_environment": {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        "extraction_job_start": True,
        "_extraction_job_complete": False,
        "_extraction_job_was_active": False,
        "_extraction_job_before": {"done": done},
        **more,
    }


def node(tmp_path: Path, name: str, extracted: dict[str, Path], model: Path | None = None) -> Path:
    """A node's own copy of the extracted output, and its job config; returns the config."""
    root = tmp_path / name
    shutil.copytree(extracted["output"], root / "out")
    cfg = make_cfg(model or extracted["model"], extracted["dataset"], root / "out")
    keys = ("model", "dataset", "output", "layers", "dtype", "max_length", "batch_size", "progress")
    (root / "job.yml").write_text(yaml.safe_dump({k: getattr(cfg, k) for k in keys}))
    return root / "job.yml"


def play(tmp_path: Path, hosts: dict[str, dict], *args: str) -> subprocess.CompletedProcess:
    out = tmp_path / "seen"
    out.mkdir(exist_ok=True)
    for name, hv in hosts.items():
        hv["hsx_metrics_textfile_dir"] = str(tmp_path / name / "textfile")
        (tmp_path / name / "textfile").mkdir(parents=True, exist_ok=True)
    inventory = {"all": {"hosts": hosts, "vars": {"out_dir": str(out)}}}
    (tmp_path / "inventory.yml").write_text(yaml.safe_dump(inventory))
    (tmp_path / "play.yml").write_text(PLAY)
    env = dict(os.environ, ANSIBLE_ROLES_PATH=str(REPO / "roles"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCALHOST_WARNING="0", ANSIBLE_FILTER_PLUGINS=str(REPO / "filter_plugins"),
               ANSIBLE_LIBRARY=str(REPO / "library"), ANSIBLE_MODULE_UTILS=str(REPO / "module_utils"))
    return subprocess.run([str(BIN / "ansible-playbook"), "-i", str(tmp_path / "inventory.yml"),
                           str(tmp_path / "play.yml"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


def seen(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / "seen" / f"{name}.json").read_text())


def metrics(tmp_path: Path, name: str) -> dict[str, tuple[dict, float]]:
    text = (tmp_path / name / "textfile" / "hsx-recover.prom").read_text()
    checked = promtool("check", "metrics", stdin=text.encode())
    assert checked.returncode == 0 and not checked.stdout.strip() and not checked.stderr.strip(), checked
    return {s.name: (s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples}


def test_a_recovery_runs_the_canary_and_reports_it(extracted, tmp_path: Path) -> None:
    perturbed = tmp_path / "perturbed-model" / extracted["model"].name  # same name: same fingerprint
    shutil.copytree(extracted["model"], perturbed)
    perturb_weights(perturbed)
    cfg = {name: node(tmp_path, name, extracted, perturbed if name == "bad" else None) for name in ("good", "bad", "gone")}
    chosen = sorted(read_index(str(cfg["gone"].parent / "out")).entries)
    hosts = {name: host(c) for name, c in cfg.items()}
    for sid in chosen:  # every shard of "gone" removed: whichever the canary picks is missing
        (cfg["gone"].parent / "out" / read_index(str(cfg["gone"].parent / "out")).entries[sid].path).unlink()
    before = {name: tree(c.parent / "out") for name, c in cfg.items()}
    run = play(tmp_path, hosts)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]

    good = seen(tmp_path, "good")
    assert (good["result"]["state"], good["stage"], good["failed_stage"]) == ("passed", "job", None), good
    assert good["result"]["checked"] == 2 and good["result"]["seconds"] > 0

    bad = seen(tmp_path, "bad")
    assert (bad["result"]["state"], bad["failed_stage"]) == ("mismatch", "canary"), bad
    assert len(bad["result"]["mismatched"]) == 2
    for sid in bad["result"]["mismatched"]:
        assert sid in bad["failed_msg"]
    assert "canary mismatch on bad: this node computes differently" in bad["failed_msg"]
    assert "The job was not started" in bad["failed_msg"]

    gone = seen(tmp_path, "gone")
    assert (gone["result"]["state"], gone["failed_stage"]) == ("error", "canary"), gone
    assert "not good" in gone["failed_msg"] and "could not be made" in gone["failed_msg"]

    for name, c in cfg.items():  # nothing written to any output but the canary's record
        after = tree(c.parent / "out")
        record = after.pop(CANARY_NAME, None)
        assert record is not None, name
        assert after == before[name], name

    summary = run.stdout[run.stdout.index("Canary (re-extracted samples"):]
    # each sample re-run in its original batch (of 4, the extraction's): bit-equal demanded, whole batches forwarded
    forwarded = good["result"]["forwarded"]
    assert forwarded > 2 and good["result"]["rebuilt_batches"] >= 1
    assert f"- good: passed, 2 sample(s) ({forwarded} forwarded: their original batches) in " in summary
    assert "max relative error 0.0 (tolerance 0.0)" in summary and f"{forwarded} sample(s) forwarded" in summary
    assert "- bad: mismatch, 2 sample(s) (" in summary

    m = metrics(tmp_path, "bad")
    assert m["hsx_recover_canary_mismatch"] == ({"samples": ", ".join(bad["result"]["mismatched"])}, 1.0)
    assert m["hsx_recover_canary_max_rel_error"][1] > 1e-2 and m["hsx_recover_canary_tolerance"][1] == 0
    assert m["hsx_recover_canary_result"] == ({"result": "mismatch"}, 1.0)
    assert m["hsx_recover_failed_stage"][0]["stage"] == "canary"
    assert m["hsx_recover_canary_samples"][1] == 2 and m["hsx_recover_canary_seconds"][1] > 0
    m = metrics(tmp_path, "good")
    assert m["hsx_recover_canary_mismatch"] == ({"samples": ""}, 0.0)
    assert m["hsx_recover_canary_max_rel_error"][1] == 0 and m["hsx_recover_success"][1] == 1


def test_check_mode_predicts_it_and_a_fresh_output_or_the_setting_off_skip_it(extracted, tmp_path: Path) -> None:
    cfg = {name: node(tmp_path, name, extracted) for name in ("n", "fresh", "off")}
    before = {name: tree(c.parent / "out") for name, c in cfg.items()}
    hosts = {"n": host(cfg["n"]), "fresh": host(cfg["fresh"], done=0), "off": host(cfg["off"], extraction_job_canary=False)}
    run = play(tmp_path, hosts, "--check")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    got = seen(tmp_path, "n")
    assert (got["result"]["state"], got["stage"]) == ("predicted", "job"), got
    assert "would re-extract 2 finished sample(s)" in got["result"]["message"]
    fresh, off = seen(tmp_path, "fresh"), seen(tmp_path, "off")
    assert (fresh["result"]["state"], fresh["failed_stage"]) == ("skipped", None)
    assert "a fresh run" in fresh["result"]["message"]
    assert (off["result"]["state"], off["failed_stage"]) == ("off", None)
    summary = run.stdout[run.stdout.index("Canary (re-extracted samples"):]
    assert "- n: predicted, 0 sample(s)" in summary and "- fresh: skipped, 0 sample(s)" in summary
    assert "- off: off, 0 sample(s) in 0 s: extraction_job_canary is false" in summary
    for name, c in cfg.items():
        assert tree(c.parent / "out") == before[name], name  # nothing ran: no record either
