"""Free-space guard: stop cleanly before the disk fills (the incident began with a full disk)."""

from __future__ import annotations

import os
from dataclasses import dataclass

RESERVE_FRACTION = 0.02
RESERVE_SHARDS = 10


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer can still use on path's filesystem."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fs_size(path: str) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def estimate_shard_bytes(num_tokens: int, hidden_size: int, num_aux: int, itemsize: int) -> int:
    """A shard's size: hidden + aux states, int64 ids and mask, plus the zip/pickle overhead."""
    return num_tokens * (hidden_size * (1 + num_aux) * itemsize + 16) + 4096


@dataclass
class DiskLow(Exception):
    """Free space is below the reserve: pause, do not write."""

    free: int
    reserve: int
    needed: int
    path: str

    def __str__(self) -> str:
        return (
            f"disk low on {self.path}: {self.free} bytes free, reserve {self.reserve} bytes, "
            f"next shard ~{self.needed} bytes"
        )

    def __reduce__(self) -> tuple:
        """Pickled by its fields (the writer process sends it back): Exception's own pickling
        would call DiskLow() with the empty args a dataclass leaves."""
        return (DiskLow, (self.free, self.reserve, self.needed, self.path))


class DiskGuard:
    """Checks before each write that free - shard >= reserve.

    With no explicit reserve it is max(2% of the filesystem, 10 x the largest shard so far),
    so it grows when long samples show up.
    """

    def __init__(self, path: str, reserve_bytes: int | None = None, shard_estimate: int = 0):
        self.path = path
        self.explicit = reserve_bytes
        self.largest = shard_estimate
        self.fs_bytes = fs_size(path)
        self.last_free: int | None = None

    @property
    def reserve(self) -> int:
        if self.explicit is not None:
            return self.explicit
        return max(int(self.fs_bytes * RESERVE_FRACTION), RESERVE_SHARDS * self.largest)

    def check(self, needed: int) -> int:
        """Raise DiskLow unless a write of `needed` bytes leaves the reserve free; returns free."""
        self.largest = max(self.largest, needed)
        free = free_bytes(self.path)
        self.last_free = free
        if free - needed < self.reserve:
            raise DiskLow(free=free, reserve=self.reserve, needed=needed, path=self.path)
        return free
