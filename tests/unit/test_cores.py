"""usable_cores: affinity capped by a CFS quota, read from fake cgroup trees (v1 and v2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from extraction.shards import format as fmt


def _tree(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[str, str]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (tmp_path / "proc_cgroup").write_text(proc)
    return str(tmp_path / "proc_cgroup"), str(root)


@pytest.mark.parametrize(
    ("proc", "files", "want"),
    [
        ("0::/job\n", {"job/cpu.max": "max 100000\n"}, None),
        ("0::/job\n", {"job/cpu.max": "250000 100000\n"}, 2.5),
        # the parent's limit is the tighter one
        ("0::/a/b\n", {"a/cpu.max": "100000 100000\n", "a/b/cpu.max": "400000 100000\n"}, 1.0),
        # a container: its /proc path is the host's view, the mount is its own cgroup
        ("0::/kubepods/pod1/c1\n", {"cpu.max": "150000 100000\n"}, 1.5),
        (
            "4:cpu,cpuacct:/docker/x\n",
            {
                "cpu,cpuacct/docker/x/cpu.cfs_quota_us": "300000\n",
                "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000\n",
            },
            3.0,
        ),
        (
            "4:cpu,cpuacct:/docker/x\n",
            {
                "cpu,cpuacct/docker/x/cpu.cfs_quota_us": "-1\n",
                "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000\n",
            },
            None,
        ),
        ("0::/\n", {}, None),
        ("garbage\n", {"cpu.max": "nonsense\n"}, None),
    ],
)
def test_cgroup_cpu_limit(tmp_path, proc, files, want) -> None:
    assert fmt.cgroup_cpu_limit(*_tree(tmp_path, proc, files)) == want


def test_no_cgroup_file_means_no_limit(tmp_path) -> None:
    assert fmt.cgroup_cpu_limit(str(tmp_path / "absent"), str(tmp_path)) is None


@pytest.mark.parametrize(("limit", "want"), [(None, 16), (2.5, 3), (2.0, 2), (0.2, 1), (64.0, 16)])
def test_usable_cores_is_the_affinity_capped_by_the_quota(monkeypatch, limit, want) -> None:
    monkeypatch.setattr(fmt.os, "sched_getaffinity", lambda _pid: set(range(16)))
    monkeypatch.setattr(fmt, "cgroup_cpu_limit", lambda: limit)
    assert fmt.usable_cores() == want
