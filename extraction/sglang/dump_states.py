"""A dump's states left in its file: FileBytes the shard writer copies from the dump's descriptor.

The client never maps a dump and, on this path, never reads its states into memory of its own:
they become FileBytes (extraction/shards/filebytes.py) over the piece's open descriptor, and the
shard writer copies them with pread straight into its O_DIRECT staging buffer (one copy; the
CRC32 the zip records need taken there) and hands them to the disk. A dump that shrinks under the
copy gives a short read: a DumpError for that sample naming the file, the byte and its size when
opened, the shard's temp removed; never a SIGBUS (pread semantics, as #38 asked).

NaN/Inf: who checks what (#49 item 6). The hook computes `finite` where the states are (on the
GPU, on the copy's side stream, over the device tensors the host copy reproduces bit for bit; on
the CPU path in its writer thread, over the very tensors it writes next) and records it in the
header (hsx_dump_format.FINITE_FIELD). The client takes `true` as said and copies those states
unchecked. Why that is safe:
- the hook is inside the client's trust boundary already: it writes every value the shard gets,
  and the client cannot check those values against anything (a hook that wrote another layer's
  states, or garbage, would pass any check made here). Its finiteness flag is one more value from
  the same code, computed on the same bytes;
- nobody outside that boundary can change a dump: the directory is writable only by its owner
  and a trusted group (hsx_dump_format.dump_dir_problem, refused at both ends), the reader opens
  without following a link, only regular files, and checks the header against the file's size
  (dump_piece.py). Whoever could rewrite a dump after the rename (root, the server's account)
  could write any finite values as well, so a NaN check would not stop them;
- a file that changes size under the copy is a DumpError (above), so no bytes but the file's reach
  the shard;
- `hsx verify --level deep` still checks every value of every published shard (a NaN let through
  by a bug in the hook is found there, not in training).
A header without the field (a hook deployed before 2026-12-06) gives no such claim: those states
are checked as they are copied (`check`: a masked max over the exponent bits of each 1 MiB chunk,
~0.07 s of one core a GiB; NonFiniteBytes -> the sample's ShardDataError naming the file and the
byte). `false` never comes here: the piece is read into memory (dump_memory.py) and the
publisher's check refuses it. Checking every value again here cost the client ~0.07-0.12 CPU-s a
GiB on top of the copy's ~0.3 (tests/bench/bench_dump_copy.py: copy_check vs buffer_pass) and
bought nothing the trust boundary does not already give.

Why not sendfile/copy_file_range from the dump's descriptor: the zip records need the states'
CRC32 before the records after them, so the bytes pass through user space anyway (or a CRC from
the hook, a second pass over the states on the GPU host's CPU); a shard's records start at 64-byte
boundaries (torch.save's layout), so an in-kernel copy cannot go to the disk with O_DIRECT and
would pass through the page cache (on the loaded dev VM 2.8 CPU-s a GiB buffered against 0.04
direct); and Linux refuses copy_file_range from a tmpfs dump to a disk shard (EXDEV). pread into
the staging buffer keeps both properties the issue asks for (pread semantics, nothing non-finite
unnoticed) at the lowest cost measured.

Contract:
- `leave_in_file(path, fd, size, specs, finite)`: {name: FileBytes} for the states of specs
  {name: (dtype, shape, at)} (STATE_KEYS), each one span of the file, checked as copied unless
  `finite` is True; and the OpenFile that now owns `fd` (closed with its last holder). On an
  exception (a DumpError) `fd` is still the caller's to close.
- `join(parts)`: FileBytes of several pieces' spans in row order, nothing read; checked where any
  piece is.
"""

from __future__ import annotations

from extraction.sglang.dump_errors import DumpError
from extraction.sglang.dump_memory import nbytes
from extraction.shards.filebytes import EXPONENT_MASKS, FileBytes, OpenFile

STATE_KEYS = ("hidden_state", "aux_hidden_state")  # the tensors a piece may leave in its file


def leave_in_file(
    path: str, fd: int, size: int, specs: dict, finite: bool | None
) -> tuple[dict[str, FileBytes], OpenFile]:
    """The piece's states as FileBytes over `fd` (see the module's contract)."""
    check = finite is not True
    for name in STATE_KEYS:  # what FileBytes refuses, refused before the OpenFile takes `fd` over
        if check and specs[name][0] not in EXPONENT_MASKS:
            raise DumpError(f"{path}: no NaN/Inf check for {name} of {specs[name][0]}")
    # From here nothing can fail: were a FileBytes refused after the OpenFile took `fd`, both its
    # finalizer and the caller would close it, the second time whatever file got the number since.
    kept = OpenFile(fd, path, size)
    states = {
        name: FileBytes(dtype, tuple(shape), ((kept, at, nbytes(dtype, shape)),), DumpError, check=check)
        for name, (dtype, shape, at) in ((n, specs[n]) for n in STATE_KEYS)
    }
    return states, kept


def join(parts: list[FileBytes]) -> FileBytes:
    """The pieces' spans in row order: one FileBytes, still nothing read."""
    if len(parts) == 1:
        return parts[0]
    rows = sum(int(p.shape[0]) for p in parts)
    spans = tuple(span for p in parts for span in p.spans)
    check = any(p.check for p in parts)
    return FileBytes(parts[0].dtype, (rows, *parts[0].shape[1:]), spans, DumpError, check=check)
