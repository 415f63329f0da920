"""playbooks/provision.yml, then playbooks/rollout_patch.yml, on 2 real lab hosts running the sglang backend.

One lab for the module: 2 bare hosts get what a real node has before we touch it - a real SGLang
release (its files, no dependencies), the model and the dataset (tests/plays/plant_sglang.yml).

Provisioning, an operator's (issue #39 item 5: an unprivileged control-node
account with sudo on the targets only, building the wheelhouse from its own checkout,
tests/control_node_account.py) must leave the extraction venv, the patched SGLang, and the server and
job units installed but not started; a second run, with the server and job started (-e
hsx_start=true), changes nothing but that: the units enabled and started (the server is the TEST-ONLY
stand-in, which runs the patch and hook of the installed SGLang, so a patch that breaks the model breaks
the server); nothing under the account's home is root's after either.

Then the rollout, in order: --check (the plan, nothing changes); a normal rollout v2 -> v3 (the
operator's, as above); a v4 whose canary fails (no other host touched); a v4 that fails on the second
batch's host (reverted to v3; the canary keeps v4).

New versions are revisions of the project's patch (module_utils/hsx/sglang_patch.py, imported) whose
init block fails on hosts holding /etc/hsx-test/fail-v<N> - a deliberately broken version there.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from control_node_account import operator_account
from labctl import host as lab_host
from labctl import lab, lab_ssh, playbook

from hsx.sglang_patch import SGLANG_DUMP_PATCH

# The default serial [1, "25%", "100%"]: two batches of one, the canary and the rest. A third host (a third
# batch, untouched when the second fails) cost ~230 CPU-s of make test: that a failed batch stops the
# rollout before the next is the failed canary's case (the second host untouched).
HOSTS = [lab_host(i) for i in range(1, 3)]
LAB_VARS = "@tests/plays/files/sglang_lab.yml"
PATCHED = "/opt/sglang/venv/lib/python3.11/site-packages/sglang/srt/models/deepseek_v2.py"
HSX = "/opt/hsx/venv/bin/hsx"
UNITS = "hsx-sglang-server.service hsx-extraction.service"


def revision(version: str, tmp: Path) -> str:
    """-e @file holding the project's patch as version `version`, failing where fail-v<version> exists."""
    patch = copy.deepcopy(SGLANG_DUMP_PATCH)
    patch["version"] = version
    patch["description"] += f" (TEST revision v{version})"
    patch["blocks"][0]["code"].insert(
        0, f'assert not __import__("os").path.exists("/etc/hsx-test/fail-v{version}"), '
        f'"TEST patch v{version} fails on this host on purpose"')
    path = tmp / f"patch-v{version}.json"
    path.write_text(json.dumps({"rollout_patch_definition": patch}))
    return f"@{path}"


def rollout(reports: Path, *extra: str, play=playbook):
    run = play("playbooks/rollout_patch.yml", "-e", LAB_VARS, "-e", f"hsx_report_dir={reports}", *extra)
    written = sorted(p for p in reports.iterdir() if p.name.endswith("-rollout")) if reports.is_dir() else []
    assert written, f"no rollout report in {reports} (rc {run.rc}):\n{run.output[-4000:]}"
    report_dir = written[-1]
    hosts = {h: json.loads((report_dir / f"{h}.json").read_text()) for h in HOSTS}
    return run, hosts, (report_dir / "summary.md").read_text()


def state(host: str) -> dict:
    """What runs on the host: patch version in the file and in the running server, unit invocations."""
    script = (
        f"grep -o 'hsx-patch hsx-sglang-dump block=init v=[^ ]*' {PATCHED} | sed 's/.*v=//'; "
        "python3 -c \"import urllib.request as u\ntry: print(u.urlopen('http://127.0.0.1:30000/hsx_patch').read().decode())"
        "\nexcept Exception as e: print('{\\\"version\\\": \\\"down: %s\\\"}' % type(e).__name__)\"; "
        "systemctl show -p InvocationID --value hsx-sglang-server hsx-extraction; "
        f"stat -c %Y {PATCHED}; {HSX} status /data/hsx/output --json"
    )
    out = [line for line in lab_ssh(host, script).stdout.splitlines() if line.strip()]  # show: blank between units
    status = json.loads("\n".join(out[5:]))["outputs"][0]
    return {"file": out[0], "server": json.loads(out[1])["version"], "server_id": out[2], "job_id": out[3],
            "mtime": out[4], "done": status["done"], "state": status["state"]}


@pytest.fixture(scope="module")
def operator():
    with operator_account() as account:
        yield account


