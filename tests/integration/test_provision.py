"""playbooks/provision.yml on 2 bare lab hosts (sglang backend), then a re-run that changes nothing.

The hosts start from the bare rootfs with what a real node has before we touch it: the model, the
dataset and an SGLang release (tests/plays/plant_sglang.yml). Provisioning must leave the extraction
venv, the patched SGLang, and the server and job units installed but not started.

Both runs are an operator's (issue #39 item 5): an unprivileged control-node account with sudo on the
targets only, building the wheelhouse from its own checkout (tests/control_node_account.py). Its
checkout is a copy, frozen for both runs, so that another edit of this one between them cannot make
the second run rightly install a new build. Afterwards nothing under the account's home is root's.
"""

from __future__ import annotations

import json

import pytest
from control_node_account import operator_account
from labctl import host as lab_host
from labctl import lab, lab_ssh, playbook

HOSTS = [lab_host(1), lab_host(2)]
LAB_VARS = "@tests/plays/files/sglang_lab.yml"
PATCHED = "/opt/sglang/venv/lib/python3.11/site-packages/sglang/srt/models/deepseek_v2.py"
UNITS = "hsx-sglang-server.service hsx-extraction.service"


@pytest.fixture(scope="module")
def operator():
    with operator_account() as account:
        yield account


@pytest.fixture(scope="module")
def provisioned(operator):
    lab("up", "2", "--data-size", "1G")
    try:
        planted = playbook("tests/plays/plant_sglang.yml", "-e", LAB_VARS)
        assert planted.rc == 0, planted.output[-3000:]
        yield operator.playbook("playbooks/provision.yml", "-e", LAB_VARS)
    finally:
        lab("down", check=False)


def test_provision_installs_everything_and_starts_nothing(provisioned, operator):
    first = provisioned
    assert first.rc == 0, first.output[-4000:]
    manifest = json.loads((operator.checkout / ".cache" / "wheelhouse" / "wheelhouse.json").read_text())
    assert "source_digest" in manifest, "the account's build stage did not build its wheelhouse"
    for host in HOSTS:
        assert first.recap()[host]["failed"] == 0
        helped = lab_ssh(host, "/opt/hsx/venv/bin/hsx --help")
        assert helped.returncode == 0 and "extract" in helped.stdout, helped.stderr[-500:]
        for path in ("/opt/hsx/venv/bin/python", "/opt/hsx/wheelhouse/wheelhouse.json", "/etc/hsx/extract.yaml",
                     "/run/hsx-dumps", f"{PATCHED}", "/opt/sglang/venv/lib/python3.11/site-packages/sglang/hsx_dump_hook.py"):
            assert lab_ssh(host, f"test -e {path}").returncode == 0, f"{host}: {path} missing"
        config = lab_ssh(host, "cat /etc/hsx/extract.yaml").stdout
        assert "backend: sglang" in config and "server_url: http://127.0.0.1:30000" in config, config
        # Dumps in RAM (#29 item 2): the tmpfs directory, the hsx account's, in the job's config.
        assert "dump_dir: /run/hsx-dumps" in config, config
        assert lab_ssh(host, "stat -c '%U %a %F' /run/hsx-dumps").stdout.strip() == "hsx 750 directory"
        assert lab_ssh(host, f"grep -c '# >>> hsx-patch hsx-sglang-dump block=.* v=2 ' {PATCHED}").stdout.strip() == "2"
        loaded = lab_ssh(host, f"systemctl show -p LoadState --value {UNITS}").stdout.split()
        active = lab_ssh(host, f"systemctl is-active {UNITS}").stdout.split()
        enabled = lab_ssh(host, f"systemctl is-enabled {UNITS}").stdout.split()
        assert loaded == ["loaded", "loaded"] and active == ["inactive", "inactive"], (host, loaded, active)
        assert enabled == ["disabled", "disabled"], (host, enabled)
    summary = next(operator.reports.glob("*-provision/summary.md")).read_text()
    assert "# Provisioning report" in summary and "2 of 2 hosts ok." in summary, summary
    assert "dumps in RAM at /run/hsx-dumps: " in summary, summary  # the storage line says where, with numbers


def changed_tasks(output: str) -> list[str]:
    """'TASK name: host' for every task that reported changed."""
    found, task = [], "?"
    for line in output.splitlines():
        if line.startswith("TASK ["):
            task = line[6:line.rfind("]")]
        elif line.startswith("changed: ["):
            found.append(f"{task}: {line[10:line.index(']')]}")
    return found


def test_second_run_changes_nothing(provisioned, operator):
    owned = operator.owned_by_root()  # after the first run: the second must not hide what it left
    assert not owned, owned[:20]
    second = operator.playbook("playbooks/provision.yml", "-e", LAB_VARS)
    recap = second.recap()
    assert second.rc == 0, second.output[-4000:]
    for host in HOSTS:
        assert recap[host]["changed"] == 0 and recap[host]["failed"] == 0, changed_tasks(second.output)
    owned = operator.owned_by_root()
    assert not owned, owned[:20]
