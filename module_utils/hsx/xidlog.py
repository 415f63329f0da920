# Copyright: (c) 2026, hsx maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The NVIDIA driver's XID reports, from records only the kernel can write, remembered for the boot.

Contract:

- `kernel_records(path)` reads the kernel log's records from /dev/kmsg (without blocking, without
  following a link) as `Record`s: the syslog facility and level of its header, its sequence number,
  and its text as the kernel escaped it (a newline inside a message is ``\\x0a``, so one record can
  never pose as two). None where it cannot be opened (not root, a container). `journal_records()`
  reads this boot's kernel records that journald kept (``journalctl -k -b``), None where there is no
  journalctl or it fails: they outlive the ring buffer.
- `match_xids(records, buses)` keeps only the driver's own reports: facility 0 (kernel; a write to
  /dev/kmsg from user space is given facility 1 or higher by the kernel, and journald's
  ``_TRANSPORT=kernel`` is a trusted field), the text *starting* with ``NVRM: Xid (PCI:<address>): N``
  (the driver's prefix: text a user gets the kernel to log, such as a rejected mount option, always
  follows the logging code's own prefix), and an address among `buses`, the GPUs this node has.
  Everything else that mentions an XID is counted in `XidScan.ignored`, never trusted.
- `load_seen(dir, boot)` / `save_seen(dir, boot, xids)` keep the XIDs seen in this boot (keyed by
  /proc/sys/kernel/random/boot_id) in ``<dir>/xids.json``, so an XID pushed out of the ring buffer
  (by a flood of messages) still counts once the gate saw it. The directory must be a real
  directory of this user (root) that nobody else may write; the file a regular file of this user,
  read and replaced without following a link (temp + rename). A record that is not the gate's raises
  `XidRecordError` naming the file and what is wrong; it is never overwritten.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import subprocess
from dataclasses import asdict, dataclass

from .fsutil import DIR_FLAGS, O_NOFOLLOW, atomic_write_bytes, open_nofollow

RECORD_NAME = "xids.json"
MAX_RECORD_BYTES = 1 << 20
MAX_LINE = 512  # characters of a report kept (the driver's lines are ~150)
_XID = re.compile(
    r"NVRM: Xid \(PCI:([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})(?:\.[0-7])?(?: [^)]*)?\): (\d{1,4})\b"
)
_BUS = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}")


class XidRecordError(Exception):
    """The XID record is there but is not one the gate wrote (str(): the file and why)."""


@dataclass(frozen=True)
class Record:
    """One kernel log record: facility 0 is the kernel's own."""

    facility: int
    level: int
    seq: int
    text: str


@dataclass(frozen=True)
class Xid:
    pci_bus_id: str
    xid: int
    line: str


@dataclass
class XidScan:
    """The driver's XIDs among some records, and how many records only posed as one."""

    xids: list[Xid]
    ignored: int


def bus(value: str) -> str:
    """A PCI address in one form: domain 0000, lower case, no function (NVML says 00000000:18:00.0,
    the driver's XID 0000:18:00, /proc/driver/nvidia/gpus 0000:18:00.0)."""
    parts = value.lower().split(":")
    if len(parts) == 3:
        parts[0] = parts[0][-4:].rjust(4, "0")
    return ":".join(parts).split(".", maxsplit=1)[0]


def parse_kmsg(chunk: bytes) -> list[Record]:
    """The records of /dev/kmsg output: ``PRI,SEQ,USEC,FLAGS[,...];TEXT`` lines, each maybe followed
    by dictionary lines that start with a space (skipped). A line without a valid header is skipped."""
    out = []
    for line in chunk.decode("utf-8", "replace").split("\n"):
        head, sep, text = line.partition(";")
        fields = head.split(",")
        if not sep or line.startswith(" ") or len(fields) < 3 or not fields[0].isdigit() or not fields[1].isdigit():
            continue
        pri = int(fields[0])
        out.append(Record(pri >> 3, pri & 7, int(fields[1]), text))
    return out