@pytest.fixture(scope="module")
def planted():
    lab("up", str(len(HOSTS)), "--data-size", "4G")  # sparse: ~1.6 GB if a job ever finished
    try:
        planted = playbook("tests/plays/plant_sglang.yml", "-e", LAB_VARS)
        assert planted.rc == 0, planted.output[-3000:]
        yield
    finally:
        for h in HOSTS:  # the jobs' graceful stop would make `lab down` wait for their in-flight samples
            lab_ssh(h, "systemctl kill --signal=SIGKILL hsx-extraction hsx-sglang-server")
        lab("down", check=False)


@pytest.fixture(scope="module")
def provisioned(planted, operator):
    return operator.playbook("playbooks/provision.yml", "-e", LAB_VARS)


@pytest.fixture(scope="module")
def started(provisioned, operator):
    """The second provisioning: the same, with the server and job started."""
    return operator.playbook("playbooks/provision.yml", "-e", LAB_VARS, "-e", "hsx_start=true")


@pytest.fixture(scope="module")
def fleet(started, tmp_path_factory):
    assert started.rc == 0, started.output[-3000:]
    return tmp_path_factory.mktemp("rollout")


# What a second provisioning may change when it is asked to start what the first installed.
START_TASKS = {"sglang_server : Enable the server at boot", "sglang_server : Start the server if it is not running",
               "extraction_job : Enable the job at boot", "extraction_job : Start (resume) the job"}


def changed_tasks(output: str) -> list[str]:
    """'TASK name: host' for every task that reported changed."""
    found, task = [], "?"
    for line in output.splitlines():
        if line.startswith("TASK ["):
            task = line[6:line.rfind("]")]
        elif line.startswith("changed: ["):
            found.append(f"{task}: {line[10:line.index(']')]}")
    return found


def test_provision_installs_everything_and_starts_nothing(provisioned, operator):
    first = provisioned
    assert first.rc == 0, first.output[-4000:]
    owned = operator.owned_by_root()  # before the second run, which must not hide what this one left
    assert not owned, owned[:20]
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
    assert "# Provisioning report" in summary and f"{len(HOSTS)} of {len(HOSTS)} hosts ok." in summary, summary
    assert "dumps in RAM at /run/hsx-dumps: " in summary, summary  # the storage line says where, with numbers


def test_second_provision_changes_only_what_hsx_start_asks(provisioned, started, operator):
    """Idempotence with one run fewer than 'again, then start': every change the second run makes is one
    of the units' enable and start, and each host gets all four."""
    recap = started.recap()
    assert started.rc == 0, started.output[-4000:]
    changed = changed_tasks(started.output)
    for host in HOSTS:
        assert recap[host]["failed"] == 0, started.output[-3000:]
        assert sorted(c.rsplit(": ", 1)[0] for c in changed if c.endswith(f": {host}")) == sorted(START_TASKS), changed
        assert recap[host]["changed"] == len(START_TASKS), (host, recap[host], changed)
        active = lab_ssh(host, f"systemctl is-active {UNITS}; systemctl is-enabled {UNITS}").stdout.split()
        assert active == ["active"] * 2 + ["enabled"] * 2, (host, active)
    owned = operator.owned_by_root()
    assert not owned, owned[:20]


def test_check_shows_the_plan_and_changes_nothing(fleet):
    before = {h: state(h) for h in HOSTS}
    run, hosts, _ = rollout(fleet, "--check", "-e", revision("3", fleet))
    assert run.rc == 0, run.output[-4000:]
    assert f"Plan, batch 1 (canary): {HOSTS[0]} v2 -> v3" in run.output
    assert f"Plan, batch 2 (1 hosts): {HOSTS[1]} v2 -> v3" in run.output
    # (the recap counts what WOULD change in check mode; what did not change is read from the hosts)
    assert all(run.recap()[h]["failed"] == 0 for h in HOSTS), run.output[-3000:]
    for h in HOSTS:
        assert hosts[h]["after"]["rollout"]["outcome"] == "planned"
        after = state(h)
        assert {k: after[k] for k in ("file", "server", "server_id", "job_id", "mtime")} == \
               {k: before[h][k] for k in ("file", "server", "server_id", "job_id", "mtime")}, h
        assert after["file"] == after["server"] == "2"


def test_a_real_run_needs_the_confirmation(fleet):
    run = playbook("playbooks/rollout_patch.yml", "-e", LAB_VARS, "-e", f"hsx_report_dir={fleet}")
    assert run.rc != 0
    assert "confirm with -e rollout_patch_confirm=yes" in run.output
    assert all(state(h)["file"] == "2" for h in HOSTS[:1])


