"""library/service_unit_facts.py on systemctl output recorded from a lab host (Debian 12, systemd 252):
the same entries ansible.builtin.service_facts gives for systemd units, in three calls; a failing
systemctl is an error that names the call. (On the lab's hosts the two modules were compared whole:
equal but for service_facts' SysV entries, which this module does not read.)"""

from __future__ import annotations

import pytest
from ansible_modules import load_module

suf = load_module("service_unit_facts")

LIST_UNITS = """\
auditd.service                       not-found inactive dead    auditd.service
console-getty.service                masked    inactive dead    console-getty.service
dbus.service                         loaded    active   running D-Bus System Message Bus
fail2.service                        loaded    failed   failed  Something failed
ssh.service                          loaded    active   running OpenBSD Secure Shell server
vllm-kimi.service                    loaded    inactive dead    vLLM, not failed at all
"""
LIST_UNIT_FILES = """\
apt-daily.service                      static   -
autovt@.service                        masked   enabled
console-getty.service                  masked   disabled
dbus.service                           static   -
fail2.service                          enabled  enabled
getty@.service                         masked   enabled
ssh.service                            enabled  enabled
sshd.service                           alias    -
vllm-kimi.service                      disabled enabled
"""
SHOW = "Id=apt-daily.service\nActiveState=inactive\n\nId=ssh.service\nActiveState=active\n"


class FakeModule:
    """What the module calls on AnsibleModule: systemctl's answers by subcommand."""

    def __init__(self, answers: dict[str, tuple[int, str, str]]):
        self.answers, self.calls = answers, []

    def get_bin_path(self, name, required=False, opt_dirs=None):
        return f"/usr/bin/{name}"

    def run_command(self, args):
        self.calls.append(args)
        return self.answers[args[3]]

    def fail_json(self, **kw):
        raise RuntimeError(kw["msg"])


def answers(show=SHOW, show_rc=0):
    return {"list-units": (0, LIST_UNITS, ""), "list-unit-files": (0, LIST_UNIT_FILES, ""), "show": (show_rc, show, "")}


def entry(name, state, status):
    return {"name": name, "state": state, "status": status, "source": "systemd"}


def test_the_units_as_service_facts_reads_them_in_three_calls():
    module = FakeModule(answers())
    got = suf.ServiceUnitFacts(module).services()
    assert got == {
        "auditd.service": entry("auditd.service", "stopped", "not-found"),
        "console-getty.service": entry("console-getty.service", "stopped", "masked"),
        "dbus.service": entry("dbus.service", "running", "static"),
        "fail2.service": entry("fail2.service", "stopped", "failed"),
        "ssh.service": entry("ssh.service", "running", "enabled"),
        # "failed" in a description is not a state:
        "vllm-kimi.service": entry("vllm-kimi.service", "stopped", "disabled"),
        # Not loaded: the ActiveState systemctl show gives (an alias its target's), templates unknown.
        "apt-daily.service": entry("apt-daily.service", "inactive", "static"),
        "sshd.service": entry("sshd.service", "active", "alias"),
        "autovt@.service": entry("autovt@.service", "unknown", "masked"),
        "getty@.service": entry("getty@.service", "unknown", "masked"),
    }
    assert [c[3] for c in module.calls] == ["list-units", "list-unit-files", "show"]
    assert module.calls[2][-3:] == ["--", "apt-daily.service", "sshd.service"]  # options before the names


def test_a_name_systemctl_show_refuses_leaves_the_others_by_id():
    module = FakeModule(answers(show="Id=apt-daily.service\nActiveState=inactive\n", show_rc=1))
    got = suf.ServiceUnitFacts(module).services()
    assert got["apt-daily.service"]["state"] == "inactive" and got["sshd.service"]["state"] == "unknown"


def test_a_failing_systemctl_is_an_error_naming_the_call():
    module = FakeModule({**answers(), "list-unit-files": (1, "", "Failed to connect to bus: No such file or directory")})
    with pytest.raises(RuntimeError, match=r"systemctl list-unit-files --type service failed \(rc 1\): Failed to connect"):
        suf.ServiceUnitFacts(module).services()
