"""Reading the hook's per-request dump files back: join chunked-prefill pieces, check for gaps.

A request's prompt may reach the model in several prefill pieces (chunked prefill); the hook writes
one file per piece, `<rid>.<offset>.pt`. A request is complete when its pieces cover 0..L with no
gap or overlap and all agree on layer ids, widths and dtype. Anything else is a DumpError naming the
file and the problem, so a bad dump never becomes a shard. A dump that is not complete YET (no
piece, a gap, fewer tokens than sent) is a DumpIncomplete, waited for; any other DumpError is final
(the pieces are renamed into place whole, so a piece refused now stays refused) and fails the
sample at once. A dump is never mapped: its bytes are read (pread) into memory the client owns,
or (read_request's states_in_files) the states are left in the file as FileBytes for the shard
writer to copy; either way a file that shrinks or a disk that fails under the read is a DumpError
for that sample, not a SIGBUS.

NaN/Inf, who checks what: the client checks every value itself, never on the header's word. States
left in the files are FileBytes with `check` set: each value is checked as it is copied into the
shard (or read), in the copy's cache-resident buffer (extraction/shards/filebytes.py, ~0.07 s of one
core a GiB); a NaN/Inf fails that sample's shard (its temp removed) and the message names the dump
file and the byte. States read into memory are checked by the publisher (all_finite). The hook's
header field (hsx_dump_format.FINITE_FIELD, computed where the states are) only decides early: a
piece that says `false` is read into memory, where the publisher's check refuses it; `true` or no
field (a hook deployed before 2026-12-06) leaves the states in the files, checked on the way.
The format itself: hsx_dump_format.py (the file the hook writes with, deployed beside it).
Every file here is someone else's: opened without following a link or waiting on a FIFO,
required to be a regular file, read bounded.

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
import glob
import json
import os
import re
import select
import stat
import struct
import time
from dataclasses import dataclass, replace

import torch

from extraction.sglang import hsx_dump_format as fmt
from extraction.sglang.hsx_dump_format import FAILED_SUFFIX, rid_stem
from extraction.shards.filebytes import FileBytes, OpenFile

_KEYS = fmt.DUMP_TENSORS  # a piece's tensors, in the file's order
_STATE_KEYS = ("hidden_state", "aux_hidden_state")  # the tensors a finite piece leaves in its file


class DumpError(ValueError):
    """A dump is missing, incomplete or inconsistent."""


class DumpIncomplete(DumpError):
    """Not every piece of the request is in place yet (none, a gap, fewer tokens): wait for it."""


class DumpWriteFailed(DumpError):
    """The server's hook could not write a piece (its `.failed` marker says why): ask again now."""


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
    # True when the states are FileBytes left in the dump files that check their own values as
    # they are copied or read (check=True: a NaN/Inf fails that copy, so no one else need check);
    # None when they were read into memory: the publisher checks them (module docstring).
    finite: bool | None = None


def piece_paths(directory: str, rid: str) -> list[str]:
    stem = rid_stem(rid)
    names = re.compile(re.escape(stem) + r"\.\d{9}\.pt")
    found = glob.glob(os.path.join(glob.escape(directory), glob.escape(stem) + ".*.pt"))
    return sorted(p for p in found if names.fullmatch(os.path.basename(p)))


def failed_paths(directory: str, rid: str) -> list[str]:
    """The hook's markers for pieces of this request it could not write."""
    stem = rid_stem(rid)
    names = re.compile(re.escape(stem) + r"\.\d{9}" + re.escape(FAILED_SUFFIX))
    found = glob.glob(os.path.join(glob.escape(directory), glob.escape(stem) + ".*" + FAILED_SUFFIX))
    return sorted(p for p in found if names.fullmatch(os.path.basename(p)))


_MAX_HEADER = 1 << 16  # a dump's JSON header is ~400 bytes; anything past this is not ours
_MARKER_READ = 300  # a marker holds one line, the reason; at most this much of it is read
_STATE_DTYPES = {name: getattr(torch, name) for name in fmt.DUMP_DTYPES}
_IDS_DTYPES = {"int64": torch.int64}


