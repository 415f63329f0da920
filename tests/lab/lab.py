#!/usr/bin/env python3
"""The lab: real Debian test hosts (systemd as PID 1, real SSH) on a machine without Docker.

Each host is a systemd-nspawn container booted from a cached debootstrap'd rootfs through an
overlayfs copy, in its own network namespace reached over a veth pair, with its own loop-mounted
ext4 /data. Everything the lab creates carries the prefix `hsxlab`, and `up` first removes what a
killed earlier run left behind under that prefix (containers, cgroups, mounts, namespaces) and
nothing else.

    lab.py up N [--data-size 512M] [--no-data NAME...] [--ro-data NAME...] [--venv PATH]
    lab.py down | status | inventory [--out FILE] | ensure | ssh NAME CMD...
    lab.py poweroff NAME | boot NAME | cpu-log

`poweroff` cuts a host's power: every process of the host is killed at once (no shutdown) and its
network link goes down, so the control node sees what it sees of a dead node (no route, SSH times
out); its disks (the rootfs overlay, /data) stay, with whatever reached them. `boot` starts it
again from those disks, through systemd's normal boot (enabled units start). Unlike a real power
cut, writes still in the page cache are not lost (the kernel is shared).

`--venv PATH` gives every host a venv of the control node at the same path, as a node image would
have it installed (tests/molecule/sglang_server: the released SGLang of tests/sglang_cpu/install.py,
7.4 GB, never copied): an overlayfs per host, the venv read-only below and the host's own upper
layer above (what the host writes there - SGLang's patched model file, the hook - stays on that
host, and the control node's venv is never written), its interpreter re-pointed at the host's own
Python of the same minor version (repoint_venv). A venv whose Python the rootfs lacks is refused.

Ansible reads the hosts through inventory/lab/lab_hosts.py (a dynamic inventory); a powered-off
host stays in it, as a dead node stays in a site's inventory.

The control node's side - the packages it needs, the lab key, the hosts' cached rootfs - is
lab_control.py beside this file. Runs as root, stdlib only (it must work before any venv exists).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# Its sibling lab_control.py, also when this file is loaded by path (tests/labctl.py, inventory/lab).
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab_control import CACHE, LabError, ensure_control_packages, ensure_rootfs, lab_key, log, run  # noqa: E402

# HSX_LAB_ID (one digit) runs a separate lab beside the default one: its own names, subnet and
# hosts, so two engineers (or a test run and a demo) never tear down each other's hosts.
LAB_ID = os.environ.get("HSX_LAB_ID", "")
if LAB_ID and not (LAB_ID.isdigit() and len(LAB_ID) == 1):
    sys.exit(f"lab: HSX_LAB_ID must be one digit, not {LAB_ID!r}")
PREFIX = f"hsxlab{LAB_ID}"
SUBNET = f"10.{213 + int(LAB_ID or 0)}"
STATE = Path(os.environ.get("HSX_LAB_STATE", "/var/lib/hsx-lab"))
# The CPU seconds each host used, a line "NAME SECONDS" appended when its cgroup goes (down, poweroff):
# tests/run_all.sh sums the lines a stage added, since a host's CPU is in no process the stage waits for.
CPU_LOG = STATE / f"{PREFIX}.cpu"
REPO = Path(__file__).resolve().parents[2]
BOOT_TIMEOUT_S = 90


# ---------------------------------------------------------------- cgroups
def cgroup_roots() -> list[Path]:
    """The hierarchies a launcher must move itself into (hybrid: name=systemd + unified; v2: one)."""
    base = Path("/sys/fs/cgroup")
    if (base / "cgroup.controllers").exists():
        return [base]
    roots = [base / d for d in ("systemd", "unified") if (base / d / "cgroup.procs").exists()]
    if not roots:
        raise LabError("no usable cgroup hierarchy under /sys/fs/cgroup")
    return roots


def cgroup_pids(group: Path) -> list[int]:
    pids: list[int] = []
    for procs in group.rglob("cgroup.procs"):
        try:
            pids += [int(p) for p in procs.read_text().split()]
        except OSError:
            pass
    return pids


def cgroup_cpu_seconds(group: Path) -> float:
    """The CPU seconds the group used so far, it and its descendants (cgroup v2's cpu.stat); OSError,
    KeyError or ValueError where there is no such file (the name=systemd hierarchy, cgroup v1)."""
    stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
    return int(stat["usage_usec"]) / 1e6


def record_cpu(group: Path) -> None:
    """Append the CPU the group used (cgroup_cpu_seconds) to CPU_LOG."""
    try:
        seconds = cgroup_cpu_seconds(group)
        with CPU_LOG.open("a") as log_file:
            log_file.write(f"{group.name} {seconds:.1f}\n")
    except (OSError, KeyError, ValueError):  # no cpu.stat: the name=systemd hierarchy, cgroup v1
        pass


def remove_cgroup(group: Path) -> None:
    if not group.exists():
        return
    record_cpu(group)
    deadline = time.monotonic() + 15
    while True:
        kill_file = group / "cgroup.kill"
        if kill_file.exists():
            try:
                kill_file.write_text("1")
            except OSError:
                pass
        pids = cgroup_pids(group)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not pids:
            break
        if time.monotonic() > deadline:
            raise LabError(f"processes {pids[:10]} in {group} survive SIGKILL")
        time.sleep(0.1)
    for sub in sorted((p for p in group.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        _rmdir_retry(sub)
    _rmdir_retry(group)


def _rmdir_retry(path: Path) -> None:
    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    raise LabError(f"cannot remove cgroup {path}")


# ---------------------------------------------------------------- hosts
@dataclass
class Host:
    name: str
    index: int
    address: str
    peer: str
    data: str  # "rw", "ro" or "none"
    data_size: str
    pid: int = 0
    venv: str = ""  # a control node's venv the host sees at the same path (--venv); "" none

    @property
    def dir(self) -> Path:
        return STATE / self.name

    @property
    def veth(self) -> str:
        return veth_name(self.index)

    @classmethod
    def make(cls, index: int, data: str, data_size: str, venv: str = "") -> Host:
        return cls(name=f"{PREFIX}-{index}", index=index, address=f"{SUBNET}.{index}.2",
                   peer=f"{SUBNET}.{index}.1", data=data, data_size=data_size, venv=venv)


def veth_name(index: int) -> str:
    return f"hxl{LAB_ID}-{index}"  # interface names are limited to 15 characters


def host_names_on_disk() -> list[str]:
    names = {p.name for p in STATE.glob(f"{PREFIX}-*") if p.is_dir()}
    names |= {n for n in _netns_names() if n.startswith(f"{PREFIX}-")}
    for root in _safe_cgroup_roots():
        names |= {p.name for p in root.glob(f"{PREFIX}-*") if p.is_dir()}
    return sorted(names, key=lambda n: int(n.rsplit("-", 1)[1]) if n.rsplit("-", 1)[1].isdigit() else 0)


def _safe_cgroup_roots() -> list[Path]:
    try:
        return cgroup_roots()
    except LabError:
        return []


def _netns_names() -> list[str]:
    if not shutil.which("ip"):
        return []
    out = run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def load_host(name: str) -> Host | None:
    meta = STATE / name / "host.json"
    if not meta.exists():
        return None
    return Host(**json.loads(meta.read_text()))


def cleanup(name: str) -> None:
    """Remove every trace of one lab host, whatever state a killed run left it in."""
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc_dir / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmdline and cmdline[0].endswith(b"systemd-nspawn") and f"--machine={name}".encode() in cmdline:
            try:
                os.kill(int(proc_dir.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
    for root in _safe_cgroup_roots():
        remove_cgroup(root / name)
    host_dir = STATE / name
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for mnt in sorted((m for m in mounts if m.startswith(str(host_dir) + "/")), key=len, reverse=True):
        if run(["umount", mnt], check=False).returncode != 0:
            run(["umount", "-l", mnt], check=False)
    img = host_dir / "data.img"
    if img.exists():
        for line in run(["losetup", "-j", str(img)], check=False).stdout.splitlines():
            run(["losetup", "-d", line.split(":")[0]], check=False)
    if name in _netns_names():
        run(["ip", "netns", "delete", name], check=False)
    veth = veth_name(int(name.rsplit("-", 1)[1]))
    if Path(f"/sys/class/net/{veth}").exists():
        run(["ip", "link", "delete", veth], check=False)
    shutil.rmtree(host_dir, ignore_errors=True)


def venv_python(venv: Path, rootfs: Path) -> str:
    """The rootfs's interpreter for `venv` (/usr/bin/pythonX.Y, X.Y from the venv's pyvenv.cfg
    `version`); LabError naming both when the venv is not one or the rootfs has no such Python."""
    cfg = venv / "pyvenv.cfg"
    try:
        fields = {k.strip(): v.strip() for k, v in (ln.split("=", 1) for ln in cfg.read_text().splitlines() if "=" in ln)}
    except OSError as exc:
        raise LabError(f"--venv {venv}: not a venv ({cfg}: {exc.strerror})") from None
    version = ".".join(fields.get("version", fields.get("version_info", "")).split(".")[:2])
    python = f"/usr/bin/python{version}"
    if not version or not (rootfs / python.lstrip("/")).exists():
        raise LabError(f"--venv {venv} was made by Python {version or '?'} ({cfg}), which the hosts' "
                       f"rootfs {rootfs} does not have ({python}): make the venv with that Python")
    return python


def repoint_venv(view: Path, python: str) -> None:
    """Make the venv at `view` (a host's writable view of it) run with `python`, the host's own
    interpreter: pyvenv.cfg's home and executable, and bin/python, python3, pythonX.Y as links to it.
    Its site-packages (compiled for that minor version) stay as they are."""
    cfg = view / "pyvenv.cfg"
    lines = [line for line in cfg.read_text().splitlines()
             if line.split("=", 1)[0].strip() not in ("home", "executable", "command")]
    cfg.write_text("\n".join([f"home = {Path(python).parent}", *lines, f"executable = {python}"]) + "\n")
    for name in ("python", "python3", Path(python).name):
        link = view / "bin" / name
        link.unlink(missing_ok=True)
        link.symlink_to(python)


def prepare(host: Host, rootfs: Path, pubkey: str) -> None:
    d = host.dir
    for sub in ("upper", "work", "merged", "data"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    run(["mount", "-t", "overlay", "overlay", "-o",
         f"lowerdir={rootfs},upperdir={d / 'upper'},workdir={d / 'work'}", str(d / "merged")])
    merged = d / "merged"
    ssh_dir = merged / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    (ssh_dir / "authorized_keys").write_text(pubkey)
    (merged / "etc/hostname").write_text(host.name + "\n")
    (merged / "data").mkdir(exist_ok=True)
    if host.venv:  # the venv read-only below, the host's writes in its own upper layer
        for sub in ("venv-upper", "venv-work", "venv"):
            (d / sub).mkdir(exist_ok=True)
        run(["mount", "-t", "overlay", "overlay", "-o",
             f"lowerdir={host.venv},upperdir={d / 'venv-upper'},workdir={d / 'venv-work'}", str(d / "venv")])
        repoint_venv(d / "venv", venv_python(Path(host.venv), rootfs))
    if host.data != "none":
        img = d / "data.img"
        run(["truncate", "-s", host.data_size, str(img)])
        run(["mkfs.ext4", "-q", "-F", "-L", f"{host.name}-data", str(img)])
        run(["mount", "-o", "loop", str(img), str(d / "data")])
    run(["ip", "netns", "add", host.name])
    run(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.name])
    run(["ip", "addr", "add", f"{host.peer}/30", "dev", host.veth])
    run(["ip", "link", "set", host.veth, "up"])
    run(["ip", "-n", host.name, "addr", "add", f"{host.address}/30", "dev", "eth0"])
    run(["ip", "-n", host.name, "link", "set", "eth0", "up"])
    run(["ip", "-n", host.name, "link", "set", "lo", "up"])


def launch(host: Host) -> None:
    """Start systemd-nspawn in its own cgroup (both hierarchies) so several hosts never collide."""
    groups = []
    for root in cgroup_roots():
        group = root / host.name
        group.mkdir(exist_ok=True)
        groups.append(group)

    def enter_cgroups() -> None:
        for group in groups:
            (group / "cgroup.procs").write_text(str(os.getpid()))

    cmd = ["systemd-nspawn", "--boot", "--register=no", "--keep-unit", "--console=passive",
           f"--machine={host.name}", f"--directory={host.dir / 'merged'}",
           f"--network-namespace-path=/run/netns/{host.name}", "--resolv-conf=off",
           "--timezone=off", "--link-journal=no"]
    if host.data != "none":
        flag = "--bind-ro" if host.data == "ro" else "--bind"
        cmd.append(f"{flag}={host.dir / 'data'}:/data")
    if host.venv:
        cmd.append(f"--bind={host.dir / 'venv'}:{host.venv}")
    logf = open(host.dir / "console.log", "wb")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                            preexec_fn=enter_cgroups, start_new_session=True)
    host.pid = proc.pid
    (host.dir / "host.json").write_text(json.dumps(asdict(host)))


def known_hosts_file() -> Path:
    """This lab's known_hosts: the running hosts' addresses with the host keys in their own root
    filesystems (read here, on the control node, so nothing is trusted on first use). Rewritten when
    the running hosts change; ssh then checks strictly, as on real nodes (ansible.cfg)."""
    path = STATE / f"{PREFIX}.known_hosts"
    lines = []
    for host in lab_hosts():
        for pub in sorted((host.dir / "merged" / "etc" / "ssh").glob("ssh_host_*_key.pub")):
            fields = pub.read_text().split()
            if len(fields) >= 2:
                lines.append(f"{host.address} {fields[0]} {fields[1]}\n")
    text = "".join(lines)
    try:
        if not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
    except OSError as exc:  # not root: ssh to the lab needs root's lab key anyway
        print(f"lab: cannot write {path}: {exc}", file=sys.stderr)
    return path


def ssh_options() -> list[str]:
    """SSH options for lab hosts (beside the lab key): host keys checked against known_hosts_file()."""
    return ["-o", f"UserKnownHostsFile={known_hosts_file()}", "-o", "StrictHostKeyChecking=yes",
            "-o", "LogLevel=ERROR"]


def ssh_base(host: Host) -> list[str]:
    return ["ssh", "-i", str(lab_key()), *ssh_options(), "-o", "ConnectTimeout=3", "-o", "BatchMode=yes",
            f"root@{host.address}"]


def wait_booted(host: Host, deadline: float) -> str:
    last = ""
    while time.monotonic() < deadline:
        if host.pid and not Path(f"/proc/{host.pid}").exists():
            tail = (host.dir / "console.log").read_text(errors="replace")[-1500:]
            raise LabError(f"{host.name}: systemd-nspawn exited during boot:\n{tail}")
        proc = run([*ssh_base(host), "systemctl is-system-running --wait"], check=False, timeout=60)
        state = proc.stdout.strip()
        if state == "running":
            return state
        if state == "degraded":
            failed = run([*ssh_base(host), "systemctl --failed --no-legend --plain"], check=False).stdout
            raise LabError(f"{host.name}: booted degraded; failed units:\n{failed}")
        last = (proc.stderr or state).strip()
        time.sleep(0.5)
    raise LabError(f"{host.name}: not running after {BOOT_TIMEOUT_S}s (last: {last}); "
                   f"see {host.dir / 'console.log'}")


def up(count: int, data_size: str, no_data: set[str], ro_data: set[str], start: int = 1,
       venv: Path | None = None) -> list[Host]:
    if os.geteuid() != 0:
        raise LabError("the lab needs root (namespaces, mounts, nspawn)")
    ensure_control_packages()
    rootfs = ensure_rootfs()
    if venv:
        venv = venv.resolve()
        venv_python(venv, rootfs)  # refused before any host is made
    pubkey = Path(str(lab_key()) + ".pub").read_text()
    for name in host_names_on_disk():
        log(f"removing leftover {name}")
        cleanup(name)
    hosts = []
    for i in range(start, start + count):
        name = f"{PREFIX}-{i}"
        mode = "none" if name in no_data else "ro" if name in ro_data else "rw"
        hosts.append(Host.make(i, mode, data_size, str(venv or "")))
    t0 = time.monotonic()
    for host in hosts:
        prepare(host, rootfs, pubkey)
        launch(host)
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    with concurrent.futures.ThreadPoolExecutor(len(hosts)) as pool:
        futures = {pool.submit(wait_booted, h, deadline): h for h in hosts}
        errors = [str(f.exception()) for f in futures if f.exception()]
    if errors:
        raise LabError("\n".join(errors))
    log(f"{count} host(s) running in {time.monotonic() - t0:.1f}s")
    return hosts


def down() -> None:
    for name in host_names_on_disk():
        cleanup(name)
        log(f"{name} removed")
    (STATE / f"{PREFIX}.known_hosts").unlink(missing_ok=True)


def lab_hosts() -> list[Host]:
    """Every host of this lab, running or powered off (a host with a record on disk)."""
    return [h for h in (load_host(n) for n in host_names_on_disk()) if h]


def is_running(host: Host) -> bool:
    return bool(host.pid) and Path(f"/proc/{host.pid}").exists()


def _named_host(name: str) -> Host:
    host = load_host(name)
    if not host:
        raise LabError(f"no lab host {name} (lab.py status lists them)")
    return host


def poweroff(name: str) -> None:
    """Cut the host's power (see the module's docstring); its disks stay for `boot`."""
    host = _named_host(name)
    for root in _safe_cgroup_roots():
        remove_cgroup(root / host.name)
    host.pid = 0
    (host.dir / "host.json").write_text(json.dumps(asdict(host)))
    run(["ip", "-n", host.name, "link", "set", "eth0", "down"], check=False)
    log(f"{name} powered off")


def boot(name: str) -> None:
    """Start a powered-off host from its disks and wait until systemd says it is running."""
    host = _named_host(name)
    if is_running(host):
        raise LabError(f"{name} is running already")
    for root in _safe_cgroup_roots():
        remove_cgroup(root / host.name)  # what a power cut left (normally nothing)
    run(["ip", "-n", host.name, "link", "set", "eth0", "up"])
    t0 = time.monotonic()
    launch(host)
    wait_booted(host, time.monotonic() + BOOT_TIMEOUT_S)
    log(f"{name} booted in {time.monotonic() - t0:.1f}s")


def inventory_data() -> dict:
    """The lab's hosts as Ansible's JSON inventory (what inventory/lab/lab_hosts.py prints); a
    powered-off host is listed (it is unreachable, as a dead node is)."""
    hosts = lab_hosts()
    return {
        "lab": {
            "hosts": [h.name for h in hosts],
            "vars": {
                "ansible_user": "root",
                "ansible_ssh_private_key_file": str(CACHE / "lab_key"),
                # Scoped to this group: host keys checked against the lab's own pinned file.
                "ansible_ssh_common_args": " ".join(ssh_options()),
                "ansible_python_interpreter": "/usr/bin/python3",
            },
        },
        # The plays act on this group (hsx_target's default): every lab host is an extraction node.
        "extraction_nodes": {"children": ["lab"]},
        # lab_venv: the venv the host sees at the control node's path (up --venv), "" none.
        "_meta": {"hostvars": {h.name: {"ansible_host": h.address, "lab_data_mode": h.data,
                                        "lab_data_size": h.data_size, "lab_venv": h.venv} for h in hosts}},
    }


def write_inventory(path: Path) -> None:
    """A static copy of the lab inventory, for tools that cannot run the dynamic one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(inventory_data(), indent=2) + "\n")


