"""The lab's control-node side (tests/lab/lab.py imports it): the packages the machine needs, the lab's
SSH key, and the hosts' Debian rootfs, built once per machine with debootstrap and cached outside the
clone; and what every part of the lab shares - its error, its log line and its way to run a command.

Runs as root, stdlib only (it must work before any venv exists).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

SUITE = "bookworm"
CACHE = Path(os.environ.get("HSX_LAB_CACHE", "/var/cache/hsx-lab"))
# Packages inside every host. python3-venv: extraction_deploy builds a venv on the host;
# prometheus-node-exporter: the distribution's node_exporter, running, its textfile collector
# reading /var/lib/prometheus/node-exporter (roles/monitoring, tests/integration/test_monitoring.py).
ROOTFS_PACKAGES = [
    "systemd", "systemd-sysv", "dbus", "python3", "python3-venv", "openssh-server",
    "iproute2", "sudo", "procps", "e2fsprogs", "prometheus-node-exporter",
]
# prometheus: promtool (the metrics and alert-rule tests) and the server the monitoring test runs.
CONTROL_PACKAGES = {"debootstrap": "debootstrap", "systemd-nspawn": "systemd-container",
                    "ssh": "openssh-client", "ssh-keygen": "openssh-client",
                    "mkfs.ext4": "e2fsprogs", "ip": "iproute2",
                    "promtool": "prometheus", "prometheus": "prometheus",
                    # The self-healing loop (tests/integration/test_self_healing.py): Alertmanager and
                    # the Java runtime ansible-rulebook's rule engine (drools_jpy) needs.
                    "prometheus-alertmanager": "prometheus-alertmanager", "amtool": "prometheus-alertmanager",
                    "java": "openjdk-17-jre-headless",
                    # examples/stage_data.yml's copy (tests/unit/test_stage_data.py).
                    "rsync": "rsync"}
# Installed without their recommends: prometheus would bring a node_exporter and its collectors'
# timers to the control node, which runs only the test's own server.
NO_RECOMMENDS = {"prometheus", "prometheus-alertmanager", "openjdk-17-jre-headless"}
# Units that cannot work inside a container and would only make the host "degraded".
MASKED_UNITS = ["console-getty.service", "getty@.service", "systemd-remount-fs.service",
                "systemd-timesyncd.service", "apt-daily.timer", "apt-daily-upgrade.timer",
                "e2scrub_all.timer", "e2scrub_reap.service", "fstrim.timer"]


class LabError(RuntimeError):
    """A lab step failed; the message says which and why."""


def log(msg: str) -> None:
    print(f"lab: {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if check and proc.returncode != 0:
        raise LabError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc


def ensure_control_packages() -> None:
    missing = sorted({pkg for tool, pkg in CONTROL_PACKAGES.items() if not shutil.which(tool)})
    if not missing:
        return
    log(f"installing {' '.join(missing)} (apt)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run(["apt-get", "update", "-qq"], env=env, timeout=600)
    plain = [p for p in missing if p not in NO_RECOMMENDS]
    if plain:
        run(["apt-get", "install", "-y", "-qq", *plain], env=env, timeout=900)
    lean = [p for p in missing if p in NO_RECOMMENDS]
    if lean:
        run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *lean], env=env, timeout=900)


def debian_mirror(apt_dir: Path = Path("/etc/apt")) -> str:
    """The Debian mirror this machine's apt already uses (never a hard-coded host)."""
    override = os.environ.get("HSX_LAB_MIRROR")
    if override:
        return override
    sources = [apt_dir / "sources.list", *sorted((apt_dir / "sources.list.d").glob("*"))]
    for src in sources:
        if not src.is_file():
            continue
        text = src.read_text(errors="replace")
        for m in re.finditer(r"^URIs:\s*(\S+)\s*$\s*^Suites:\s*([^\n]+)$", text, re.M):
            if SUITE in m.group(2).split() and "security" not in m.group(1):
                return m.group(1)
        for m in re.finditer(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)", text, re.M):
            if m.group(2) == SUITE:
                return m.group(1)
    raise LabError(f"no Debian {SUITE} mirror found in {apt_dir} sources; set HSX_LAB_MIRROR")


def lab_key() -> Path:
    key = CACHE / "lab_key"
    if not key.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "hsx-lab", "-f", str(key)])
    return key


def rootfs_dir() -> Path:
    digest = hashlib.sha256(" ".join([SUITE, *ROOTFS_PACKAGES, *MASKED_UNITS]).encode()).hexdigest()[:12]
    return CACHE / f"rootfs-{SUITE}-{digest}"


def ensure_rootfs() -> Path:
    """Build the host rootfs once per machine (cached outside the clone, keyed by its contents)."""
    root = rootfs_dir()
    if (root / ".complete").exists():
        return root
    ensure_control_packages()
    tmp = root.with_name(root.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    mirror = debian_mirror()
    log(f"building rootfs {root.name} with debootstrap (about a minute)")
    t0 = time.monotonic()
    run(["debootstrap", "--variant=minbase", f"--include={','.join(ROOTFS_PACKAGES)}",
         SUITE, str(tmp), mirror], timeout=1200)
    for unit in MASKED_UNITS:
        link = tmp / "etc/systemd/system" / unit
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")
    (tmp / "etc/ssh/sshd_config.d").mkdir(parents=True, exist_ok=True)
    (tmp / "etc/ssh/sshd_config.d/hsx-lab.conf").write_text(
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\nUseDNS no\n")
    (tmp / "etc/machine-id").write_text("")
    # Empty apt sources: lab hosts have no network; everything arrives from the control node.
    (tmp / "etc/apt/sources.list").write_text("")
    (tmp / ".complete").write_text(f"built in {time.monotonic() - t0:.0f}s\n")
    tmp.rename(root)
    log(f"rootfs ready in {time.monotonic() - t0:.0f}s")
    return root
