#!/usr/bin/python
# Copyright: (c) 2026, hsx maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module: wait until a (re)started server answers its health URL, or stop waiting as soon
as its systemd unit shows it never will (it died, or crash-loops).

Why not `uri` with `until`: a server whose patch breaks its model import crashes within seconds and
is restarted by systemd again and again; `uri` keeps polling for the whole health timeout (30 min
for a 1T model's load), which is how long a failed canary would hold a rollout at 3 a.m. This
module polls on the host (one SSH round trip in all, not one per probe) and watches the unit too.
"""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: service_health
short_description: Wait for a server's health URL, failing fast when its systemd unit dies
description:
  - Polls I(url) from the managed host until it answers I(status_code), for at most I(timeout) seconds.
  - With I(unit), also reads the unit's state between probes and fails at once when the unit is
    C(failed), has stopped (C(inactive)), is not loaded, or was restarted by systemd (C(NRestarts))
    more than I(max_restarts) times since the wait began - a server that crashes on start-up fails
    the task in seconds instead of after the whole timeout.
  - Never changes anything; safe in check mode (it probes as usual).
version_added: "0.1.0"
author:
  - hsx maintainers (!UNKNOWN)
requirements:
  - python >= 3.10 on the managed host
options:
  url:
    description: The health URL, requested from the managed host (for example C(http://127.0.0.1:30000/health)).
    type: str
    required: true
  status_code:
    description: The HTTP status that means healthy.
    type: int
    default: 200
  unit:
    description: The systemd unit running the server; omit to poll the URL only.
    type: str
  timeout:
    description: Seconds the server gets to answer, counted from the start of this task.
    type: int
    default: 1800
  delay:
    description: Seconds between probes.
    type: float
    default: 5
  request_timeout:
    description: Seconds one probe may take.
    type: float
    default: 10
  max_restarts:
    description:
      - Automatic restarts of I(unit) (by its C(Restart=)) tolerated during the wait; one more
        means the server crash-loops and the task fails.
    type: int
    default: 1
seealso:
  - module: ansible.builtin.uri
    description: Polls a URL, without watching the unit that serves it.
  - module: ansible.builtin.wait_for
    description: Waits for a port to open, without asking the server whether it is healthy.
  - module: ansible.builtin.systemd_service
    description: Starts the unit whose health this module waits for.
extends_documentation_fragment:
  - hsx.recovery.attributes
attributes:
  check_mode:
    support: full
    details: Probes as usual and changes nothing, in check mode too.
  diff_mode:
    support: none
notes:
  - C(NRestarts) needs systemd 235 or later; on an older systemd only the unit's state is watched.
"""

EXAMPLES = r"""
- name: Wait until the SGLang server is healthy (fails fast if it crash-loops)
  service_health:
    url: http://127.0.0.1:30000/health
    unit: hsx-sglang-server.service
    timeout: 1800
    delay: 5
  register: health

- name: Poll a URL only
  service_health:
    url: http://127.0.0.1:8080/ready
    timeout: 60
"""

RETURN = r"""
healthy:
  description: Whether the URL answered I(status_code) in time.
  type: bool
  returned: always
status:
  description: The HTTP status of the last probe (0 when no answer).
  type: int
  returned: always
error:
  description: Why the last probe got no answer (empty when it did).
  type: str
  returned: always
probes:
  description: How many probes were made.
  type: int
  returned: always
elapsed:
  description: Seconds waited.
  type: float
  returned: always
restarts:
  description: Automatic restarts of the unit during the wait (null without I(unit)).
  type: int
  returned: always
unit_state:
  description: The unit's last read state (C(ActiveState), C(SubState), C(Result), C(NRestarts), ...); empty without I(unit).
  type: dict
  returned: always
message:
  description: The reason in words, with the unit's state (empty when healthy).
  type: str
  returned: always
reason:
  description: Why the wait ended without health (C(unit failed), C(unit stopped), C(crash loop), C(timeout)), or empty.
  type: str
  returned: always
"""

import time
import urllib.error
from collections.abc import Callable
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.urls import open_url

ARGUMENT_SPEC = dict(
    url=dict(type="str", required=True),
    status_code=dict(type="int", default=200),
    unit=dict(type="str"),
    timeout=dict(type="int", default=1800),
    delay=dict(type="float", default=5),
    request_timeout=dict(type="float", default=10),
    max_restarts=dict(type="int", default=1),
)
UNIT_PROPERTIES = ("LoadState", "ActiveState", "SubState", "Result", "NRestarts", "ExecMainStatus", "MainPID")


def probe_url(url: str, request_timeout: float) -> tuple[int, str]:
    """One GET: (HTTP status, "") or (0, why there was no answer). Through Ansible's open_url (certificates
    validated, proxies from the environment, redirects followed; an HTTP error status raises HTTPError)."""
    try:
        with open_url(url, method="GET", timeout=request_timeout) as response:
            return response.status, ""
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (urllib.error.URLError, OSError, ValueError) as e:
        return 0, str(getattr(e, "reason", e))


def parse_show(text: str) -> dict[str, str]:
    """`systemctl show -p A -p B` output (A=x lines) as a dict."""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


class HealthWait:
    """The wait itself, with the probe, the unit reader and the clock injected (unit tests drive it)."""

    def __init__(self, probe: Callable[[], tuple[int, str]], read_unit: Callable[[], dict[str, str]] | None,
                 status_code: int = 200, timeout: float = 1800, delay: float = 5, max_restarts: int = 1,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.probe, self.read_unit = probe, read_unit
        self.status_code, self.timeout, self.delay, self.max_restarts = status_code, timeout, delay, max_restarts
        self.clock, self.sleep = clock, sleep

    def unit_verdict(self, state: dict[str, str], baseline: int | None) -> tuple[str, str, int | None]:
        """(reason, message, restarts) for a unit that will not become healthy, ("", "", restarts) otherwise."""
        restarts = None
        if baseline is not None and state.get("NRestarts", "").isdigit():
            restarts = int(state["NRestarts"]) - baseline
        active, sub = state.get("ActiveState", ""), state.get("SubState", "")
        detail = (f"{active}/{sub}, result {state.get('Result', '?')}, "
                  f"exit status {state.get('ExecMainStatus', '?')}")
        if state.get("LoadState", "loaded") != "loaded":
            return "unit not loaded", f"the unit is {state.get('LoadState')}", restarts
        if active == "failed":
            return "unit failed", f"the unit failed ({detail})", restarts
        if active in ("inactive", "deactivating"):
            return "unit stopped", f"the unit stopped ({detail})", restarts
        if restarts is not None and restarts > self.max_restarts:
            return ("crash loop", f"systemd restarted the unit {restarts} times while we waited "
                    f"(more than {self.max_restarts}; now {detail})", restarts)
        return "", "", restarts

    def run(self) -> dict[str, Any]:
        start = self.clock()
        state: dict[str, str] = self.read_unit() if self.read_unit else {}
        baseline = int(state["NRestarts"]) if state.get("NRestarts", "").isdigit() else None
        result: dict[str, Any] = {"healthy": False, "status": 0, "error": "", "probes": 0, "elapsed": 0.0,
                                  "restarts": 0 if baseline is not None else None, "unit_state": state,
                                  "reason": "", "message": ""}
        while True:
            status, error = self.probe()
            result.update(status=status, error=error, probes=result["probes"] + 1,
                          elapsed=round(self.clock() - start, 2))
            if status == self.status_code:
                result["healthy"] = True
                return result
            if self.read_unit:
                state = self.read_unit()
                reason, message, restarts = self.unit_verdict(state, baseline)
                result.update(unit_state=state, restarts=restarts)
                if reason:
                    result.update(reason=reason, message=message)
                    return result
            waited = self.clock() - start
            if waited >= self.timeout:
                last = f"HTTP {status}" if status else (error or "no answer")
                result.update(reason="timeout", message=f"no {self.status_code} within {self.timeout:g} s "
                              f"(last probe: {last})")
                return result
            self.sleep(max(0.0, min(self.delay, self.timeout - waited)))


class ServiceHealthModule:
    """The module: checks the arguments, waits (HealthWait, reading the unit with systemctl) and fails
    with the reason when the server did not become healthy. Changes nothing, also outside check mode."""

    def __init__(self, module: AnsibleModule):
        self.module = module
        self.params = module.params
        self.systemctl_show: list[str] = []

    def read_unit(self) -> dict[str, str]:
        rc, out, err = self.module.run_command(self.systemctl_show)
        if rc != 0:
            self.module.fail_json(msg=f"systemctl show {self.params['unit']} failed (rc {rc}): {err.strip()}")
        return parse_show(out)

    def run(self) -> dict[str, Any]:
        p = self.params
        if p["timeout"] < 0 or p["delay"] <= 0 or p["request_timeout"] <= 0 or p["max_restarts"] < 0:
            self.module.fail_json(msg=f"timeout must be >= 0, delay and request_timeout > 0, max_restarts >= 0; got "
                                      f"timeout={p['timeout']}, delay={p['delay']}, request_timeout={p['request_timeout']}, "
                                      f"max_restarts={p['max_restarts']}")
        if p["unit"]:
            systemctl = self.module.get_bin_path("systemctl", required=True)
            self.systemctl_show = [systemctl, "show", p["unit"], *[f"--property={name}" for name in UNIT_PROPERTIES]]
        wait = HealthWait(lambda: probe_url(p["url"], p["request_timeout"]), self.read_unit if p["unit"] else None,
                          status_code=p["status_code"], timeout=p["timeout"], delay=p["delay"],
                          max_restarts=p["max_restarts"])
        result = dict(wait.run(), changed=False)
        if not result["healthy"]:
            unit = f"{p['unit']}: " if p["unit"] else ""
            self.module.fail_json(msg=f"{p['url']} is not healthy: {unit}{result['message']}", **result)
        return result


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    module.exit_json(**ServiceHealthModule(module).run())


if __name__ == "__main__":
    main()
