"""The collection hsx.recovery as a user gets it: the tarball `make collection` builds, installed
with `ansible-galaxy collection install` into a fresh collections path, and a user's own playbook
(outside this checkout, with an ansible.cfg that knows nothing of library/, module_utils/, roles/ or
filter_plugins/) calling our modules, roles and filters by FQCN against a real lab host: check mode
first (nothing changes), then for real, then again (changed=0); then the collection's own playbook
hsx.recovery.recover in check mode."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from labctl import PlaybookRun, host, lab_push, lab_ssh

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "unit"))
from shard_helpers import make_run  # noqa: E402

_spec = importlib.util.spec_from_file_location("hsx_collection_build", ROOT / "tools" / "collection" / "build.py")
build = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = build
_spec.loader.exec_module(build)

BIN = Path(sys.executable).parent
OUTPUT = "/data/hsx/output"

PLAYBOOK = """
- name: A user's own playbook, with hsx.recovery installed from its tarball
  hosts: lab
  gather_facts: false
  vars:
    hsx_report_dir: "{report_dir}"
  module_defaults:
    group/hsx.recovery.extraction_output:
      path: {output}
  tasks:
    - name: Where the extraction stands (its path from the group's module_defaults)
      hsx.recovery.extraction_status_info:
      register: user_status

    - name: The same by the module's old name (routed to extraction_status_info, with a deprecation)
      hsx.recovery.extraction_status:
      register: user_status_old_name

    - name: Verify the shards and quarantine the bad ones (the same path from the group)
      hsx.recovery.shard_verify:
        level: full
        quarantine: true
      register: user_verify

    - name: The recovery's shard_verify role (its module by short name, inside the collection)
      ansible.builtin.include_role:
        name: hsx.recovery.shard_verify

    - name: The report role's start (this run's report directory)
      ansible.builtin.include_role:
        name: hsx.recovery.recover_report
        tasks_from: start

    - name: The report role (its filter hsx_redact, inside the collection)
      ansible.builtin.include_role:
        name: hsx.recovery.recover_report

    - name: Keep what the test reads
      ansible.builtin.copy:
        dest: "{results}"
        mode: "0600"
        content: >-
          {{{{ {{'status': user_status, 'status_old_name': user_status_old_name, 'verify': user_verify, 'role': shard_verify_result,
               'unit_arg': 'a b%' | hsx.recovery.hsx_systemd('x')}} | to_json }}}}
      delegate_to: localhost
      check_mode: false
      changed_when: false
