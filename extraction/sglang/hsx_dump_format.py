"""The dump file format the hook writes and the client reads (deployed as `sglang/hsx_dump_format.py`).

One source of truth for both sides: the SGLang server's hook (extraction/sglang/hook.py, deployed
beside this file as `sglang/hsx_dump_hook.py`) writes with `write_dump`; the client's reader
(extraction/sglang/dumps.py) checks a file against `dump_layout`'s rules. The standard library
only at module level, torch imported lazily (this file runs inside SGLang too).

The contract, format hsx-sglang-dump/2, one file per request and prefill piece:
- which requests: those whose rid starts with RID_PREFIX (the client's), no others;
- names: `<rid_stem(rid)>.<offset:09d>.pt` (`dump_name`), or `<...>.failed` (`failed_name`): the
  marker the hook leaves, holding why the piece was not written;
- bytes: DUMP_HEAD (magic DUMP_MAGIC, then the JSON header's length), the JSON header, then each
  tensor of DUMP_TENSORS in that order at the next multiple of DUMP_ALIGN, the file ending with
  the last tensor's bytes. The header holds the fields `HEADER_FIELDS` and `tensors`: {name:
  {"dtype", "shape", "at"}};
- `finite` (FINITE_FIELD, since 2026-12-06, optional): true when the hook found no NaN/Inf in the
  piece's hidden_state and aux_hidden_state, false when it found one. Computed where the states
  are: on the GPU on the copy's side stream (`rows_finite`), over the device tensors the host copy
  reproduces; on the CPU path in the writer thread over the very tensors it writes next
  (`states_finite`). The client takes `true` as said and copies those states unchecked, refuses a
  piece said `false`, and checks every value of a piece without the field as it copies it
  (extraction/sglang/dump_states.py says why that is safe). So no format bump: a dump without the
  field (a hook deployed before 2026-12-06) is read the same way, only checked. FORMAT_V1 (a hook
  deployed before 2026-12-05, in a server not restarted since) is still read, by torch.load, its
  states checked by the publisher.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import re
import stat
import struct
from typing import Any

FORMAT = "hsx-sglang-dump/2"
FORMAT_V1 = "hsx-sglang-dump/1"  # a torch.save'd dict: what a hook deployed before 2026-12-05 writes
DUMP_MAGIC = b"HSXDUMP2"
DUMP_HEAD = struct.Struct("<8sQ")  # magic, then the JSON header's length in bytes
DUMP_ALIGN = 4096  # every tensor's bytes start at a multiple of it (page-aligned)
DUMP_TENSORS = ("input_ids", "hidden_state", "aux_hidden_state")  # in the file in this order
DUMP_DTYPES = ("bfloat16", "float16", "float32")  # the states' dtypes the reader accepts (ids: int64)
# The header's fields beside `tensors` (and FINITE_FIELD), each of its type.
HEADER_FIELDS: dict[str, type] = {
    "format": str,
    "rid": str,
    "offset": int,
    "seq_len": int,
    "layer_ids": list,
    "capture_owner": str,
    "sglang_version": str,
}
FINITE_FIELD = "finite"  # optional bool: the hook's NaN/Inf check of the piece's states
FAILED_SUFFIX = ".failed"
# Every rid our client sends starts with it ("hsx-<client token>-<sample>-<attempt>"): the hook dumps
# those requests only (SGLang's own, GET /health's HEALTH_CHECK_<hex> and the warm-up's, are no
# client's to read or remove), and the client's sweep (dumps.stale_names) touches no other name.
RID_PREFIX = "hsx-"
# A file of ours, created here or not at all: never through a link, never an existing FIFO.
NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
_SAFE_RID = re.compile(r"[A-Za-z0-9_.-]{1,128}")  # fullmatch: "$" would let a trailing newline in


def rid_stem(rid: str) -> str:
    """File-name-safe form of a request id (the reader uses the same function)."""
    if _SAFE_RID.fullmatch(rid) and not rid.startswith("."):
        return rid
    import hashlib

    return "rid-" + hashlib.sha256(rid.encode("utf-8")).hexdigest()[:32]


def dump_name(rid: str, offset: int) -> str:
    return f"{rid_stem(rid)}.{offset:09d}.pt"


def failed_name(rid: str, offset: int) -> str:
    """The marker the writer leaves when a piece could not be written (holds the reason)."""
    return f"{rid_stem(rid)}.{offset:09d}{FAILED_SUFFIX}"


def dump_dir_problem(directory: str, st: os.stat_result | None = None) -> str | None:
    """Why `directory` (or the directory whose stat is `st`) must not hold dumps, or None.

    The rule (the server's hook and the client apply the same): a directory that nobody but its
    owner and a trusted group can write. Refused: writable by others (S_IWOTH; a sticky bit does
    not help: others could still create the names we are about to use), and group-writable unless
    its group is the owner's own primary group or this process's effective group (the account the
    server or the job runs as). Anyone else who can write there could plant the files the server
    renames into place and the client reads and removes, possibly as root. The directory itself
    may be reached through a link (the operator's path); what it holds is judged, not the path."""
    try:
        st = os.stat(directory) if st is None else st
    except OSError as exc:
        return f"dump directory {directory} cannot be checked: {exc}"
    if not stat.S_ISDIR(st.st_mode):
        return f"dump directory {directory} is not a directory"
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH:
        who = "every user"
    elif mode & stat.S_IWGRP and st.st_gid not in _trusted_groups(st.st_uid):
        who = f"group {_name(st.st_gid, group=True)}"
    else:
        return None
    return (
        f"dump directory {directory} is writable by {who} (owner {_name(st.st_uid)}, group "
        f"{_name(st.st_gid, group=True)}, mode {mode:04o}): anyone there could plant files the server "
        f"and the client would use; make it the server account's own (chmod go-w {directory}, as "
        "roles/hsx makes /run/hsx-dumps: 0750) or use another dump directory"
    )


def _trusted_groups(owner: int) -> set[int]:
    """The groups whose write access to a dump directory is accepted (dump_dir_problem)."""
    groups = {os.getegid()}
    try:
        import pwd

        groups.add(pwd.getpwuid(owner).pw_gid)
    except (ImportError, KeyError):
        pass
    return groups


def _name(ident: int, group: bool = False) -> str:
    """A user or group id as 'name (id)', or the bare id where it has no name."""
    try:
        import grp
        import pwd

        name = grp.getgrgid(ident).gr_name if group else pwd.getpwuid(ident).pw_name
    except (ImportError, KeyError):
        return str(ident)
    return f"{name} ({ident})"


def rows_finite(hidden: Any, aux_parts: list[Any]) -> Any:
    """[rows] bool, True where no state of the row is NaN/Inf, on the states' device: from each
    row's largest and smallest value (amax/amin propagate NaN; +Inf is a largest, -Inf a smallest),
    two reductions that read the states once each and make [rows] results, no [rows, H] mask.
    The CUDA path's check (on the copy's side stream: nothing on the host); on the CPU
    states_finite is ~3x cheaper (0.13 s of one core a GiB of bf16 against 0.40-0.48 here)."""
    import torch

    ok = torch.isfinite(hidden.amax(-1)) & torch.isfinite(hidden.amin(-1))
    for part in aux_parts:
        ok &= torch.isfinite(part.amax(-1)) & torch.isfinite(part.amin(-1))
    return ok


# A float is NaN/Inf when its exponent bits are all ones: (integer dtype of its size, exponent mask).
_EXPONENT_BITS = {
    "bfloat16": ("int16", 0x7F80),
    "float16": ("int16", 0x7C00),
    "float32": ("int32", 0x7F800000),
}
_CHECK_BLOCK = 1 << 20  # bytes of rows checked at a time: they and the mask stay in the core's cache


def states_finite(hidden: Any, aux_parts: list[Any]) -> bool:
    """No NaN/Inf among the values of CPU tensors `hidden` and `aux_parts` (the header's
    FINITE_FIELD, on the CPU path). Each 2D tensor (any strides: a column slice of a wider buffer
    is read where it lies, not copied) is checked a block of rows (_CHECK_BLOCK bytes) at a time:
    its values' exponent bits masked into a reused scratch, then their max, in numpy (one thread:
    no OpenMP team spinning beside the server's). ~0.13 s of one core a GiB of bf16, where
    rows_finite (torch's amax/amin) took 0.40-0.48 (dev VM, K2.5-wide pieces). Anything else
    (another dtype or rank, not on the CPU, no numpy) goes to rows_finite."""
    try:
        import numpy
        import torch
    except ImportError:
        return bool(rows_finite(hidden, aux_parts).all())
    scratch = None
    for t in (hidden, *aux_parts):
        bits = _EXPONENT_BITS.get(str(t.dtype).removeprefix("torch."))
        if bits is None or t.dim() != 2 or t.device.type != "cpu":
            if not bool(rows_finite(t, []).all()):
                return False
            continue
        rows, width = int(t.shape[0]), int(t.shape[1])
        if not rows or not width:
            continue
        itype, mask = getattr(numpy, bits[0]), bits[1]
        values = t.detach().view(getattr(torch, bits[0])).numpy()  # the same memory, strides kept
        step = max(1, _CHECK_BLOCK // (width * t.element_size()))
        if scratch is None or scratch.nbytes < step * width * t.element_size():
            scratch = numpy.empty(step * width * t.element_size(), dtype=numpy.uint8)
        for start in range(0, rows, step):
            block = values[start : start + step]
            masked = scratch[: block.size * block.itemsize].view(itype).reshape(block.shape)
            numpy.bitwise_and(block, mask, out=masked)
            if int(masked.max()) == mask:
                return False
    return True


def nbytes(t: Any) -> int:
    """The bytes of tensor `t`'s elements."""
    return t.numel() * t.element_size()


def dump_aligned(n: int) -> int:
    """`n` rounded up to DUMP_ALIGN: where a dump's next tensor starts after `n` bytes."""
    return -(-n // DUMP_ALIGN) * DUMP_ALIGN


def dump_layout(
    header: dict[str, Any], specs: dict[str, tuple[str, list[int], int]]
) -> tuple[bytes, list[int]]:
    """The head of a dump (magic, header length, JSON header, zero padding) and each tensor's
    offset, for `specs` {name: (dtype name, shape, bytes)} in DUMP_TENSORS order. The header gains
    `tensors`: {name: {"dtype", "shape", "at"}}; each `at` is a multiple of DUMP_ALIGN and the file
    ends with the last tensor's bytes."""
    at = DUMP_ALIGN  # where the first tensor starts: the head rounded up, found in a pass or two
    while True:
        entries, offsets, pos = {}, [], at
        for name in DUMP_TENSORS:
            dtype, shape, size = specs[name]
            entries[name] = {"dtype": dtype, "shape": shape, "at": pos}
            offsets.append(pos)
            pos += dump_aligned(size)
        text = json.dumps({**header, "tensors": entries}, separators=(",", ":")).encode()
        need = dump_aligned(DUMP_HEAD.size + len(text))
        if need <= at:  # offsets only grow with `at`: this terminates
            head = DUMP_HEAD.pack(DUMP_MAGIC, len(text)) + text
            return head + bytes(at - len(head)), offsets
        at = need


def write_dump(path: str, header: dict[str, Any], tensors: tuple[Any, Any, list[Any]]) -> None:
    """Write one dump file (format hsx-sglang-dump/2) at `path`, created exclusively and never
    through a link: `tensors` = (input_ids, hidden_state, aux parts), CPU tensors of the same
    rows; the aux parts are written interleaved row by row, as their concatenation on the last
    dim would lie in memory, straight from where they are: one iovec per part and row, so no
    copy in user space and next to no Python while the server's threads want the GIL. A state
    whose rows are contiguous but not the tensor (a row view of a wider buffer) is written the
    same way, an iovec a row, not copied first."""
    import torch

    ids, hidden, parts = tensors
    rows = int(ids.shape[0])
    if any(p.dtype != parts[0].dtype or p.dim() != 2 or int(p.shape[0]) != rows for p in parts):
        raise ValueError("the aux parts differ in dtype or rows")
    if hidden.dim() != 2 or int(hidden.shape[0]) != rows:
        raise ValueError(f"hidden_state is {list(hidden.shape)}, not {rows} rows of a state")
    ids, hidden = ids.contiguous(), _rows_contiguous(hidden)
    parts = [_rows_contiguous(p) for p in parts]
    width = sum(int(p.shape[-1]) for p in parts)
    specs = {
        name: (str(t.dtype).removeprefix("torch."), [int(d) for d in t.shape], nbytes(t))
        for name, t in zip(DUMP_TENSORS[:2], (ids, hidden), strict=False)
    }
    specs[DUMP_TENSORS[2]] = (
        str(parts[0].dtype).removeprefix("torch."),
        [rows, width],
        sum(map(nbytes, parts)),
    )
    head, offsets = dump_layout(header, specs)
    zeros = _zeros()

    def pad(pos: int, at: int) -> list[tuple[int, int]]:
        return [(ctypes.addressof(zeros), at - pos)] if at > pos else []

    head_at = ctypes.cast(ctypes.c_char_p(head), ctypes.c_void_p).value or 0
    segments = [(head_at, len(head)), *pad(len(head), offsets[0]), (ids.data_ptr(), nbytes(ids))]
    segments += pad(offsets[0] + nbytes(ids), offsets[1])
    between = pad(offsets[1] + nbytes(hidden), offsets[2])
    # The table points into head, zeros and the tensors: all held here until the writes are done.
    iov = torch.cat(
        [
            torch.tensor(segments, dtype=torch.int64).view(-1, 2),
            _row_iovecs([hidden], rows),
            torch.tensor(between, dtype=torch.int64).view(-1, 2),
            _row_iovecs(parts, rows),
        ]
    )
    fd = os.open(path, NEW_FILE_FLAGS, 0o666)
    try:
        _writev_table(fd, iov)
    finally:
        os.close(fd)


def _rows_contiguous(t: Any) -> Any:
    """`t` itself when each of its rows is contiguous (what _row_iovecs writes from), else a copy."""
    return t if t.dim() == 2 and (t.stride(-1) == 1 or int(t.shape[-1]) <= 1) else t.contiguous()


def _row_iovecs(parts: list[Any], rows: int) -> Any:
    """[n, 2] int64 (address, length): the bytes of torch.cat(parts, dim=-1), in order, where they
    lie: row r of part 0, row r of part 1, ... (each part 2D, its rows contiguous, any row
    stride); one entry for a single contiguous part."""
    import torch

    if len(parts) == 1 and parts[0].is_contiguous():
        return torch.tensor([[parts[0].data_ptr(), nbytes(parts[0])]], dtype=torch.int64)
    lengths = torch.tensor([int(p.shape[-1]) * p.element_size() for p in parts], dtype=torch.int64)
    strides = torch.tensor([p.stride(0) * p.element_size() for p in parts], dtype=torch.int64)
    bases = torch.tensor([p.data_ptr() for p in parts], dtype=torch.int64)
    r = torch.arange(rows, dtype=torch.int64).unsqueeze(1)
    return torch.stack([bases + r * strides, lengths.expand(rows, len(parts))], dim=-1).reshape(-1, 2)


def _writev_table(fd: int, iov: Any) -> None:
    """Write what the iovec table `iov` ([n, 2] int64: address, length; struct iovec on 64-bit
    Linux) points at, in order: libc's writev through ctypes, which lets go of the GIL for the
    call, IOV_MAX entries a call; a short write resumes inside the entry it stopped in."""
    import torch

    writev = _libc_writev()
    i, n = 0, int(iov.shape[0])
    while i < n:
        count = min(_IOV_MAX, n - i)
        done = writev(fd, iov.data_ptr() + 16 * i, count)
        if done < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            raise OSError(err, os.strerror(err))
        ends = torch.cumsum(iov[i : i + count, 1], 0)
        if done == 0 and int(ends[-1]) > 0:
            raise OSError(errno.EIO, f"writev wrote nothing to fd {fd}")
        full = int(torch.searchsorted(ends, done, right=True))  # entries written whole
        if full < count:  # stopped inside entry i + full: start there next time
            inside = done - (int(ends[full - 1]) if full else 0)
            iov[i + full, 0] += inside
            iov[i + full, 1] -= inside
        i += full


_IOV_MAX = 1024  # Linux's UIO_MAXIOV


@functools.lru_cache(maxsize=1)
def _libc_writev() -> Any:
    if ctypes.sizeof(ctypes.c_void_p) != 8 or ctypes.sizeof(ctypes.c_size_t) != 8:
        raise OSError(errno.ENOSYS, "the dump writer needs a 64-bit platform")
    writev = ctypes.CDLL(None, use_errno=True).writev
    writev.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    writev.restype = ctypes.c_ssize_t
    return writev


@functools.lru_cache(maxsize=1)
def _zeros() -> Any:
    """DUMP_ALIGN zero bytes: the padding between a dump's tensors points here."""
    return (ctypes.c_ubyte * DUMP_ALIGN)()
