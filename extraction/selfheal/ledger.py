"""The self-healing ledger: what the loop was asked, what it found and did, and its brakes, kept on
the control node so that restarts of the rulebook and of the control node forget nothing.

One JSON file, `<state dir>/ledger.json`, read and replaced whole (temp + fsync + rename, never
through a link) under an exclusive `flock` of `<state dir>/ledger.lock`: remedies of several hosts
run at once (the rulebook's parallel strategy) and each reads, decides and writes under the lock.
The state directory is the operator's (mode 0700): nobody else can write a request, a finding or a
resume into it. A ledger that cannot be read is an error naming the file, never an empty ledger:
forgetting an open breaker would let the loop act again.

Shape (version 1): `requests` [{at, host, remedy, alert, finding?}], `outcomes` [{at, host, remedy,
outcome, cause?, detail?}], `breaker` (null or {opened_at, why, cause, hosts, alerts}), `resumed_at`,
`acknowledged` [hosts], `held` {host: {since, why}}, `host_resumed_at` {host: at}, `retired` {host: at} (taken over by the loop), `textfile_dir` (where
the last remedy wrote hsx-selfheal.prom, so that a resume rewrites it there). Entries older than
the longest window are dropped as the file is written.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hsx.fsutil import atomic_write_bytes, read_nofollow

VERSION = 1
MAX_BYTES = 16 << 20  # a ledger is small; a bigger file is not ours


class LedgerError(Exception):
    """The ledger or its directory cannot be used (the message names the path)."""


def default_state_dir() -> Path:
    """$HSX_SELFHEAL_STATE_DIR, else $XDG_STATE_HOME/hsx-selfheal, else ~/.local/state/hsx-selfheal."""
    if os.environ.get("HSX_SELFHEAL_STATE_DIR"):
        return Path(os.environ["HSX_SELFHEAL_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "hsx-selfheal"


def empty() -> dict[str, Any]:
    return {"version": VERSION, "requests": [], "outcomes": [], "breaker": None, "resumed_at": 0.0,
            "acknowledged": [], "held": {}, "host_resumed_at": {}, "retired": {}, "textfile_dir": None}


def _check_dir(d: Path) -> None:
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise LedgerError(f"{d}: the self-healing state directory is not a directory (a link?)")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise LedgerError(f"{d}: the self-healing state directory must be the operator's own and writable by "
                          f"no one else (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")


def _validate(data: Any, path: Path) -> dict[str, Any]:
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise LedgerError(f"{path}: not a version {VERSION} self-healing ledger")
    state = empty()
    for key, kind in (("requests", list), ("outcomes", list), ("acknowledged", list), ("held", dict),
                      ("host_resumed_at", dict), ("retired", dict)):
        value = data.get(key, state[key])
        if not isinstance(value, kind):
            raise LedgerError(f"{path}: {key} must be a {kind.__name__}")
        state[key] = value
    for key in ("requests", "outcomes"):
        for i, entry in enumerate(state[key]):
            if not (isinstance(entry, dict) and isinstance(entry.get("at"), int | float)
                    and isinstance(entry.get("host"), str)):
                raise LedgerError(f"{path}: {key}[{i}] is not an entry with a time and a host")
    breaker = data.get("breaker")
    if breaker is not None and not (isinstance(breaker, dict) and isinstance(breaker.get("opened_at"), int | float)):
        raise LedgerError(f"{path}: breaker must be null or an object with opened_at")
    state["breaker"] = breaker
    if not isinstance(data.get("resumed_at", 0.0), int | float):
        raise LedgerError(f"{path}: resumed_at must be a number")
    state["resumed_at"] = float(data.get("resumed_at", 0.0))
    textfile_dir = data.get("textfile_dir")
    if textfile_dir is not None and not isinstance(textfile_dir, str):
        raise LedgerError(f"{path}: textfile_dir must be a path or null")
    state["textfile_dir"] = textfile_dir
    return state


def load(path: Path) -> dict[str, Any]:
    try:
        raw = read_nofollow(str(path), MAX_BYTES + 1)
    except FileNotFoundError:
        return empty()
    except OSError as exc:
        raise LedgerError(f"{path}: cannot read the self-healing ledger: {exc}") from exc
    if len(raw) > MAX_BYTES:
        raise LedgerError(f"{path}: larger than {MAX_BYTES} bytes: not a self-healing ledger")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise LedgerError(f"{path}: not JSON ({exc}); move it aside to start a new ledger (an open breaker "
                          f"in it would be forgotten)") from exc
    return _validate(data, path)


def prune(state: dict[str, Any], now: float, keep_s: float) -> None:
    for key in ("requests", "outcomes"):
        state[key] = [e for e in state[key] if e["at"] >= now - keep_s]


class Ledger:
    """`with Ledger(dir).locked() as state:` reads the state under the lock and writes it back when the
    block ends without an exception."""

    def __init__(self, state_dir: Path, keep_s: float = 8 * 86400):
        self.dir = Path(state_dir)
        self.path = self.dir / "ledger.json"
        self.keep_s = keep_s

    def read(self) -> dict[str, Any]:
        """The state without the lock (for status; a concurrent writer replaces the file whole)."""
        return load(self.path)

    @contextlib.contextmanager
    def locked(self, now: float) -> Iterator[dict[str, Any]]:
        _check_dir(self.dir)
        fd = os.open(self.dir / "ledger.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            state = load(self.path)
            yield state
            prune(state, now, self.keep_s)
            atomic_write_bytes(str(self.path), (json.dumps(state, indent=1, sort_keys=True) + "\n").encode())
        finally:
            os.close(fd)
