"""How many cores this process may really use, and how many verification workers that makes."""

from __future__ import annotations

import math
import os
from collections.abc import Callable


def usable_cores() -> int:
    """Cores this process may use: its affinity (taskset, a cpuset), capped by a CFS quota (a
    container's --cpus, a k8s CPU limit, systemd's CPUQuota=) rounded up; not the host's count.

    A quota leaves every core visible and lets the process run only so many core-seconds a
    period: threads sized by the affinity alone then queue for the quota and stall each other."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return cores if limit is None else max(1, min(cores, math.ceil(limit - 1e-9)))


def cgroup_cpu_limit(
    proc_cgroup: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo"
) -> float | None:
    """CPUs' worth a CFS quota allows this process (the tightest of its cgroup and the cgroups
    above it: v2 `cpu.max`, v1 `cpu.cfs_quota_us`), or None where none is set or readable. The
    hierarchies are found where they are mounted (v2 alone, v1 alone, or both on a hybrid host)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    v2_mounts, v1_mounts = _cgroup_mounts(mountinfo)
    limits: list[float] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _hier_id, controllers, path = parts
        if controllers == "":  # v2, unified: "max 100000" or "150000 100000"
            for mount_root, mount_point in v2_mounts:
                limits += _quota_walk(mount_point, _below(path, mount_root), _v2_limit)
        elif "cpu" in controllers.split(","):
            for mount_root, mount_point in v1_mounts:
                limits += _quota_walk(mount_point, _below(path, mount_root), _v1_limit)
    return min(limits) if limits else None


def _cgroup_mounts(mountinfo: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(root within the hierarchy, mount point) of the cgroup2 mounts and of the v1 mounts with
    the cpu controller, from mountinfo ("... root mountpoint opts ... - fstype source superopts")."""
    v2: list[tuple[str, str]] = []
    v1: list[tuple[str, str]] = []
    try:
        with open(mountinfo) as f:
            rows = f.read().splitlines()
    except OSError:
        return v2, v1
    for row in rows:
        head, sep, tail = row.partition(" - ")
        fields, more = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(more) < 3:
            continue
        root, point = fields[3], fields[4].replace("\\040", " ")
        if more[0] == "cgroup2":
            v2.append((root, point))
        elif more[0] == "cgroup" and "cpu" in more[2].split(","):
            v1.append((root, point))
    return v2, v1


def _below(path: str, mount_root: str) -> str:
    """The cgroup's folder under a mount of the hierarchy from `mount_root` on (a container's
    mount shows its own cgroup as the root: its /proc path is the host's view)."""
    root = mount_root.rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root) :]
    return path


def _quota_walk(mount: str, path: str, read: Callable[[str], float | None]) -> list[float]:
    """The limits set on `path`'s cgroup and its parents under `mount` (a path absent there, a
    host's view seen from a container, ends at the mount all the same)."""
    rel = path.strip("/")
    found = []
    while True:
        limit = read(os.path.join(mount, rel))
        if limit is not None:
            found.append(limit)
        if not rel:
            return found
        rel = os.path.dirname(rel)


def _v2_limit(cgroup: str) -> float | None:
    try:
        with open(os.path.join(cgroup, "cpu.max")) as f:
            quota, _sep, period = f.read().strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100000)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_limit(cgroup: str) -> float | None:
    try:
        with open(os.path.join(cgroup, "cpu.cfs_quota_us")) as f:
            quota = int(f.read().strip())
        with open(os.path.join(cgroup, "cpu.cfs_period_us")) as f:
            period = int(f.read().strip())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError, ZeroDivisionError):
        return None


def default_workers() -> int:
    """Verification workers when none are asked for: every usable core but one (left for the
    listing that runs alongside the workers, verify.quick_split), at most 16; all of them on
    1-2 cores. How the count was chosen: docs/benchmarks.md, "quick, fifth pass".
    """
    cpus = usable_cores()
    return cpus if cpus <= 2 else min(16, cpus - 1)
