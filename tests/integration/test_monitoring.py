"""A real Prometheus (Debian's package, on the control node) scrapes a lab host's real
node_exporter (Debian's, in the host) over its veth link, with roles/monitoring's alert rules:
the scraped values of a finished run equal `hsx status --json`, and when /data fills the job
pauses and HsxJobPausedDiskLow fires. Then roles/monitoring moves the textfile directory (check
mode first: nothing changes), node_exporter reads the new one, and a second run changes nothing.
And a node provisioned before roles/monitoring (its textfile directory root's): the job's roles
alone (what recover.yml runs) let the job's account write its metrics there."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request

import pytest
from labctl import REPO, _lab_module, host, lab, lab_ssh, playbook, wait_for

HOST = host(1)
# A 32-sample dataset: the run finishes within seconds, its values then still.
SMALL = ["-e", "hsx_lab_dataset_size=32"]
FAST = ["-e", "extraction_job_restart_sec=2", "-e", "extraction_job_wait_for_progress=false", *SMALL]
RULES = REPO / "roles" / "monitoring" / "files" / "hsx.rules.yml"
# The scrape asks node_exporter for the collectors the rules and tests read (textfile: hsx_* and
# node_textfile_*; stat: node_boot_time_seconds), not its default ~40: those cost a lab host ~35 ms
# of CPU a scrape, scraped every second by these tests (a site's Prometheus scrapes them all).
SCRAPE_PARAMS = {"collect[]": ["textfile", "stat"]}
FIELDS = [("hsx_samples_done", "done"), ("hsx_samples_planned", "total"), ("hsx_samples_written_total", "written"),
          ("hsx_samples_failed_total", "errors"), ("hsx_written_bytes_total", "bytes_written"),
          ("hsx_output_free_bytes", "free_bytes"), ("hsx_output_reserve_bytes", "reserve_bytes"),
          ("hsx_samples_per_second", "samples_per_s"), ("hsx_tokens_per_second", "tokens_per_s")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """The HTTP API of the test's server (never through a proxy the environment may name)."""

    def __init__(self, url: str):
        self.url = url
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def ready(self) -> bool:
        try:
            with self.opener.open(f"{self.url}/-/ready", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str):
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with self.opener.open(f"{self.url}/api/v1/{path}{query}", timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def value(self, promql: str) -> float | None:
        result = self.api("query", query=promql)["result"]
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def firing(self, name: str) -> list[dict]:
        return [a["labels"] for a in self.api("alerts")["alerts"] if a["labels"]["alertname"] == name
                and a["state"] == "firing"]


def status(output: str) -> dict:
    out = lab_ssh(HOST, f"/opt/hsx/venv/bin/hsx status {output} --json").stdout
    outputs = json.loads(out).get("outputs") if out.strip().startswith("{") else None
    return outputs[0] if outputs else {}


@pytest.fixture(scope="module")
def prom(tmp_path_factory):
    if not shutil.which("prometheus"):
        pytest.skip("Debian's prometheus package is not installed (make lab-ensure installs it)")
    lab("up", "1", "--data-size", "1G")
    proc = None
    try:
        planted = playbook("tests/plays/plant_model.yml", *SMALL)
        assert planted.rc == 0, planted.output[-3000:]
        deployed = playbook("tests/plays/deploy_monitored.yml", *FAST)
        assert deployed.rc == 0, deployed.output[-4000:]
        address = _lab_module().load_host(HOST).address
        d = tmp_path_factory.mktemp("prometheus")
        (d / "prometheus.yml").write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "node", "params": SCRAPE_PARAMS,
                                "static_configs": [{"targets": [f"{address}:9100"]}]}],
        }))
        port = free_port()
        log = open(d / "prometheus.log", "wb")  # noqa: SIM115 - the server's, closed with it
        proc = subprocess.Popen(["prometheus", f"--config.file={d / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={d / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
        p = Prometheus(f"http://127.0.0.1:{port}")
        wait_for(p.ready, 60, f"Prometheus to start (log: {d / 'prometheus.log'})")
        wait_for(lambda: p.value(f'up{{instance="{address}:9100"}}') == 1, 60, "Prometheus to scrape the host")
        yield p, f"{address}:9100"
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        lab("down", check=False)


def test_scraped_values_of_a_finished_run_equal_hsx_status(prom) -> None:
    p, instance = prom
    out = "/data/hsx/output"
    done = wait_for(lambda: (s := status(out)).get("state") == "done" and s, 300, "the job to finish")
    text = lab_ssh(HOST, f"cat {out}/metrics.prom").stdout
    assert f'hsx_samples_done{{output="{out}"}} {float(done["total"])}' in text, text
    assert f'hsx_samples_planned{{output="{out}"}} {float(done["total"])}' in text
    sel = f'instance="{instance}",output="{out}"'
    wait_for(lambda: p.value(f'hsx_state{{{sel},state="done"}}') == 1, 60, "Prometheus to see the run done")
    for metric, key in FIELDS:
        assert p.value(f"{metric}{{{sel}}}") == pytest.approx(done[key]), metric
    assert p.value(f'node_textfile_scrape_error{{instance="{instance}"}}') == 0
    assert p.firing("HsxJobPausedDiskLow") == []


def test_filling_data_pauses_the_job_and_the_alert_fires(prom) -> None:
    p, instance = prom
    # A new run into the emptied output (the unit may write only there) on a nearly full /data.
    out = "/data/hsx/output"
    assert status(out)["state"] == "done"
    lab_ssh(HOST, f"find {out} -mindepth 1 -delete")
    lab_ssh(HOST, "fallocate -l $(( $(df --output=avail -B1 /data | tail -1) - 8*1024*1024 )) /data/filler")
    lab_ssh(HOST, "systemctl restart hsx-extraction")
    alert = wait_for(lambda: [a for a in p.firing("HsxJobPausedDiskLow") if a.get("output") == out], 120,
                     "HsxJobPausedDiskLow to fire")
    assert alert[0]["instance"] == instance and alert[0]["severity"] == "critical"
    paused = status(out)
    assert paused["state"] == "paused: disk low"
    sel = f'instance="{instance}",output="{out}"'
    for metric, key in FIELDS:
        assert p.value(f"{metric}{{{sel}}}") == pytest.approx(paused[key]), metric


def test_monitoring_role_moves_the_textfile_dir_checks_first_and_changes_nothing_twice(prom) -> None:
    p, instance = prom
    moved = ["-e", "hsx_metrics_textfile_dir=/var/lib/hsx-textfile", "-e", "monitoring_rules_dir=/etc/prometheus/rules"]
    args_before = lab_ssh(HOST, "grep ^ARGS= /etc/default/prometheus-node-exporter").stdout
    check = playbook("tests/plays/monitoring.yml", "--check", *moved)
    assert check.rc == 0 and check.recap()[HOST]["changed"] > 0, check.output[-3000:]
    assert lab_ssh(HOST, "test -e /var/lib/hsx-textfile || test -e /etc/prometheus/rules").returncode != 0
    assert lab_ssh(HOST, "grep ^ARGS= /etc/default/prometheus-node-exporter").stdout == args_before
    try:
        first = playbook("tests/plays/monitoring.yml", *moved)
        assert first.rc == 0, first.output[-3000:]
        assert "--collector.textfile.directory=/var/lib/hsx-textfile" in lab_ssh(
            HOST, "grep ^ARGS= /etc/default/prometheus-node-exporter").stdout
        for rules in (RULES, RULES.with_name("hsx-selfheal.rules.yml")):  # the self-healing alerts beside them
            installed = lab_ssh(HOST, f"sha256sum /etc/prometheus/rules/{rules.name}").stdout.split()[:1]
            assert installed == [hashlib.sha256(rules.read_bytes()).hexdigest()], rules.name
        lab_ssh(HOST, "cp /var/lib/prometheus/node-exporter/hsx-*.prom /var/lib/hsx-textfile/")
        moved_files = f'node_textfile_mtime_seconds{{instance="{instance}",file=~"/var/lib/hsx-textfile/hsx-.*"}}'
        wait_for(lambda: p.value(moved_files) is not None, 60, "node_exporter (restarted) to read the new directory")
        again = playbook("tests/plays/monitoring.yml", *moved)
        assert again.rc == 0 and again.recap()[HOST]["changed"] == 0, again.output[-3000:]
    finally:
        back = playbook("tests/plays/monitoring.yml")
        assert back.rc == 0, back.output[-3000:]
    assert lab_ssh(HOST, "grep ^ARGS= /etc/default/prometheus-node-exporter").stdout == args_before


def test_the_jobs_roles_alone_let_its_account_write_an_old_nodes_textfile_dir(prom) -> None:
    """A textfile directory only root may write (a node provisioned before roles/monitoring): the
    job's roles, without roles/monitoring, give it to the job's group - not in check mode - and
    the job's account can then write its metrics there; a second run changes nothing."""
    textfile = "/var/lib/prometheus/node-exporter"
    lab_ssh(HOST, "rm -f /data/filler")  # the disk-low test's: the job's roles would refuse a full /data
    lab_ssh(HOST, f"chgrp root {textfile} && chmod 0755 {textfile}")
    writable = f"runuser -u hsx -- test -w {textfile}"
    assert lab_ssh(HOST, writable).returncode != 0
    check = playbook("tests/plays/deploy_and_run.yml", "--check", *FAST)
    assert check.rc == 0, check.output[-3000:]
    assert lab_ssh(HOST, writable).returncode != 0  # check mode changed nothing
    first = playbook("tests/plays/deploy_and_run.yml", *FAST)
    assert first.rc == 0, first.output[-3000:]
    assert lab_ssh(HOST, f"stat -c %G:%a {textfile}").stdout.strip() == "hsx:775"
    assert lab_ssh(HOST, writable).returncode == 0
    again = playbook("tests/plays/deploy_and_run.yml", *FAST)
    assert again.rc == 0 and again.recap()[HOST]["changed"] == 0, again.output[-3000:]


def test_prometheus_prometheus_node_exporter_is_checked_and_told_never_skipped(prom) -> None:
    """The other layout (issue #50 item 6): node_exporter as the prometheus.prometheus collection's
    node_exporter role installs it (its unit node_exporter.service, flags in the unit; a stand-in unit,
    tests/plays/files/prometheus-prometheus-node_exporter.service, with Debian's binary as the role's
    local binary), in place of Debian's. roles/monitoring reads the unit's textfile directory: where it
    is not the job's, the run stops before changing anything and names the variable to set in that
    role; where it is, the run points nothing, gives the directory to the job's group, and the hsx
    files there are scraped; a second run changes nothing. Debian's ARGS are never touched."""
    p, instance = prom
    unit = (REPO / "tests" / "plays" / "files" / "prometheus-prometheus-node_exporter.service").read_text()
    args_before = lab_ssh(HOST, "grep ^ARGS= /etc/default/prometheus-node-exporter").stdout
    installed = lab_ssh(HOST, "set -e; id node-exp >/dev/null 2>&1 || useradd --system --no-create-home "
                              "--shell /usr/sbin/nologin node-exp; install -d -o node-exp -g node-exp -m 0775 "
                              "/var/lib/node_exporter; install -m 0755 /usr/bin/prometheus-node-exporter "
                              "/usr/local/bin/node_exporter; cat > /etc/systemd/system/node_exporter.service <<'EOF'\n"
                              f"{unit}EOF\nsystemctl stop prometheus-node-exporter; systemctl daemon-reload; "
                              "systemctl start node_exporter")
    assert installed.returncode == 0, installed.stderr
    try:
        wait_for(lambda: p.value(f'up{{instance="{instance}"}}') == 1 and lab_ssh(
            HOST, "systemctl is-active node_exporter").stdout.strip() == "active", 60, "node_exporter.service to serve")
        told = playbook("tests/plays/monitoring.yml")
        assert told.rc != 0 and told.recap()[HOST]["changed"] == 0, told.output[-3000:]
        said = " ".join(told.output.split())
        assert ("reads textfiles from /var/lib/node_exporter, but the job and the recovery write theirs to "
                "/var/lib/prometheus/node-exporter") in said, said[-3000:]
        assert "set node_exporter_textfile_dir: /var/lib/prometheus/node-exporter" in said
        assert "set hsx_metrics_textfile_dir: /var/lib/node_exporter" in said and "Nothing was changed" in said
        followed = ["-e", "hsx_metrics_textfile_dir=/var/lib/node_exporter"]
        first = playbook("tests/plays/monitoring.yml", *followed)
        assert first.rc == 0, first.output[-3000:]
        assert lab_ssh(HOST, "stat -c %G:%a /var/lib/node_exporter").stdout.strip() == "hsx:775"
        lab_ssh(HOST, "cp /var/lib/prometheus/node-exporter/hsx-*.prom /var/lib/node_exporter/")
        files = f'node_textfile_mtime_seconds{{instance="{instance}",file=~"/var/lib/node_exporter/hsx-.*"}}'
        wait_for(lambda: p.value(files) is not None, 60, "node_exporter.service to serve the hsx textfiles")
        again = playbook("tests/plays/monitoring.yml", *followed)
        assert again.rc == 0 and again.recap()[HOST]["changed"] == 0, again.output[-3000:]
        assert lab_ssh(HOST, "grep ^ARGS= /etc/default/prometheus-node-exporter").stdout == args_before
    finally:
        lab_ssh(HOST, "systemctl stop node_exporter; rm -f /etc/systemd/system/node_exporter.service "
                      "/usr/local/bin/node_exporter; systemctl daemon-reload; systemctl start prometheus-node-exporter")
