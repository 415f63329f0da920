"""Reading the hook's per-request dump files back: join chunked-prefill pieces, check for gaps.

A request's prompt may reach the model in several prefill pieces (chunked prefill); the hook writes
one file per piece, `<rid>.<offset>.pt`. A request is complete when its pieces cover 0..L with no
gap or overlap and all agree on layer ids, widths and dtype. Anything else is a DumpError naming the
file and the problem, so a bad dump never becomes a shard. A dump that is not complete YET (no
piece, a gap, fewer tokens than sent) is a DumpIncomplete, waited for; any other DumpError is final
(the pieces are renamed into place whole, so a piece refused now stays refused) and fails the
sample at once (extraction/sglang/dump_errors.py). A dump is never mapped.

This module joins and waits; the rest is split by concern, each with its contract:
- dump_piece.py: one piece file opened and its header checked against the format and the file;
- dump_states.py: states left in the files (FileBytes the shard writer copies from the dump's
  descriptor), and who checks them for NaN/Inf: the hook's `finite: true` is taken as said (the
  trust argument is there), a header without it is checked value by value as it is copied;
- dump_memory.py: the in-memory path (pread into memory of ours: the input ids, and the states
  of a piece the hook found a NaN/Inf in, for the publisher to refuse);
- dump_sweep.py: a request's files found and removed, and what a crash leaves swept.
Their public names are importable from here as before.

The server's reply does not wait for the dump (the hook writes from a thread; docs/sglang_hook.md
says why): `wait_request` waits for the pieces' renames with inotify (no sleep-polling; one
instance per wait, closed when it ends; a coarse poll only where inotify is unavailable), fails at
once on a `<rid>.<offset>.failed` marker the hook leaves for a piece it could not write, and times
out otherwise.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import select
import struct
import time
from dataclasses import dataclass

import torch

from extraction.sglang import dump_memory, dump_states
from extraction.sglang.dump_errors import DumpError, DumpIncomplete, DumpWriteFailed
from extraction.sglang.dump_piece import FIELDS as _FIELDS  # noqa: F401 - importable from here, as before
from extraction.sglang.dump_piece import KEYS as _KEYS  # noqa: F401
from extraction.sglang.dump_piece import load as _load
from extraction.sglang.dump_piece import marker_reason
from extraction.sglang.dump_sweep import (
    RID_PREFIX,
    client_lock,
    failed_paths,
    piece_paths,
    remove_request,
    stale_names,
)
from extraction.sglang.hsx_dump_format import rid_stem
from extraction.shards.filebytes import FileBytes

__all__ = [
    "RID_PREFIX",
    "DumpError",
    "DumpIncomplete",
    "DumpWriteFailed",
    "RequestDump",
    "client_lock",
    "failed_paths",
    "piece_paths",
    "read_request",
    "remove_request",
    "stale_names",
    "wait_request",
]


@dataclass
class RequestDump:
    rid: str
    input_ids: torch.Tensor  # [L] int64
    hidden_state: torch.Tensor | FileBytes  # [L, H]
    aux_hidden_state: torch.Tensor | FileBytes  # [L, k*H]
    layer_ids: list[int]
    capture_owner: str
    sglang_version: str
    pieces: int
    # True when the states are FileBytes left in the dump files, either said finite by the hook or
    # checked as they are copied (dump_states.py: no one else need check); False when the hook said
    # a piece holds a NaN/Inf (read into memory: the publisher refuses the sample on that word,
    # naming the tensor where it finds the value); None when read into memory unclaimed (format 1,
    # or not asked for in files): the publisher checks them.
    finite: bool | None = None


def read_request(
    directory: str, rid: str, expected_len: int | None = None, states_in_files: bool = False
) -> RequestDump:
    """Join the pieces of one request; DumpError unless they cover 0..L exactly (DumpIncomplete:
    not yet; DumpWriteFailed: the hook left a marker). With `states_in_files`, the states stay in
    the files (FileBytes: `finite` True; dump_states.py says which are checked as copied) unless a
    piece's header says the hook found a NaN/Inf (`finite` False: read into memory, refused by the
    publisher); else they are read (unchecked: the publisher checks them; `finite` None)."""
    for marker in failed_paths(directory, rid):
        raise DumpWriteFailed(
            f"{marker}: the server could not write this piece of request {rid!r}: {marker_reason(marker)}"
        )
    paths = piece_paths(directory, rid)
    if not paths:
        raise DumpIncomplete(f"no dump for request {rid!r} in {directory}")
    records = sorted(
        ((_load(p, rid, states_in_files), p) for p in paths), key=lambda rp: int(rp[0]["offset"])
    )
    first, first_path = records[0]
    if int(first["offset"]) != 0:
        raise DumpError(
            f"{first_path}: request {rid!r} starts at token {first['offset']}, not 0 "
            "(prefix served from the radix cache? run SGLang with --disable-radix-cache)"
        )
    pos = 0
    for record, path in records:
        offset = int(record["offset"])
        n = int(record["input_ids"].shape[0])
        if offset != pos:
            what, error = ("gap", DumpIncomplete) if offset > pos else ("overlap", DumpError)
            raise error(f"{path}: {what} in request {rid!r}: piece starts at {offset}, expected {pos}")
        for key in ("layer_ids", "capture_owner", "sglang_version"):
            if record[key] != first[key]:
                raise DumpError(
                    f"{path}: {key} {record[key]!r} differs from the first piece's {first[key]!r}"
                )
        for key in dump_states.STATE_KEYS:
            a, b = record[key], first[key]
            if a.dtype != b.dtype or a.shape[1:] != b.shape[1:]:
                raise DumpError(
                    f"{path}: {key} is {a.dtype}{list(a.shape)}, first piece {b.dtype}{list(b.shape)}"
                )
        pos = offset + n
    if expected_len is not None and pos != expected_len:
        error = DumpIncomplete if pos < expected_len else DumpError
        raise error(f"request {rid!r}: dumps cover {pos} tokens, expected {expected_len}")
    hidden = int(first["hidden_state"].shape[-1])
    if int(first["aux_hidden_state"].shape[-1]) != hidden * len(first["layer_ids"]):
        raise DumpError(f"{first_path}: aux width does not match {len(first['layer_ids'])} layers x {hidden}")

    in_files = states_in_files and all(isinstance(r["hidden_state"], FileBytes) for r, _ in records)
    join = dump_states.join if in_files else dump_memory.join
    flagged = any(r["finite"] is False for r, _ in records)
    return RequestDump(
        rid=rid,
        input_ids=dump_memory.join([r["input_ids"] for r, _ in records]),
        hidden_state=join([r["hidden_state"] for r, _ in records]),
        aux_hidden_state=join([r["aux_hidden_state"] for r, _ in records]),
        layer_ids=[int(i) for i in first["layer_ids"]],
        capture_owner=str(first["capture_owner"]),
        sglang_version=str(first["sglang_version"]),
        pieces=len(records),
        finite=True if in_files else (False if flagged else None),
    )


# ---------------------------------------------------------------- waiting for a dump

_IN_MOVED_TO = 0x00000080
_IN_DELETE_SELF = 0x00000400
_IN_MOVE_SELF = 0x00000800
_IN_Q_OVERFLOW = 0x00004000  # events were dropped: ours may be among them
_IN_IGNORED = 0x00008000
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    """The C library (loaded once), for inotify_init1 and inotify_add_watch."""
    return ctypes.CDLL(None, use_errno=True)


class _DirWatch:
    """Renames into one directory, through inotify (Linux; libc via ctypes): one instance, closed
    by close(). `ok` is False where inotify is unavailable (not Linux, the user's instances all
    taken, the directory not watchable): the caller then polls."""

    def __init__(self, directory: str):
        self.fd = -1
        self.gone = False
        fd = -1
        try:
            libc = _libc()
            fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
            mask = _IN_MOVED_TO | _IN_DELETE_SELF | _IN_MOVE_SELF
            if fd >= 0 and libc.inotify_add_watch(fd, os.fsencode(directory), mask) >= 0:
                self.fd, fd = fd, -1
        except Exception:  # noqa: BLE001 - no inotify here, whatever the reason: poll
            pass
        finally:
            if fd >= 0:  # an instance without a watch: give it back now
                os.close(fd)

    @property
    def ok(self) -> bool:
        return self.fd >= 0 and not self.gone

    def wait(self, prefix: str, timeout: float) -> bool:
        """Block until a name starting with `prefix` is renamed into the directory (True), or the
        timeout passes / the directory itself goes away (False)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            poller = select.poll()  # not select(): it refuses a descriptor above 1023
            poller.register(self.fd, select.POLLIN)
            if not poller.poll(left * 1000):
                return False
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                continue
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                self.gone = True
                return False
            pos, hit = 0, False
            while pos + _EVENT.size <= len(data):
                _wd, mask, _cookie, length = _EVENT.unpack_from(data, pos)
                name = data[pos + _EVENT.size : pos + _EVENT.size + length].split(b"\0", 1)[0]
                pos += _EVENT.size + length
                if mask & (_IN_DELETE_SELF | _IN_MOVE_SELF | _IN_IGNORED):
                    self.gone = True
                    return False
                if mask & _IN_Q_OVERFLOW or os.fsdecode(name).startswith(prefix):
                    hit = True
            if hit:
                return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def wait_request(
    directory: str, rid: str, expected_len: int, timeout: float, states_in_files: bool = False
) -> RequestDump:
    """read_request once the pieces covering 0..expected_len are in place (the hook renames each
    piece into place when it is complete). Woken by inotify on renames of this request's names;
    DumpWriteFailed at once for a `.failed` marker, DumpError at once for a piece the reader
    refuses (it was renamed into place whole: it will not change), DumpIncomplete after `timeout`
    seconds of pieces missing, with the last problem."""
    prefix = rid_stem(rid) + "."
    deadline = time.monotonic() + timeout
    pause = 0.005
    watch = _DirWatch(directory)  # set up BEFORE looking, so no rename falls between
    try:
        while True:
            try:
                return read_request(directory, rid, expected_len, states_in_files)
            except DumpIncomplete as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DumpIncomplete(f"{exc} (waited {timeout:g}s)") from None
            if watch.ok:
                watch.wait(prefix, left)
            else:  # no inotify here: poll, backing off to 0.2 s
                time.sleep(min(pause, left))
                pause = min(pause * 2, 0.2)
    finally:
        watch.close()