def kernel_records(path: str = "/dev/kmsg", max_records: int = 500_000) -> list[Record] | None:
    """The ring buffer's records since boot (as many as it still holds), None where `path` cannot be
    opened. /dev/kmsg gives one record a read, EAGAIN at the end and EPIPE for a record overwritten
    while reading (skipped); a regular file (a saved log, the tests) is read whole."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    records: list[Record] = []
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):  # a saved log (tests): records split only at line ends
            with open(os.dup(fd), "rb") as f:
                return parse_kmsg(f.read(64 << 20))[:max_records]
        while len(records) < max_records:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError as e:
                if e.errno == errno.EPIPE:  # overwritten while we read; the next read goes on
                    continue
                break  # EAGAIN: the end; anything else: stop with what was read
            if not chunk:
                break
            records += parse_kmsg(chunk)
    finally:
        os.close(fd)
    return records


def journal_records(journalctl: str | None, timeout: float = 60.0) -> list[Record] | None:
    """This boot's kernel records kept by journald that mention an XID (``journalctl -k -b 0``,
    filtered by journalctl's --grep where it has it, else all of them), or None: no journalctl, no
    kernel record of this boot in the journal (journald not running, a container), or journalctl
    failed or timed out. Only entries of ``_TRANSPORT=kernel`` (a field journald sets itself) are
    taken, with their SYSLOG_FACILITY (1 and up for text written to /dev/kmsg from user space)."""
    if not journalctl:
        return None
    base = [journalctl, "-k", "-b", "0", "-o", "json", "--no-pager"]
    fields = "--output-fields=MESSAGE,SYSLOG_FACILITY,PRIORITY,_TRANSPORT"

    def run(*extra: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(base + list(extra), capture_output=True, timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None

    probe = run("-n", "1")  # does the journal hold this boot's kernel log at all?
    if probe is None or probe.returncode != 0 or not probe.stdout.strip():
        return None
    found = run(fields, "--grep=NVRM: Xid")
    if found is not None and found.returncode != 0 and not found.stdout.strip():
        found = run(fields)  # no pattern matching in this journalctl (or no match): read them all
    if found is None or found.returncode != 0:
        return None
    out = []
    for n, line in enumerate(found.stdout.splitlines()):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        msg = entry.get("MESSAGE")
        if isinstance(msg, list):  # journalctl's form of a field that is not printable UTF-8
            msg = bytes(b & 0xFF for b in msg if isinstance(b, int)).decode("utf-8", "replace")
        facility, priority = str(entry.get("SYSLOG_FACILITY", "")), str(entry.get("PRIORITY", "6"))
        if entry.get("_TRANSPORT") != "kernel" or not isinstance(msg, str) or not facility.isdigit():
            continue
        out.append(Record(int(facility), int(priority) if priority.isdigit() else 6, n, msg))
    return out


def match_xids(records: list[Record], buses: set[str]) -> XidScan:
    """The driver's own XID reports among `records` (see the module's contract); `buses` are the
    node's GPUs' PCI addresses in any form `bus()` reads."""
    known = {bus(b) for b in buses}
    xids: list[Xid] = []
    ignored = 0
    for r in records:
        m = _XID.match(r.text)
        if m and r.facility == 0 and bus(m.group(1)) in known:
            xids.append(Xid(bus(m.group(1)), int(m.group(2)), r.text.strip()[:MAX_LINE]))
        elif "Xid" in r.text:
            ignored += 1
    return XidScan(xids, ignored)


def boot_id(path: str = "/proc/sys/kernel/random/boot_id") -> str | None:
    """This boot's id (a new one at every boot), or None where it cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            value = f.read(64).strip()
    except (OSError, UnicodeDecodeError):
        return None
    return value if re.fullmatch(r"[0-9a-f-]{32,36}", value) else None


def _open_dir(directory: str, create: bool) -> int:
    """`directory` as an fd: a real directory (not a link) of this user that no one else may write;
    made 0700 when absent and `create`. XidRecordError for anything else there; OSError when it
    cannot be made or opened."""
    if create:
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass
    try:
        fd = os.open(directory, DIR_FLAGS | O_NOFOLLOW)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise XidRecordError(f"{directory} is not a directory (a link or a file): refusing to use it") from None
        raise
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise XidRecordError(f"{directory} is owned by uid {st.st_uid} or writable by others "
                             f"(mode {stat.S_IMODE(st.st_mode):04o}): refusing to keep XIDs there")
    return fd


def load_seen(directory: str, boot: str) -> list[Xid]:
    """The XIDs recorded in this boot ([] with no record, or one of an earlier boot)."""
    path = os.path.join(directory, RECORD_NAME)
    try:
        dfd = _open_dir(directory, create=False)
    except FileNotFoundError:
        return []
    try:
        try:
            fd = open_nofollow(RECORD_NAME, os.O_RDONLY, dir_fd=dfd, path=path)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise XidRecordError(f"{path}: {e}") from None
        with open(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                raise XidRecordError(f"{path} is owned by uid {st.st_uid} or writable by others: not the gate's")
            data = f.read(MAX_RECORD_BYTES + 1)
    finally:
        os.close(dfd)
    return _parse_record(path, data, boot)


def _parse_record(path: str, data: bytes, boot: str) -> list[Xid]:
    if len(data) > MAX_RECORD_BYTES:
        raise XidRecordError(f"{path} is larger than {MAX_RECORD_BYTES} bytes: not the gate's")
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise XidRecordError(f"{path} is not JSON ({e})") from None
    if not (isinstance(doc, dict) and doc.get("version") == 1 and isinstance(doc.get("boot_id"), str)
            and isinstance(doc.get("xids"), list)):
        raise XidRecordError(f"{path} is not an XID record of the gate (version 1, boot_id, xids)")
    if doc["boot_id"] != boot:
        return []  # an earlier boot's: its XIDs were cleared by the reboot
    out = []
    for i, x in enumerate(doc["xids"]):
        number = x.get("xid") if isinstance(x, dict) else None
        if not (isinstance(x, dict) and isinstance(x.get("pci_bus_id"), str) and _BUS.fullmatch(x["pci_bus_id"])
                and isinstance(number, int) and not isinstance(number, bool) and 0 <= number < 10000
                and isinstance(x.get("line"), str)):
            raise XidRecordError(f"{path}: xids[{i}] is not {{pci_bus_id, xid, line}}: {str(x)[:120]}")
        out.append(Xid(x["pci_bus_id"], x["xid"], x["line"][:MAX_LINE]))
    return out


def unique(xids: list[Xid]) -> list[Xid]:
    """One report per (GPU, XID), the first seen: what the gate needs, and a bound on the record."""
    seen: dict[tuple[str, int], Xid] = {}
    for x in xids:
        seen.setdefault((x.pci_bus_id, x.xid), x)
    return list(seen.values())


def save_seen(directory: str, boot: str, xids: list[Xid]) -> None:
    """Replace the record with `xids` for this boot (temp + rename in the directory opened without
    following a link; the directory made 0700 when absent)."""
    data = json.dumps({"version": 1, "boot_id": boot, "xids": [asdict(x) for x in unique(xids)]},
                      indent=1).encode() + b"\n"
    dfd = _open_dir(directory, create=True)
    try:
        atomic_write_bytes(RECORD_NAME, data, dir_fd=dfd)
    finally:
        os.close(dfd)