def _open_untrusted(path: str, what: str) -> tuple[int, os.stat_result]:
    """`path` opened read-only without following a link and without waiting on a FIFO, and its
    stat: DumpError naming it unless it is a regular file (the hook makes nothing else)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DumpError(f"{path}: unreadable {what}: {exc} (a symbolic link: refused)") from None
        raise DumpError(f"{path}: unreadable {what}: {exc}") from None
    try:
        info = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise DumpError(f"{path}: unreadable {what}: {exc}") from None
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise DumpError(f"{path}: not a regular file, not a {what} the hook wrote")
    return fd, info


def _load(path: str, rid: str, states_in_files: bool = False) -> dict:
    """One piece, checked: a dict with the header's fields and the three tensors, each `n` rows;
    DumpError naming the file for anything else. Format 2's tensors are read into memory of
    ours (_read_tensors), but with `states_in_files` for the states of a piece whose header does
    not say the hook found a NaN/Inf (FINITE_FIELD true or absent): those stay in the file, FileBytes holding its descriptor
    that check their values as the shard writer copies them. Format 1 (a hook deployed before 2026-12-05, in a server not restarted since) is read
    with torch.load."""
    fd, info = _open_untrusted(path, "dump")
    kept = None  # the OpenFile that took the descriptor over (states left in the file)
    try:
        try:
            head = os.pread(fd, fmt.DUMP_HEAD.size, 0)
        except OSError as exc:
            raise DumpError(f"{path}: unreadable dump: {exc}") from None
        v1 = head[:4] == b"PK\x03\x04"
        if v1:
            record = _load_v1(path)
        else:
            record, kept = _load_v2(path, fd, head, info.st_size, states_in_files)
    finally:
        if kept is None:
            os.close(fd)
    try:
        _check_record(path, record, rid, fmt.FORMAT_V1 if v1 else fmt.FORMAT)
    except DumpError:
        raise
    except (LookupError, ValueError, TypeError, AttributeError, RuntimeError) as exc:
        raise DumpError(f"{path}: malformed dump: {type(exc).__name__}: {exc}") from None
    return record


def _check_record(path: str, record: dict, rid: str, expected: str) -> None:
    """The fields and tensors every piece in format `expected` must have (what read_request and
    the client use without further checks); a state may be a FileBytes (left in the file)."""
    _check_fields(path, record, expected)
    if record["rid"] != rid:
        raise DumpError(f"{path}: holds request {record['rid']!r}, expected {rid!r}")
    ids = record.get("input_ids")
    n = int(ids.shape[0]) if isinstance(ids, torch.Tensor) and ids.dim() == 1 else -1
    for key, rank in zip(_KEYS, (1, 2, 2), strict=True):
        t = record.get(key)
        if not isinstance(t, torch.Tensor | FileBytes) or t.dim() != rank or int(t.shape[0]) != n:
            raise DumpError(f"{path}: {key} missing or not {n} rows of rank {rank}")
    if ids.dtype != torch.int64 or record["hidden_state"].dtype not in _STATE_DTYPES.values():
        raise DumpError(
            f"{path}: input_ids {ids.dtype} (int64 wanted), states {record['hidden_state'].dtype}"
        )


def _load_v1(path: str) -> dict:
    try:  # not mapped: a file that shrinks must not SIGBUS the client
        record = torch.load(path, map_location="cpu", weights_only=True, mmap=False)
    except Exception as exc:
        raise DumpError(f"{path}: unreadable dump: {exc}") from None
    if not isinstance(record, dict) or record.get("format") != fmt.FORMAT_V1:
        raise DumpError(f"{path}: not a {fmt.FORMAT_V1} dump")
    record["finite"] = None  # format 1 says nothing about it
    return record


def _load_v2(
    path: str, fd: int, head: bytes, size: int, states_in_files: bool
) -> tuple[dict, OpenFile | None]:
    """A format 2 dump's header, checked against the file, and its tensors: all read (without
    `states_in_files`, or the hook found a NaN/Inf: fmt.FINITE_FIELD false), or the input ids read and the states left in the
    file, FileBytes (check=True) over an OpenFile that takes `fd` over (returned; else None). The
    record's `finite` is the header's value, None where it has none (an older hook)."""
    if len(head) != fmt.DUMP_HEAD.size or head[:8] != fmt.DUMP_MAGIC:
        raise DumpError(f"{path}: not a {fmt.FORMAT} dump (its first bytes are {head[:8]!r})")
    _magic, length = fmt.DUMP_HEAD.unpack(head)
    if length > _MAX_HEADER or fmt.DUMP_HEAD.size + length > size:
        raise DumpError(f"{path}: header of {length} bytes in a file of {size}")
    try:
        meta = json.loads(os.pread(fd, length, fmt.DUMP_HEAD.size))
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: a deeply nested header
        raise DumpError(f"{path}: unreadable header: {exc}") from None
    tensors = _tensor_specs(path, meta, fmt.DUMP_HEAD.size + length, size)
    finite = meta.get(fmt.FINITE_FIELD)
    if finite is not None and not isinstance(finite, bool):
        raise DumpError(f"{path}: header field {fmt.FINITE_FIELD!r} is {finite!r}, not true or false")
    record = {key: meta[key] for key in _FIELDS}
    record["finite"] = finite
    if finite is False or not states_in_files:  # (false: refused anyway, by the publisher's check)
        record.update(_read_tensors(path, fd, tensors, size))
        return record, None
    record.update(_read_tensors(path, fd, {"input_ids": tensors["input_ids"]}, tensors["hidden_state"][2]))
    spans = {name: (tensors[name][0], tuple(tensors[name][1]), tensors[name][2]) for name in _STATE_KEYS}
    # The OpenFile takes `fd` over last, once nothing can fail: until then _load closes it, and
    # both closing it would close a number some other file may have got in between.
    kept = OpenFile(fd, path, size)
    for name, (dtype, shape, at) in spans.items():
        record[name] = FileBytes(dtype, shape, ((kept, at, _nbytes(dtype, shape)),), DumpError, check=True)
    return record, kept


def _nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for d in shape:
        n *= d
    return n


def _read_tensors(path: str, fd: int, specs: dict, size: int) -> dict:
    """The tensors `specs` ({name: (dtype, shape, at)}, laid out up to byte `size`: the file's
    end, or where the states left in it start) read with pread into one buffer of ours, views of it. Never a mapping of the file: a dump that shrinks,
    or a disk read error (the fallback /data/hsx/dumps), is a DumpError here, not a SIGBUS later."""
    first = min(at for _dtype, _shape, at in specs.values())
    total = size - first
    buf = torch.empty(total, dtype=torch.uint8)
    view = memoryview((ctypes.c_ubyte * total).from_address(buf.data_ptr())).cast("B") if total else None
    done = 0
    while done < total:
        try:
            got = os.preadv(fd, [view[done:]], first + done)
        except OSError as exc:
            raise DumpError(f"{path}: read error at byte {first + done}: {exc}") from None
        if got == 0:
            raise DumpError(
                f"{path}: the file shrank to {first + done} bytes while being read ({size} when opened)"
            )
        done += got
    return {
        name: buf[at - first : at - first + _nbytes(dtype, shape)].view(dtype).view(shape)
        for name, (dtype, shape, at) in specs.items()
    }


_FIELDS = fmt.HEADER_FIELDS


def _check_fields(path: str, meta: object, expected: str) -> None:
    """The header fields (_FIELDS) of a piece in format `expected`, each of its type."""
    if not isinstance(meta, dict):
        raise DumpError(f"{path}: the header is not an object")
    for key, kind in _FIELDS.items():
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise DumpError(f"{path}: header field {key!r} missing or not {kind.__name__}")
    if meta["format"] != expected:
        raise DumpError(f"{path}: format {meta['format']!r}, expected {expected}")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in meta["layer_ids"]):
        raise DumpError(f"{path}: layer_ids {meta['layer_ids']!r} are not all integers")


def _tensor_specs(path: str, meta: object, start: int, size: int) -> dict:
    """{name: (dtype, shape, at)} from a format 2 header, every field checked: the tensors lie in
    order after the header, each at the first DUMP_ALIGN boundary after what precedes it (as
    write_dump lays them out), the file ending with the last; the two states of one dtype. A
    header that lies about a size is caught by the file's end (the aux state is last) or by the
    widths and ids the reader checks next."""
    _check_fields(path, meta, fmt.FORMAT)
    entries = meta.get("tensors")
    if not isinstance(entries, dict) or sorted(entries) != sorted(fmt.DUMP_TENSORS):
        raise DumpError(f"{path}: header tensors must be exactly {list(fmt.DUMP_TENSORS)}")
    specs, pos = {}, start
    for name, rank in zip(fmt.DUMP_TENSORS, (1, 2, 2), strict=True):
        e = entries[name]
        dtypes = _IDS_DTYPES if name == "input_ids" else _STATE_DTYPES
        dtype = dtypes.get(e.get("dtype")) if isinstance(e, dict) else None
        shape, at = (e.get("shape"), e.get("at")) if isinstance(e, dict) else (None, None)
        if (
            dtype is None
            or not isinstance(shape, list)
            or len(shape) != rank
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape)
            or not isinstance(at, int)
            or isinstance(at, bool)
            or at != fmt.dump_aligned(pos)  # where the writer puts it
        ):
            raise DumpError(f"{path}: header entry for {name} is invalid: {e!r}")
        nbytes = torch.empty((), dtype=dtype).element_size()
        for d in shape:
            nbytes *= d
        pos = at + nbytes
        specs[name] = (dtype, shape, at)
    if pos != size:
        raise DumpError(f"{path}: the tensors end at byte {pos}, the file at {size} (truncated or padded)")
    if specs["hidden_state"][0] != specs["aux_hidden_state"][0]:
        raise DumpError(f"{path}: hidden_state and aux_hidden_state differ in dtype")
    return specs


def read_request(
    directory: str, rid: str, expected_len: int | None = None, states_in_files: bool = False
) -> RequestDump:
    """Join the pieces of one request; DumpError unless they cover 0..L exactly (DumpIncomplete:
    not yet; DumpWriteFailed: the hook left a marker). With `states_in_files`, the states stay in
    the files (FileBytes that check their values as the shard writer copies them: `finite` True)
    unless a piece's header says the hook found a NaN/Inf; else they are read (unchecked: the
    publisher checks them; `finite` None)."""
    for marker in failed_paths(directory, rid):
        raise DumpWriteFailed(
            f"{marker}: the server could not write this piece of request {rid!r}: {_marker_reason(marker)}"
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
        for key in ("hidden_state", "aux_hidden_state"):
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

    def cat(key: str) -> torch.Tensor | FileBytes:
        parts = [r[key] if in_files else _read_unchecked(r[key]) for r, _ in records]
        if len(parts) == 1:
            return parts[0]
        if isinstance(parts[0], FileBytes):  # the pieces' spans in row order: still nothing read
            rows = sum(int(p.shape[0]) for p in parts)
            spans = tuple(span for p in parts for span in p.spans)
            return FileBytes(parts[0].dtype, (rows, *parts[0].shape[1:]), spans, DumpError, check=True)
        return torch.cat(parts, dim=0)

    return RequestDump(
        rid=rid,
        input_ids=cat("input_ids"),
        hidden_state=cat("hidden_state"),
        aux_hidden_state=cat("aux_hidden_state"),
        layer_ids=[int(i) for i in first["layer_ids"]],
        capture_owner=str(first["capture_owner"]),
        sglang_version=str(first["sglang_version"]),
        pieces=len(records),
        finite=True if in_files else None,
    )


def _read_unchecked(t: torch.Tensor | FileBytes) -> torch.Tensor:
    """`t` in memory; a FileBytes read without its NaN/Inf check (the publisher checks what is in
    memory, naming the sample and the tensor)."""
    return replace(t, check=False).read() if isinstance(t, FileBytes) else t


def _marker_reason(path: str) -> str:
    """The reason a marker holds (its first _MARKER_READ bytes), opened as a dump is: a link, a
    FIFO or anything but a regular file is a DumpError (not a marker the hook wrote)."""
    fd, _info = _open_untrusted(path, "marker")
    try:
        data = os.pread(fd, _MARKER_READ, 0)
    except OSError as exc:
        return f"(marker unreadable: {exc})"
    finally:
        os.close(fd)
    return data.decode("utf-8", errors="replace").strip()


def remove_request(directory: str, rid: str) -> int:
    """Delete a request's pieces and failure markers (after it was read or abandoned); returns how
    many. An entry that cannot be removed (a directory named like a piece) is left: the read of
    that request names it."""
    n = 0
    for path in piece_paths(directory, rid) + failed_paths(directory, rid):
        try:
            os.unlink(path)
            n += 1
        except OSError:
            pass
    return n


# ---------------------------------------------------------------- what a crash leaves

RID_PREFIX = fmt.RID_PREFIX  # every rid our client sends starts with it (the hook dumps no other)
_TEMP = re.compile(r"\.(.+)\.(\d+)\.tmp")  # the hook's temp: .<dump or marker name>.<server pid>.tmp
_PID_MAX = 1 << 22  # Linux's PID_MAX_LIMIT: a larger number is no process id


def client_lock(directory: str) -> int | None:
    """Take the dump directory's client lock (flock on the directory itself: no file; released
    when the process dies, kill -9 included): its fd, or None when another live client holds it.
    Only the holder may remove files of other clients' requests (stale_names)."""
    import fcntl

    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists
        return True
    return True


