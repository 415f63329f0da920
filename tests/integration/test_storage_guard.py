"""roles/storage_guard on real lab hosts: good, read-only, unmounted and too-small /data."""

from __future__ import annotations

import pytest
from labctl import host, lab, lab_push, lab_ssh, playbook

from hsx.index import encode_index_line
from hsx.layout import INDEX_NAME
from hsx.status import now_iso, write_json_atomic


@pytest.fixture
def three_hosts():
    """host 1 good, 2 /data read-only, 3 no /data mount."""
    lab("up", "3", "--data-size", "512M", "--ro-data", host(2), "--no-data", host(3))
    yield
    lab("down", check=False)


def plant_half_done_run(tmp_path, host: str, done: int, total: int, shard_bytes: int) -> None:
    out = tmp_path / host
    out.mkdir()
    (out / "run.json").write_text("{}")
    with open(out / INDEX_NAME, "wb") as f:
        for i in range(done):
            f.write(encode_index_line({"id": f"s{i}", "path": f"shards/00/s{i}.pt", "size": shard_bytes,
                                       "checksum": "crc32:00000000", "num_tokens": 100}))
    write_json_atomic(str(out / "status.json"), {"state": "failed", "done": done, "total": total,
                                                  "updated_at": now_iso(), "pid": 1, "host": "gone"})
    lab_push(host, out, "/data/hsx/output")


def test_storage_guard_reports_each_broken_mount_with_what_to_do(three_hosts, tmp_path):
    plant_half_done_run(tmp_path, host(1), done=10, total=100, shard_bytes=1024 * 1024)  # needs ~90 MiB
    run = playbook("tests/plays/storage_guard.yml")
    recap = run.recap()
    assert run.rc == 2, run.output[-3000:]
    assert recap[host(1)]["failed"] == 0, run.output[-3000:]
    assert recap[host(2)]["failed"] == 1 and "mounted read-only" in run.output
    assert recap[host(3)]["failed"] == 1 and f"/data is not mounted on {host(3)}" in run.output


def test_too_small_data_fails_with_the_numbers_and_changes_nothing(three_hosts, tmp_path):
    plant_half_done_run(tmp_path, host(1), done=10, total=1010, shard_bytes=1024 * 1024)  # 1000 x 1 MiB
    before = lab_ssh(host(1), "find /data -printf '%p %s\\n' | sort").stdout
    run = playbook("tests/plays/storage_guard.yml", "--limit", host(1))
    assert run.rc == 2
    assert "1000 remaining samples at ~1.00 MB each" in " ".join(run.output.split()), run.output[-2000:]
    assert "Free space, grow the disk" in " ".join(run.output.split())
    assert lab_ssh(host(1), "find /data -printf '%p %s\\n' | sort").stdout == before