def test_normal_rollout_updates_every_host_and_resumes_the_jobs(fleet, operator):
    before = {h: state(h) for h in HOSTS}
    assert all(b["state"] == "running" for b in before.values()), before
    # What the operator reads (the revision) and writes (reports) is in its home.
    patch = revision("3", operator.home)
    operator.give(operator.home / patch[1:])
    run, hosts, summary = rollout(operator.reports, "-e", patch, "-e", "rollout_patch_confirm=yes",
                                  "-e", '{"rollout_patch_serial": [1, "100%"]}', play=operator.playbook)
    owned = operator.owned_by_root()
    assert run.rc == 0, run.output[-4000:]
    assert not owned, owned[:20]
    assert f"Batch 2 (1 hosts): {HOSTS[1]} v2 -> v3" in run.output
    for h in HOSTS:
        after = state(h)
        assert after["file"] == after["server"] == "3", (h, after)
        assert after["server_id"] != before[h]["server_id"], f"{h}: server not restarted"
        assert after["job_id"] != before[h]["job_id"] and after["state"] == "running", (h, after)
        assert after["done"] >= before[h]["done"], (h, before[h], after)
        assert hosts[h]["ok"] and hosts[h]["after"]["rollout"]["outcome"] == "updated", hosts[h]
        assert f"- {h}: runs v3 (updated; was v2, target v3)" in summary
        verify = lab_ssh(h, f"{HSX} verify /data/hsx/output --level quick --json")
        assert verify.returncode == 0 and json.loads(verify.stdout)["ok"] >= before[h]["done"], verify.stdout[-500:]
    # Hosts already on the version are left alone: a re-run changes nothing.
    again, hosts, _ = rollout(fleet, "-e", revision("3", fleet), "-e", "rollout_patch_confirm=yes")
    assert again.rc == 0 and all(again.recap()[h]["changed"] == 0 for h in HOSTS), again.output[-3000:]
    assert all(hosts[h]["after"]["rollout"]["outcome"] == "already on v3" for h in HOSTS)


def test_failed_canary_is_reverted_and_no_other_host_is_touched(fleet):
    lab_ssh(HOSTS[0], "mkdir -p /etc/hsx-test && touch /etc/hsx-test/fail-v4")
    before = {h: state(h) for h in HOSTS}
    prev = before[HOSTS[0]]["file"]  # v3 after the normal rollout
    run, hosts, summary = rollout(fleet, "-e", revision("4", fleet), "-e", "rollout_patch_confirm=yes")
    lab_ssh(HOSTS[0], "rm -f /etc/hsx-test/fail-v4")
    assert run.rc != 0
    canary = state(HOSTS[0])
    assert canary["file"] == canary["server"] == prev and canary["state"] == "running", (canary, run.output[-3000:])
    assert hosts[HOSTS[0]]["failed_step"] == "server" and "fails on this host on purpose" in hosts[HOSTS[0]]["reason"]
    assert hosts[HOSTS[0]]["after"]["rollout"]["outcome"] == f"reverted to v{prev}"
    for h in HOSTS[1:]:
        after = state(h)
        assert {k: after[k] for k in ("file", "server", "server_id", "job_id", "mtime")} == \
               {k: before[h][k] for k in ("file", "server", "server_id", "job_id", "mtime")}, h
        assert hosts[h]["after"]["rollout"]["outcome"].startswith("not touched (rollout stopped:")
    assert f"The rollout stopped: {HOSTS[0]} failed in batch 1." in summary
    assert f"- {HOSTS[0]}: runs v{prev} (reverted to v{prev}; was v{prev}, target v4)" in summary


def test_failure_in_the_second_batch_stops_the_rollout(fleet):
    lab_ssh(HOSTS[1], "mkdir -p /etc/hsx-test && touch /etc/hsx-test/fail-v4")
    before = {h: state(h) for h in HOSTS}
    prev = before[HOSTS[1]]["file"]
    run, hosts, summary = rollout(fleet, "-e", revision("4", fleet), "-e", "rollout_patch_confirm=yes")
    assert run.rc != 0
    recap = run.recap()
    assert recap[HOSTS[1]]["failed"] == 1 and recap[HOSTS[0]]["failed"] == 0, run.output[-3000:]
    first, second = state(HOSTS[0]), state(HOSTS[1])
    assert first["file"] == first["server"] == "4" and first["state"] == "running", (first, run.output[-3000:])
    assert second["file"] == second["server"] == prev and second["state"] == "running", (second, run.output[-3000:])
    assert second["server_id"] != before[HOSTS[1]]["server_id"], "the failed host's server was not restarted"
    assert f"- {HOSTS[0]}: runs v4 (updated; was v{prev}, target v4)" in summary
    assert f"- {HOSTS[1]}: runs v{prev} (reverted to v{prev}; was v{prev}, target v4)" in summary
    assert f"The rollout stopped: {HOSTS[1]} failed in batch 2." in summary
    assert hosts[HOSTS[1]]["failed_step"] == "server"
