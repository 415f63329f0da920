"""Issue #51 item 7: the park window is one fact, kept with the parked buckets.

A takeover of a node that does not answer parks the buckets it last reported finished for the park
window it was given (hsx_takeover_park_window). The window is written into the assignment file's
`parked` entry (`window_s`), and everything that asks "has the window passed?" reads it there: the
next takeover releases them by it (not by its own window), `hsx fleet-status --prom` exports it as
hsx_fleet_parked_window_seconds beside hsx_fleet_parked_since_timestamp_seconds, and the alert
HsxParkedPastWindow (roles/monitoring/files/hsx.rules.yml) compares the two - so the alert never
disagrees with the code. The one default (hsx.fleetplan.DEFAULT_PARK_WINDOW_S) is the module's and
the role's too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from promtool import promtool

from extraction.fleet.fleetbuckets import fleet_view, mark_taken_over, prometheus_text
from extraction.fleet.fleetstatus import HostStatus
from hsx.assignfile import AssignmentFileError, read_assignment
from hsx.fleetplan import DEFAULT_PARK_WINDOW_S, plan_takeover

ROOT = Path(__file__).resolve().parents[2]
FLEET = {"buckets": 12, "created": "x", "epoch": 0, "hosts": {"n1": "0-3", "n2": "4-7", "n3": "8-11"},
         "retired": [], "history": []}
REPORTED = {"finished": {4, 5}, "at": "2026-12-07T10:00:00+00:00", "by": "fleet-status"}
T0 = "2026-12-07T11:00:00+00:00"
HOUR_AND_A_SECOND = "2026-12-07T12:00:01+00:00"


def test_the_window_is_kept_with_the_parked_buckets_and_a_later_takeover_releases_by_it() -> None:
    parked, _ = plan_takeover(FLEET, "n2", None, ["n1", "n3"], T0, recorded=REPORTED, park_window_s=3600)
    assert parked["parked"]["n2"]["window_s"] == 3600
    # An hour and a second later a takeover given a day still releases them: the park's own hour counts.
    new, moves = plan_takeover(parked, "n2", None, ["n1", "n3"], HOUR_AND_A_SECOND, recorded=REPORTED,
                               park_window_s=86400)
    assert moves == {"n1": {4}, "n3": {5}} and "parked" not in new
    assert new["history"][-1]["why"] == "unreachable past the park window"
    # Parked for a day, a takeover given a minute does not release them an hour later.
    day, _ = plan_takeover(FLEET, "n2", None, ["n1", "n3"], T0, recorded=REPORTED, park_window_s=86400)
    again, moves = plan_takeover(day, "n2", None, ["n1", "n3"], HOUR_AND_A_SECOND, recorded=REPORTED,
                                 park_window_s=60)
    assert again is day and moves == {}


@pytest.mark.parametrize("window", ["3600", -1, True, 1.5])
def test_a_window_that_is_not_whole_seconds_is_refused_naming_it(tmp_path, window) -> None:
    parked, _ = plan_takeover(FLEET, "n2", None, ["n1", "n3"], T0, recorded=REPORTED, park_window_s=3600)
    path = tmp_path / "assignment.json"
    path.write_text(json.dumps(parked))
    assert read_assignment(str(path))["parked"]["n2"]["window_s"] == 3600
    parked["parked"]["n2"]["window_s"] = window
    path.write_text(json.dumps(parked))
    with pytest.raises(AssignmentFileError, match=r"'parked' 'n2': 'window_s' must be whole seconds"):
        read_assignment(str(path))


def test_fleet_status_exports_each_hosts_window_beside_when_it_was_parked() -> None:
    parked, _ = plan_takeover(FLEET, "n2", None, ["n1", "n3"], T0, recorded=REPORTED, park_window_s=3600)
    totals = [2] * 12
    live = [HostStatus(h, result={"state": "done", "making_progress": False, "done": 0, "total": 0, "bucket_count": 12,
                                  "bucket_totals": totals, "assign": parked["hosts"][h], "finished_buckets": "",
                                  "bucket_done": {}}) for h in ("n1", "n3")]
    hosts = [*live, HostStatus("n2", unreachable=True, error="No route to host")]
    mark_taken_over(hosts, parked)
    prom = prometheus_text(fleet_view(hosts, parked), hosts)
    assert 'hsx_fleet_parked_buckets{host="n2"} 2' in prom
    assert 'hsx_fleet_parked_since_timestamp_seconds{host="n2"} 1796641200' in prom
    assert 'hsx_fleet_parked_window_seconds{host="n2"} 3600' in prom
    checked = promtool("check", "metrics", stdin=prom.encode())
    assert checked.returncode == 0 and not checked.stdout.strip() and not checked.stderr.strip(), checked
    del parked["parked"]["n2"]["window_s"]  # parked before the window was kept: the default
    assert f'hsx_fleet_parked_window_seconds{{host="n2"}} {DEFAULT_PARK_WINDOW_S}' in prometheus_text(
        fleet_view(hosts, parked), hosts)


def test_the_default_window_is_one_number_and_the_alert_reads_the_exported_one() -> None:
    defaults = yaml.safe_load((ROOT / "roles/extraction_job/defaults/main.yml").read_text())
    role = re.fullmatch(r"\{\{ hsx_takeover_park_window \| default\((\d+)\) \}\}",
                        defaults["extraction_job_takeover_park_window"])
    assert role and int(role.group(1)) == DEFAULT_PARK_WINDOW_S
    doc = yaml.safe_load(re.search(r'DOCUMENTATION = r"""(.*?)"""', (ROOT / "library/hsx_assignment.py").read_text(),
                                   re.S).group(1))
    assert doc["options"]["park_window"]["default"] == DEFAULT_PARK_WINDOW_S
    rules = yaml.safe_load((ROOT / "roles/monitoring/files/hsx.rules.yml").read_text())
    (rule,) = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "HsxParkedPastWindow"]
    assert "hsx_fleet_parked_window_seconds" in rule["expr"] and "86400" not in rule["expr"]
    assert "hsx_remedy" not in rule["labels"]  # a person's call: self-healing never acts on it