"""


@pytest.fixture(scope="module")
def collections_path(tmp_path_factory) -> Path:
    """The tarball built from this checkout, installed into a fresh collections path."""
    work = tmp_path_factory.mktemp("collection")
    coll = build.build(work / "src")
    tarball = build.build_tarball(coll, work / "dist")
    with tarfile.open(tarball) as tar:
        names = set(tar.getnames())
    assert {"plugins/modules/shard_verify.py", "plugins/module_utils/hsx/verify/__init__.py",
            "plugins/filter/hsx_filters.py", "roles/shard_verify/tasks/main.yml", "meta/runtime.yml",
            "LICENSE", "playbooks/recover.yml"} <= names
    dest = work / "collections"
    # --force: an hsx.recovery already in a configured collections path (~/.ansible) would make the
    # install a no-op, and this path would hold nothing.
    subprocess.run([str(BIN / "ansible-galaxy"), "collection", "install", "--force", str(tarball), "-p", str(dest)],
                   check=True, capture_output=True, text=True)
    return dest


def ansible_playbook(tmp_path: Path, collections: Path, *args: str) -> PlaybookRun:
    """ansible-playbook on the lab, run from tmp_path with an ansible.cfg that names only the
    installed collection (none of this checkout's library/, module_utils/, roles/, filter_plugins/)."""
    (tmp_path / "ansible.cfg").write_text(
        f"[defaults]\ncollections_path = {collections}\nhost_key_checking = True\n"
        "interpreter_python = auto_silent\nretry_files_enabled = False\n"
        "[ssh_connection]\npipelining = True\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(tmp_path / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               PATH=f"{BIN}:{os.environ['PATH']}")
    proc = subprocess.run([str(BIN / "ansible-playbook"), "-i", str(ROOT / "inventory" / "lab"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    return PlaybookRun(proc.returncode, proc.stdout + proc.stderr)


def user_playbook(tmp_path: Path, collections: Path, *args: str) -> tuple[PlaybookRun, dict]:
    """The user's playbook (PLAYBOOK) with only the installed collection; (run, what it kept)."""
    results = tmp_path / "results.json"
    results.unlink(missing_ok=True)
    (tmp_path / "play.yml").write_text(PLAYBOOK.format(output=OUTPUT, results=results,
                                                       report_dir=tmp_path / "reports"))
    run = ansible_playbook(tmp_path, collections, "play.yml", *args)
    return run, json.loads(results.read_text()) if results.exists() else {}


def test_fqcn_modules_roles_and_filters_of_the_installed_tarball_on_a_lab_host(
        lab_hosts, collections_path, tmp_path):
    out = tmp_path / "out"
    _, entries = make_run(out, n=4)
    bad = out / entries[1].path
    bad.write_bytes(bad.read_bytes()[:-100])  # truncated by a crash
    lab_push(host(1), out, OUTPUT)
    listing = f"find {OUTPUT} -type f | sort"
    before = lab_ssh(host(1), listing).stdout

    run, res = user_playbook(tmp_path, collections_path, "--check")
    assert run.rc == 0, run.output[-3000:]
    assert res["status"]["done"] == 4 and res["status"]["has_manifest"] is True
    assert res["status_old_name"]["done"] == 4  # the old name runs the same module, path from the group
    deprecation = " ".join(run.output.split())
    assert "hsx.recovery.extraction_status has been deprecated" in deprecation, run.output[-3000:]
    assert "Use hsx.recovery.extraction_status_info instead" in deprecation
    assert res["verify"]["bad_count"] == 1 and res["verify"]["quarantined"] == [f"quarantine/{entries[1].path[7:]}"]
    assert res["role"]["bad_count"] == 1
    assert res["unit_arg"] == '"a b%%"'
    assert lab_ssh(host(1), listing).stdout == before  # check mode moved nothing
    facts = list((tmp_path / "reports").glob("*/facts/*.json"))
    assert len(facts) == 1 and json.loads(facts[0].read_text())["shard_verify_result"]["bad_count"] == 1

    run, res = user_playbook(tmp_path, collections_path)
    assert run.rc == 0, run.output[-3000:]
    assert res["verify"]["changed"] is True and res["verify"]["quarantined_count"] == 1
    assert res["role"]["bad_count"] == 0  # the role ran after the module had moved it aside
    assert lab_ssh(host(1), f"test -f {OUTPUT}/quarantine/{entries[1].path[7:]}").returncode == 0

    run, _ = user_playbook(tmp_path, collections_path)
    assert run.rc == 0 and run.recap()[host(1)]["changed"] == 0, run.output[-3000:]

    # The collection's own playbook: the whole recovery's assessment, by FQCN, changes nothing.
    before = lab_ssh(host(1), listing).stdout
    run = ansible_playbook(tmp_path, collections_path, "hsx.recovery.recover", "--check",
                           "-e", f"hsx_report_dir={tmp_path / 'recover-reports'}")
    assert run.rc == 0 and run.recap()[host(1)]["failed"] == 0, run.output[-3000:]
    summary = list((tmp_path / "recover-reports").glob("*/summary.md"))
    assert len(summary) == 1 and f"### {host(1)}" in summary[0].read_text()
    assert lab_ssh(host(1), listing).stdout == before


def test_without_the_hsx_cli_the_installed_recover_playbook_says_what_is_missing(
        lab_hosts, collections_path, tmp_path):
    """Issue #42 item 4: a control node without the hsx CLI the deploy builds the wheelhouse with
    (hsx_cli pointed where there is none, as on a control node that installed only the tarball) is
    told so before anything changes, with how to provide it."""
    missing = tmp_path / "venv-without-hsx" / "bin" / "hsx"
    run = ansible_playbook(tmp_path, collections_path, "hsx.recovery.recover", "--check",
                           "-e", f"hsx_report_dir={tmp_path / 'reports'}", "-e", f"hsx_cli={missing}")
    said = " ".join(run.output.split())
    assert run.rc != 0 and f"The hsx CLI is not at {missing}" in said, run.output[-3000:]
    assert "-m pip install -e CHECKOUT" in said and "Nothing was changed" in said
    assert "TASK [hsx.recovery.gpu_reclaim" not in run.output  # it stopped in the assessment, before any stage acts
