"""One piece of a dump, read and checked: the file the hook wrote for one request's prefill piece.

The format is hsx_dump_format.py's (the file the hook writes with, deployed beside it). Every file
here is someone else's: opened without following a link or waiting on a FIFO, required to be a
regular file, read bounded; the header is checked field by field against the format and the
file's size before anything in it is used.

Contract:
- `load(path, rid, states_in_files=False)`: a dict with the header's fields (hsx_dump_format.
  HEADER_FIELDS), `finite` (the header's FINITE_FIELD: True, False, or None where it has none) and
  the tensors `input_ids` [n] int64, `hidden_state` [n, H] and `aux_hidden_state` [n, k*H] (the
  two states of one dtype of DUMP_DTYPES), every one `n` rows; DumpError naming the file for
  anything else (a malformed header, a size that does not match, another request's rid, a read
  error, a file that shrank while read). The input ids are always read into memory
  (dump_memory.py). The states: left in the file as FileBytes (dump_states.py, which says when
  they are checked as copied) with `states_in_files` unless the header says `finite: false`;
  otherwise read into memory too. Format 1 (a hook deployed before 2026-12-05, in a server not
  restarted since) is read whole with torch.load (not mapped), `finite` None.
- `open_untrusted(path, what)`: (fd, stat) of a regular file opened read-only, no link followed,
  no FIFO waited on; DumpError naming it otherwise.
- `marker_reason(path)`: the reason a `.failed` marker holds (its first MARKER_READ bytes), opened
  as a dump is.
"""

from __future__ import annotations

import errno
import json
import os
import stat

import torch

from extraction.sglang import dump_memory, dump_states
from extraction.sglang import hsx_dump_format as fmt
from extraction.sglang.dump_errors import DumpError
from extraction.shards.filebytes import FileBytes, OpenFile

KEYS = fmt.DUMP_TENSORS  # a piece's tensors, in the file's order
FIELDS = fmt.HEADER_FIELDS
MAX_HEADER = 1 << 16  # a dump's JSON header is ~400 bytes; anything past this is not ours
MARKER_READ = 300  # a marker holds one line, the reason; at most this much of it is read
_STATE_DTYPES = {name: getattr(torch, name) for name in fmt.DUMP_DTYPES}
_IDS_DTYPES = {"int64": torch.int64}


def open_untrusted(path: str, what: str) -> tuple[int, os.stat_result]:
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


def load(path: str, rid: str, states_in_files: bool = False) -> dict:
    """One piece, checked (see the module's contract)."""
    fd, info = open_untrusted(path, "dump")
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
        check_record(path, record, rid, fmt.FORMAT_V1 if v1 else fmt.FORMAT)
    except DumpError:
        raise
    except (LookupError, ValueError, TypeError, AttributeError, RuntimeError) as exc:
        raise DumpError(f"{path}: malformed dump: {type(exc).__name__}: {exc}") from None
    return record


def check_record(path: str, record: dict, rid: str, expected: str) -> None:
    """The fields and tensors every piece in format `expected` must have (what read_request and
    the client use without further checks); a state may be a FileBytes (left in the file)."""
    check_fields(path, record, expected)
    if record["rid"] != rid:
        raise DumpError(f"{path}: holds request {record['rid']!r}, expected {rid!r}")
    ids = record.get("input_ids")
    n = int(ids.shape[0]) if isinstance(ids, torch.Tensor) and ids.dim() == 1 else -1
    for key, rank in zip(KEYS, (1, 2, 2), strict=True):
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
    """A format 2 dump's header, checked against the file, and its tensors: all read, or the
    input ids read and the states left in the file over an OpenFile that takes `fd` over
    (returned; else None)."""
    if len(head) != fmt.DUMP_HEAD.size or head[:8] != fmt.DUMP_MAGIC:
        raise DumpError(f"{path}: not a {fmt.FORMAT} dump (its first bytes are {head[:8]!r})")
    _magic, length = fmt.DUMP_HEAD.unpack(head)
    if length > MAX_HEADER or fmt.DUMP_HEAD.size + length > size:
        raise DumpError(f"{path}: header of {length} bytes in a file of {size}")
    try:
        meta = json.loads(os.pread(fd, length, fmt.DUMP_HEAD.size))
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: a deeply nested header
        raise DumpError(f"{path}: unreadable header: {exc}") from None
    tensors = tensor_specs(path, meta, fmt.DUMP_HEAD.size + length, size)
    finite = meta.get(fmt.FINITE_FIELD)
    if finite is not None and not isinstance(finite, bool):
        raise DumpError(f"{path}: header field {fmt.FINITE_FIELD!r} is {finite!r}, not true or false")
    record = {key: meta[key] for key in FIELDS}
    record["finite"] = finite
    if finite is False or not states_in_files:  # (false: refused by the publisher's check)
        record.update(dump_memory.read_tensors(path, fd, tensors, size))
        return record, None
    ids_end = tensors["hidden_state"][2]  # the ids lie before the states
    record.update(dump_memory.read_tensors(path, fd, {"input_ids": tensors["input_ids"]}, ids_end))
    states, kept = dump_states.leave_in_file(path, fd, size, tensors, finite)
    record.update(states)
    return record, kept


def check_fields(path: str, meta: object, expected: str) -> None:
    """The header fields (FIELDS) of a piece in format `expected`, each of its type."""
    if not isinstance(meta, dict):
        raise DumpError(f"{path}: the header is not an object")
    for key, kind in FIELDS.items():
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise DumpError(f"{path}: header field {key!r} missing or not {kind.__name__}")
    if meta["format"] != expected:
        raise DumpError(f"{path}: format {meta['format']!r}, expected {expected}")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in meta["layer_ids"]):
        raise DumpError(f"{path}: layer_ids {meta['layer_ids']!r} are not all integers")


def tensor_specs(path: str, meta: object, start: int, size: int) -> dict:
    """{name: (dtype, shape, at)} from a format 2 header, every field checked: the tensors lie in
    order after the header, each at the first DUMP_ALIGN boundary after what precedes it (as
    write_dump lays them out), the file ending with the last; the two states of one dtype. A
    header that lies about a size is caught by the file's end (the aux state is last) or by the
    widths and ids the reader checks next."""
    check_fields(path, meta, fmt.FORMAT)
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
        pos = at + dump_memory.nbytes(dtype, shape)
        specs[name] = (dtype, shape, at)
    if pos != size:
        raise DumpError(f"{path}: the tensors end at byte {pos}, the file at {size} (truncated or padded)")
    if specs["hidden_state"][0] != specs["aux_hidden_state"][0]:
        raise DumpError(f"{path}: hidden_state and aux_hidden_state differ in dtype")
    return specs


def marker_reason(path: str) -> str:
    """The reason a marker holds (its first MARKER_READ bytes), opened as a dump is: a link, a
    FIFO or anything but a regular file is a DumpError (not a marker the hook wrote)."""
    fd, _info = open_untrusted(path, "marker")
    try:
        data = os.pread(fd, MARKER_READ, 0)
    except OSError as exc:
        return f"(marker unreadable: {exc})"
    finally:
        os.close(fd)
    return data.decode("utf-8", errors="replace").strip()