def status() -> int:
    names = host_names_on_disk()
    if not names:
        print("no lab hosts")
        return 0
    for name in names:
        host = load_host(name)
        alive = bool(host and is_running(host))
        state = "-"
        if alive:
            state = run([*ssh_base(host), "systemctl is-system-running"], check=False, timeout=15).stdout.strip()
        print(f"{name}\t{host.address if host else '?'}\tnspawn={'up' if alive else 'down'}\tsystem={state or '?'}"
              f"\tdata={host.data if host else '?'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="boot N hosts (removing any earlier lab first)")
    p_up.add_argument("count", type=int)
    p_up.add_argument("--data-size", default=os.environ.get("HSX_LAB_DATA_SIZE", "512M"))
    p_up.add_argument("--no-data", nargs="*", default=[], metavar="NAME", help="hosts without a /data mount")
    p_up.add_argument("--ro-data", nargs="*", default=[], metavar="NAME", help="hosts with /data read-only")
    p_up.add_argument("--venv", type=Path, help="a venv every host sees at the same path (its writes its own)")
    sub.add_parser("down", help="remove every lab host")
    sub.add_parser("status", help="list lab hosts")
    p_inv = sub.add_parser("inventory", help="print (or write) the Ansible inventory of running hosts as JSON")
    p_inv.add_argument("--out", type=Path)
    sub.add_parser("ensure", help="install what the lab needs and build the rootfs")
    p_ssh = sub.add_parser("ssh", help="run a command on a host")
    p_ssh.add_argument("name")
    p_ssh.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("poweroff", help="cut a host's power (its disks stay)").add_argument("name")
    sub.add_parser("boot", help="start a powered-off host from its disks").add_argument("name")
    sub.add_parser("cpu-log", help="print the file the hosts' CPU seconds are appended to as they go")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "up":
            up(args.count, args.data_size, set(args.no_data), set(args.ro_data), venv=args.venv)
        elif args.cmd == "down":
            down()
        elif args.cmd == "status":
            return status()
        elif args.cmd == "inventory":
            if args.out:
                write_inventory(args.out)
            else:
                print(json.dumps(inventory_data(), indent=2))
        elif args.cmd == "ensure":
            ensure_control_packages()
            print(ensure_rootfs())
        elif args.cmd == "poweroff":
            poweroff(args.name)
        elif args.cmd == "boot":
            boot(args.name)
        elif args.cmd == "cpu-log":
            print(CPU_LOG)
        elif args.cmd == "ssh":
            host = _named_host(args.name)
            return subprocess.call([*ssh_base(host), " ".join(args.command)])
    except LabError as exc:
        log(f"error: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
