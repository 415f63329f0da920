"""usable_cores: affinity capped by a CFS quota, read from fake cgroup trees (v1, v2, hybrid)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import hsx.cores
from hsx.cores import cgroup_cpu_limit

V2 = "41 31 0:38 {root} {point} rw,relatime - cgroup2 cgroup2 rw\n"
V1_CPU = "32 31 0:29 {root} {point} rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
V1_OTHER = "35 31 0:32 / {point} rw,relatime - cgroup cgroup rw,memory\n"


def _tree(
    tmp_path: Path, proc: str, mounts: list[tuple[str, str, str]], files: dict[str, str]
) -> tuple[str, str]:
    """mounts: (line template, hierarchy root, mount point under tmp_path); files under tmp_path."""
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "mountinfo").write_text(
        "".join(t.format(root=r, point=tmp_path / p) for t, r, p in mounts)
        + f"23 1 8:1 / {tmp_path} rw - ext4 /dev/sda1 rw\n"
    )
    (tmp_path / "proc_cgroup").write_text(proc)
    return str(tmp_path / "proc_cgroup"), str(tmp_path / "mountinfo")


CASES = {
    "v2 unlimited": ("0::/job\n", [(V2, "/", "cg")], {"cg/job/cpu.max": "max 100000\n"}, None),
    "v2 quota": ("0::/job\n", [(V2, "/", "cg")], {"cg/job/cpu.max": "250000 100000\n"}, 2.5),
    "v2 parent tighter": (
        "0::/a/b\n",
        [(V2, "/", "cg")],
        {"cg/a/cpu.max": "100000 100000\n", "cg/a/b/cpu.max": "400000 100000\n"},
        1.0,
    ),
    # a container: /proc shows the host's path, its mount shows its own cgroup as the root
    "v2 container": ("0::/kubepods/pod1/c1\n", [(V2, "/", "cg")], {"cg/cpu.max": "150000 100000\n"}, 1.5),
    # the mount's root names the cgroup it exposes: the path below it is what is under the mount
    "v2 mount root": (
        "0::/kubepods/pod1/c1/sub\n",
        [(V2, "/kubepods/pod1/c1", "cg")],
        {"cg/sub/cpu.max": "100000 100000\n", "cg/cpu.max": "200000 100000\n"},
        1.0,
    ),
    "v1 quota": (
        "4:cpu,cpuacct:/docker/x\n5:memory:/docker/x\n",
        [(V1_CPU, "/", "cgcpu"), (V1_OTHER, "/", "cgmem")],
        {"cgcpu/docker/x/cpu.cfs_quota_us": "300000\n", "cgcpu/docker/x/cpu.cfs_period_us": "100000\n"},
        3.0,
    ),
    "v1 unlimited": (
        "4:cpu,cpuacct:/docker/x\n",
        [(V1_CPU, "/", "cgcpu")],
        {"cgcpu/docker/x/cpu.cfs_quota_us": "-1\n", "cgcpu/docker/x/cpu.cfs_period_us": "100000\n"},
        None,
    ),
    # hybrid: v1 controllers mounted, the cpu controller on the unified tree elsewhere
    "hybrid": (
        "5:memory:/u\n0::/u\n",
        [(V1_OTHER, "/", "cgmem"), (V2, "/", "unified")],
        {"unified/u/cpu.max": "50000 100000\n"},
        0.5,
    ),
    "no mounts": ("0::/job\n", [], {"cg/job/cpu.max": "100000 100000\n"}, None),
    "garbage": ("garbage\n", [(V2, "/", "cg")], {"cg/cpu.max": "nonsense\n"}, None),
}


@pytest.mark.parametrize("case", CASES)
def test_cgroup_cpu_limit(tmp_path, case) -> None:
    proc, mounts, files, want = CASES[case]
    assert cgroup_cpu_limit(*_tree(tmp_path, proc, mounts, files)) == want


def test_no_cgroup_file_means_no_limit(tmp_path) -> None:
    assert cgroup_cpu_limit(str(tmp_path / "absent"), str(tmp_path / "absent")) is None


@pytest.mark.parametrize(("limit", "want"), [(None, 16), (2.5, 3), (2.0, 2), (0.2, 1), (64.0, 16)])
def test_usable_cores_is_the_affinity_capped_by_the_quota(monkeypatch, limit, want) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    monkeypatch.setattr(hsx.cores, "cgroup_cpu_limit", lambda: limit)
    assert hsx.cores.usable_cores() == want
