"""The batch log: OUTPUT/batches.jsonl, which batch each shard's states were computed in.

Why: a state depends on the batch it was computed in (its padding and shape pick other kernels:
on an H100 a bf16 sample alone differs from the same sample in its batch of 8 by up to 56% of the
state's scale, docs/benchmarks.md "Canary"), so the canary (extraction/canary/) can only demand
bit-equal states if it re-runs a sample's ORIGINAL batch. This log says what that batch was.

Contract (writer, `BatchLog`, the runner's forward thread; the hf backend only - SGLang's server
makes its own batches, which no client can rebuild):
- One line per batch the forward ran, appended (O_APPEND, never through a link) BEFORE the batch
  goes to the publisher, so a batch's line is in the file before any of its index lines:
  `encode_index_line`'s format (compact JSON, a tab, the CRC32 of the JSON, a newline) with
  `{"v": 1, "batch": <16 hex: batch_id(ids, lens)>, "ids": [sample ids in row order], "lens": [their
  token counts], "wrote": [rows whose shards this batch publishes], "device": "cpu" | "cuda:0" | ...,
  "threads": torch threads on a CPU device, else null}`. The hf backend right-pads every row to
  max(lens): ids + lens are the batch's whole shape. A batch retried sample by sample
  (runner/forward.py) writes one line per sample that ran alone.
- No fsync per line (the forward thread never waits on the disk for it); close() fsyncs. A crash
  can lose the last lines: a sample with no line is checked the old way (alone, within a bound)
  and the canary says so. A torn last line is ended with a newline on open (as the index's), so
  the next line is not glued to it. A write that fails is logged once and the log stops; the run
  goes on (the log is for the canary, never for the shards).
Reader (`read_batch_log`, the canary): data we did not necessarily write. A line whose CRC fails
(a crash's torn line) is skipped and counted; a line whose CRC holds but whose record is not one
this writer writes is a BatchLogError naming the file and the line. `last_batches(records)` maps a
sample to the LAST line that published it (later lines win, as in the index).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hsx.fsutil import nofollow_opener, open_nofollow, read_nofollow
from hsx.index import encode_index_line, parse_index_line

BATCHES_NAME = "batches.jsonl"
VERSION = 1
_BATCH_ID = re.compile(r"\A[0-9a-f]{16}\Z")
_KEYS = {"v", "batch", "ids", "lens", "wrote", "device", "threads"}


class BatchLogError(ValueError):
    """A line of the batch log that this writer did not write (the message names file and line)."""


def batch_id(ids: list[str], lens: list[int]) -> str:
    """The batch's id: 16 hex of the sha256 of its rows (ids and token counts, in order). The same
    planned batch re-run by a resume gets the same id: it is the same batch."""
    body = json.dumps([ids, lens], separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(body.encode("ascii")).hexdigest()[:16]


@dataclass(frozen=True)
class BatchRecord:
    """One line of the batch log, validated."""

    batch: str
    ids: tuple[str, ...]
    lens: tuple[int, ...]
    wrote: tuple[int, ...]
    device: str
    threads: int | None
    line: int  # from 1

    @property
    def width(self) -> int:
        """The padded length of every row (the hf backend right-pads to the longest)."""
        return max(self.lens)

    def row_of(self, sample_id: str) -> int:
        return self.ids.index(sample_id)


def batch_line(ids: list[str], lens: list[int], wrote: list[int], device: str, threads: int | None) -> bytes:
    """One encoded line of the log (see the module's contract)."""
    record = {
        "v": VERSION,
        "batch": batch_id(ids, lens),
        "ids": ids,
        "lens": lens,
        "wrote": wrote,
        "device": device,
        "threads": threads,
    }
    return encode_index_line(record)


class BatchLog:
    """The writer (see the module's contract). Use from one thread (the forward's)."""

    def __init__(self, output: str, device: str, log: Callable[[str], None]):
        self.path = os.path.join(output, BATCHES_NAME)
        self.device, self.log = device, log
        self.fd: int | None = None
        try:
            _end_torn_line(self.path)
            self.fd = open_nofollow(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            self._failed(e)

    def record(self, rows: Iterable[tuple[str, int]], wrote: set[str], threads: int | None) -> None:
        """A batch the forward ran: (sample id, tokens) per row in order; `wrote`: the ids it publishes."""
        if self.fd is None:
            return
        rows = list(rows)
        ids = [sid for sid, _ in rows]
        data = batch_line(ids, [n for _, n in rows], [i for i, sid in enumerate(ids) if sid in wrote], self.device, threads)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as e:
            self._failed(e)

    def close(self) -> None:
        """fsync and close (idempotent); a failure is logged."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            os.fsync(fd)
        except OSError as e:
            self.log(f"cannot fsync {self.path}: {e.strerror or e} (the canary checks samples without a line alone)")
        finally:
            os.close(fd)

    def _failed(self, e: OSError) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.log(
            f"cannot write {self.path}: {e.strerror or e}; batch membership is not recorded from here on "
            "(the canary checks such samples alone, within a bound)"
        )


def _end_torn_line(path: str) -> None:
    """End a torn last line with a newline (runner/resume.py end_torn_index_line's rule)."""
    try:
        with open(path, "rb+", opener=nofollow_opener) as f:
            if f.seek(0, os.SEEK_END) == 0:
                return
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
    except FileNotFoundError:
        return


@dataclass
class BatchLogState:
    """The log read back: its valid records, and the lines skipped as torn or damaged."""

    path: str
    records: list[BatchRecord]
    damaged: list[tuple[int, str]]  # (line from 1, why): CRC or framing failed (a crash's torn line)
    present: bool  # False: no batches.jsonl (an output written before batch recording)


def read_batch_log(output: str) -> BatchLogState:
    """OUTPUT/batches.jsonl read back and validated (see the module's contract); never through a
    link (hsx.fsutil.LinkRefused, an OSError naming it). BatchLogError for a line with a valid CRC
    that is not a record of this writer."""
    path = os.path.join(output, BATCHES_NAME)
    try:
        data = read_nofollow(path)
    except FileNotFoundError:
        return BatchLogState(path, [], [], False)
    records, damaged = [], []
    for n, line in enumerate(data.splitlines(keepends=True), start=1):
        record, why = parse_index_line(line)
        if record is None:
            if why.endswith("(torn)") or why.endswith("(damaged)"):
                damaged.append((n, why))
                continue
            raise BatchLogError(f"{path} line {n}: {why}")
        try:
            records.append(_validate(record, n))
        except ValueError as e:
            raise BatchLogError(f"{path} line {n}: {e}") from None
    return BatchLogState(path, records, damaged, True)


def _validate(r: dict, line: int) -> BatchRecord:
    """A decoded record as this writer writes it, else ValueError saying what is wrong."""
    if set(r) != _KEYS:
        raise ValueError(f"not a batch record (keys {sorted(r)[:8]}, expected {sorted(_KEYS)})")
    if r["v"] != VERSION or type(r["v"]) is not int:
        raise ValueError(f"version {r['v']!r}, this hsx reads {VERSION}")
    ids, lens, wrote = r["ids"], r["lens"], r["wrote"]
    if not isinstance(ids, list) or not ids or not all(isinstance(s, str) and s for s in ids):
        raise ValueError("ids is not a non-empty list of sample ids")
    if len(set(ids)) != len(ids):
        raise ValueError("ids names a sample twice")
    if not isinstance(lens, list) or len(lens) != len(ids) or not all(type(n) is int and n >= 1 for n in lens):
        raise ValueError(f"lens is not {len(ids)} token counts >= 1")
    if not isinstance(wrote, list) or not all(type(i) is int and 0 <= i < len(ids) for i in wrote):
        raise ValueError(f"wrote is not a list of rows 0..{len(ids) - 1}")
    if len(set(wrote)) != len(wrote):
        raise ValueError("wrote names a row twice")
    if not isinstance(r["device"], str) or not r["device"]:
        raise ValueError("device is not a device name")
    threads = r["threads"]
    if threads is not None and not (type(threads) is int and threads >= 1):
        raise ValueError(f"threads is {threads!r}, not a count >= 1 or null")
    if not isinstance(r["batch"], str) or not _BATCH_ID.fullmatch(r["batch"]):
        raise ValueError("batch is not 16 hex digits")
    if r["batch"] != batch_id(ids, lens):
        raise ValueError(f"batch {r['batch']} is not the id of its rows ({batch_id(ids, lens)})")
    return BatchRecord(r["batch"], tuple(ids), tuple(lens), tuple(wrote), r["device"], threads, line)


def last_batches(records: Iterable[BatchRecord]) -> dict[str, BatchRecord]:
    """Sample id -> the last record that published it (its `wrote`): the batch its shard holds."""
    found: dict[str, BatchRecord] = {}
    for rec in records:
        for row in rec.wrote:
            found[rec.ids[row]] = rec
    return found