def stale_names(directory: str, own_prefix: str, strays: list[str] | None = None) -> list[str]:
    """Files in `directory` that no live request will read, for the one client holding the lock:
    - dumps and `.failed` markers of requests our client sent (rid starting with RID_PREFIX) but
      not this client instance (`own_prefix`): a client killed before reading them (its late
      pieces land after it died, and are found by the next call);
    - the hook's temps (`.<name>.<pid>.tmp`) of one of our requests whose server process is gone
      (a server killed mid-write). A live server's temps are left alone: it renames them.
    Files of other users of the server (rids without RID_PREFIX) are never touched. An entry
    named like one of these that is not a regular file (a directory, a link, a FIFO) or a temp
    whose pid is no process id is a stray: left alone, and appended to `strays` as
    "name (why)" when given (the caller says so once; it never stops the sweep)."""
    found = []
    try:
        with os.scandir(directory) as it:
            entries = list(it)
    except FileNotFoundError:
        return []
    for entry in entries:
        name, why = entry.name, None
        temp = _TEMP.fullmatch(name)
        if temp is not None:
            if not temp.group(1).startswith(RID_PREFIX):
                continue
            pid = int(temp.group(2))
            if not 0 < pid <= _PID_MAX:
                why = f"pid {temp.group(2)} is no process id"
            elif _alive(pid):
                continue
        elif not (name.startswith(RID_PREFIX) and not name.startswith(own_prefix)):
            continue
        elif not name.endswith((".pt", FAILED_SUFFIX)):
            continue
        try:
            if why is None and not entry.is_file(follow_symlinks=False):
                why = "not a regular file"
        except OSError as exc:
            why = str(exc)
        if why is None:
            found.append(name)
        elif strays is not None:
            strays.append(f"{name} ({why})")
    return sorted(found)


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
