"""The GPU health gate's XID check against forged records and floods (issue #51, the high defect).

Before the fix, "NVRM: Xid" text anywhere in any kernel-log record counted: an unprivileged user can
get such text logged (a rejected tmpfs mount option in a user namespace is logged verbatim, at the
kernel's own facility), failing a healthy node, and flooding the ring buffer the same way pushed a
real XID out of it, passing a bad GPU. Only the driver's own records count now (the kernel's
facility, the driver's prefix at the start, a PCI address of a GPU of this node), and the XIDs seen
are recorded for the boot. The records are those of /dev/kmsg (header `PRI,SEQ,USEC,FLAGS;`); the
journal is tests/fakes/journal/journalctl (no journald here).
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest
from test_gpu_health import HEALTHY, module, run_module

from hsx import xidlog

FAKE_JOURNAL = Path(__file__).resolve().parents[1] / "fakes" / "journal" / "journalctl"
XID79 = "NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
REAL = f"4,901,7002345,c;{XID79}"  # the driver's record: facility 0, its prefix first, GPU 0's address
BUSES = {"0000:18:00.0", "0000:2a:00.0"}
FORGED = {
    # what the kernel logs for `mount -t tmpfs -o 'NVRM: Xid (PCI:0000:18:00): 79' ...` by an unprivileged
    # user in a user namespace (recorded on this machine: facility 0, level 3)
    "mid-message": "3,343,691840066,-;tmpfs: Unknown parameter 'NVRM: Xid (PCI:0000:18:00): 79'",
    # written to /dev/kmsg from user space: the kernel gives it facility 1 (LOG_USER) or more
    "user facility": f"12,344,691840100,-;{XID79}",
    "daemon facility": f"27,345,691840200,-;{XID79}",
    # a newline in the text cannot start a record: /dev/kmsg escapes it
    "escaped newline": "3,346,691840300,-;tmpfs: Unknown parameter 'x\\x0aNVRM: Xid (PCI:0000:18:00): 79'",
    # the driver's prefix, but for no GPU of this node
    "no such GPU": "4,347,691840400,c;NVRM: Xid (PCI:0000:99:00): 79, GPU has fallen off the bus.",
}


def scan(*lines: str, buses=BUSES) -> xidlog.XidScan:
    return xidlog.match_xids(xidlog.parse_kmsg("\n".join(lines).encode()), buses)


@pytest.mark.parametrize("kind", FORGED)
def test_a_forged_xid_record_is_ignored_and_counted(kind):
    got = scan(FORGED[kind])
    assert got.xids == [] and got.ignored == 1


def test_the_drivers_own_record_counts_with_or_without_a_function_or_an_sm_location():
    assert scan(REAL).xids == [xidlog.Xid("0000:18:00", 79, XID79)]
    assert [x.xid for x in scan("4,1,2,c;NVRM: Xid (PCI:0000:18:00.0): 48, DBE").xids] == [48]
    assert [x.xid for x in scan("4,1,2,c;NVRM: Xid (PCI:0000:2a:00 GPC0 TPC1): 13, Graphics SM Warp").xids] == [13]


def test_a_gpu_known_only_to_the_driver_still_counts(tmp_path):
    """A GPU that fell off the bus may be gone from NVML; the driver still lists it."""
    root = tmp_path / "root"
    (root / "proc/driver/nvidia/gpus/0000:3b:00.0").mkdir(parents=True)
    (root / "sys/bus/pci/drivers/nvidia").mkdir(parents=True)
    (root / "sys/bus/pci/drivers/nvidia/0000:5d:00.0").symlink_to(tmp_path)
    (root / "sys/bus/pci/drivers/nvidia/new_id").write_text("")
    from hsx.nvml import driver_gpu_buses

    buses = driver_gpu_buses(str(root))
    assert buses == {"0000:3b:00.0", "0000:5d:00.0"}
    assert [x.pci_bus_id for x in scan("4,1,2,c;NVRM: Xid (PCI:0000:3b:00): 79, off the bus", buses=buses).xids] == [
        "0000:3b:00"]


def test_the_module_passes_a_healthy_node_whose_log_holds_forged_xids_and_says_so(capsys, monkeypatch, tmp_path):
    out = run_module(capsys, monkeypatch, tmp_path, HEALTHY, list(FORGED.values()))
    assert out["passed"] and not out.get("failed") and out["xids"] == [] and out["xids_ignored"] == len(FORGED)
    assert f"{len(FORGED)} kernel log records mention an XID but are not the NVIDIA driver's own" in out["msg"]
    out = run_module(capsys, monkeypatch, tmp_path, HEALTHY, [*FORGED.values(), REAL])
    assert out["failed"] and "GPU 0: XID 79 since boot" in out["msg"]


def gate(capsys, monkeypatch, tmp_path, log, boot="0b1d8c2e-4f6a-4c5b-9d3e-2a1b0c9d8e7f", **args) -> dict:
    monkeypatch.setattr(module.gpu_health, "boot_id", lambda: boot)
    return run_module(capsys, monkeypatch, tmp_path, HEALTHY, log,
                      **{"xid_record_dir": str(tmp_path / "record"), **args})


FLOOD = [f"3,{1000 + i},{9000000 + i},-;tmpfs: Unknown parameter 'flood {i}'" for i in range(50)]


def test_an_xid_flooded_out_of_the_ring_buffer_still_fails_the_gate(capsys, monkeypatch, tmp_path):
    first = gate(capsys, monkeypatch, tmp_path, [REAL])
    assert first["failed"] and first["changed"] is True and first["xid_sources"] == ["kmsg"]
    record = json.loads((tmp_path / "record" / "xids.json").read_text())
    assert record["boot_id"].startswith("0b1d8c2e") and record["xids"] == [
        {"pci_bus_id": "0000:18:00", "xid": 79, "line": XID79}]
    assert (tmp_path / "record").stat().st_mode & 0o777 == 0o700
    # the flood pushed the record out of the ring buffer: the gate still fails, from its record
    later = gate(capsys, monkeypatch, tmp_path, FLOOD)
    assert later["failed"] and "GPU 0: XID 79 since boot" in later["msg"], later["msg"]
    assert later["xid_sources"] == ["kmsg", "record"] and later["changed"] is False
    assert any("no longer holds its first 1000 records of this boot" in f["message"] for f in later["findings"])
    # a reboot (a new boot id) clears it
    rebooted = gate(capsys, monkeypatch, tmp_path, FLOOD[:1], boot="9f8e7d6c-5b4a-4392-8170-6f5e4d3c2b1a")
    assert rebooted["passed"] and not rebooted.get("failed")


def test_check_mode_reads_the_record_but_writes_none(capsys, monkeypatch, tmp_path):
    out = gate(capsys, monkeypatch, tmp_path, [REAL], _ansible_check_mode=True)
    assert out["failed"] and out["changed"] is False and not (tmp_path / "record").exists()


def test_a_record_that_is_not_the_gates_fails_closed_and_is_left_as_it_is(capsys, monkeypatch, tmp_path):
    rec = tmp_path / "record"
    rec.mkdir(mode=0o700)
    (rec / "xids.json").write_text("{not json")
    out = gate(capsys, monkeypatch, tmp_path, [REAL])
    assert out["failed"] and "the XID record cannot be trusted" in out["msg"] and str(rec / "xids.json") in out["msg"]
    assert (rec / "xids.json").read_text() == "{not json"  # nothing lost, nothing overwritten
    (rec / "xids.json").write_text(json.dumps({"version": 1, "boot_id": "0b1d8c2e-4f6a-4c5b-9d3e-2a1b0c9d8e7f",
                                               "xids": [{"pci_bus_id": "../../x", "xid": 79, "line": ""}]}))
    assert "xids[0] is not" in gate(capsys, monkeypatch, tmp_path, [])["msg"]


def test_the_record_is_never_followed_through_a_link_nor_kept_where_others_may_write(capsys, monkeypatch, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "record").symlink_to(elsewhere)
    out = gate(capsys, monkeypatch, tmp_path, [REAL])
    assert out["failed"] and "is not a directory (a link or a file)" in out["msg"]
    assert list(elsewhere.iterdir()) == []
    (tmp_path / "record").unlink()
    (tmp_path / "record").mkdir()
    os.chmod(tmp_path / "record", 0o777)
    out = gate(capsys, monkeypatch, tmp_path, [])
    assert out["failed"] and "writable by others (mode 0777)" in out["msg"]
    os.chmod(tmp_path / "record", 0o700)
    (tmp_path / "record" / "xids.json").symlink_to(tmp_path / "elsewhere" / "planted.json")
    out = gate(capsys, monkeypatch, tmp_path, [REAL])
    assert out["failed"] and "refusing to" in out["msg"] and not (elsewhere / "planted.json").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_record_owned_by_another_user_is_not_trusted(capsys, monkeypatch, tmp_path):
    gate(capsys, monkeypatch, tmp_path, [REAL])
    os.chown(tmp_path / "record" / "xids.json", 65534, 65534)
    out = gate(capsys, monkeypatch, tmp_path, [])
    assert out["failed"] and "owned by uid 65534" in out["msg"]


def journal(tmp_path, monkeypatch, *entries: dict, grep: bool = True) -> None:
    path = tmp_path / "journal.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    monkeypatch.setenv("HSX_FAKE_JOURNAL", str(path))
    monkeypatch.setenv("HSX_FAKE_JOURNAL_LOG", str(tmp_path / "journal.calls"))
    if not grep:
        monkeypatch.setenv("HSX_FAKE_JOURNAL_NO_GREP", "1")
    monkeypatch.setattr(module.AnsibleModule, "get_bin_path",
                        lambda self, name, *a, **k: str(FAKE_JOURNAL) if name == "journalctl" else None)


def entry(message, facility="0", transport="kernel") -> dict:
    return {"MESSAGE": message, "SYSLOG_FACILITY": facility, "PRIORITY": "4", "_TRANSPORT": transport}


@pytest.mark.parametrize("grep", [True, False], ids=["grep", "no-grep"])
def test_the_journal_keeps_what_the_ring_buffer_lost_and_only_its_kernel_records_count(
        capsys, monkeypatch, tmp_path, grep):
    journal(tmp_path, monkeypatch, entry("Linux version 6.18.44"), entry(XID79.replace("79", "48", 1), "1"),
            entry(XID79.replace("79", "94", 1), "0", "syslog"),
            entry([ord(c) for c in XID79.replace("79", "95", 1)]), entry(XID79), grep=grep)
    out = run_module(capsys, monkeypatch, tmp_path, HEALTHY, FLOOD, journal=True)
    assert out["failed"] and out["xid_sources"] == ["kmsg", "journal"]
    assert [x["xid"] for x in out["xids"]] == [95, 79] and out["xids_ignored"] == 1  # 94's transport: not counted
    assert "no longer holds its first" not in out["msg"]  # the journal holds the boot's records
    calls = (tmp_path / "journal.calls").read_text().splitlines()
    assert all(c.startswith("-k -b 0 -o json") for c in calls) and ("--grep=NVRM: Xid" in calls[1]) is True
    assert len(calls) == (2 if grep else 3)


def test_no_journal_of_this_boot_is_no_source(capsys, monkeypatch, tmp_path):
    journal(tmp_path, monkeypatch)
    out = run_module(capsys, monkeypatch, tmp_path, HEALTHY, FLOOD, journal=True)
    assert out["passed"] and out["xid_sources"] == ["kmsg"] and "no longer holds its first 1000" in out["msg"]


def _unprivileged_tmpfs_mount(option: str) -> bool:
    run = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "unshare", "-Urm",
                          "mount", "-t", "tmpfs", "-o", option, "none", "/mnt"], capture_output=True, timeout=30)
    return run.returncode != 0 and b"wrong fs type, bad option" in run.stderr


def test_on_this_kernel_an_unprivileged_user_logs_xid_text_and_the_gate_ignores_it():
    """The real attack of the issue on this machine's kernel: the user `nobody` has the kernel log
    NVRM text at the kernel's facility (a rejected mount option), and root's write of the driver's
    exact line to /dev/kmsg gets the user facility; neither counts as an XID of GPU 0000:18:00."""
    mark = uuid.uuid4().hex[:12]
    ring = xidlog.kernel_records()
    if ring is None or not os.access("/dev/kmsg", os.W_OK):
        pytest.skip("/dev/kmsg not readable and writable here")
    if not _unprivileged_tmpfs_mount(f"NVRM: Xid (PCI:0000:18:00): 79 hsx-test-forged-{mark}"):
        pytest.skip("no unprivileged user namespace with mount here")
    with open("/dev/kmsg", "w") as f:
        f.write(f"<3>NVRM: Xid (PCI:0000:18:00): 79, hsx-test-forged-{mark}\n")
    ours = [r for r in xidlog.kernel_records() if mark in r.text]
    assert [(r.facility, r.text.split(":", 1)[0]) for r in ours] == [(0, "tmpfs"), (1, "NVRM")], ours
    got = xidlog.match_xids(ours, BUSES)
    assert got.xids == [] and got.ignored == 2
