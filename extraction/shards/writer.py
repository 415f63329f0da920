"""Atomic shard publication: a final `.pt` name never points to a partial file.

Protocol per sample: temp name in the shard's own directory -> write -> fsync -> rename (write);
then, for one shard (publish) or a batch (commit): fsync each directory -> append their lines to the
index with one write (and fsync it). The bytes are torch.save's:
laid out directly by `torchzip` (checked byte for byte against this host's torch.save at start; the
tensors go to one writev from where they lie, the GIL released - or, a state left in the server's
dump files (extraction/shards/filebytes.py), copied from them through a small buffer while its
CRC32 is taken and, where it says so (`check`), its values are checked for NaN/Inf: a
ShardDataError for that sample, the temp removed; such a shard goes to the disk with O_DIRECT,
extraction/shards/direct.py) or, where that check fails, by torch.save itself. The index's checksum is the CRC32 of the whole file (the same bytes `full`
verification checksums). A crash at any point leaves either no final file, or a complete fsynced
one that the index may not list yet (the verifier reports it as unindexed). Temp names start with
'.' and end in '.tmp', so nothing that looks for `.pt` files ever sees one.

No link below OUTPUT is followed (hsx.fsutil): shards/ and each bucket are opened once, without
following a link (a link there is refused, naming it), and kept open; a shard's temp is created,
renamed and (on failure) unlinked relative to its bucket's fd, so a folder swapped for a link
meanwhile changes nothing about where the writer writes. OUTPUT itself is the operator's path.
"""

from __future__ import annotations

import errno
import io
import os
import threading
import zlib
from typing import Any

import torch

import hsx.fsutil
from extraction.shards import torchzip
from extraction.shards.direct import DirectSink
from extraction.shards.filebytes import FileBytes, NonFiniteBytes, in_memory
from hsx.fsutil import LinkRefused, open_dir_nofollow, open_subdir, unlink_quiet
from hsx.index import (
    IndexEntry,
    checksum_string,
    encode_index_line,
    index_record,
    open_index_for_append,
    read_index,
    write_index_bytes,
)
from hsx.layout import (
    INDEX_NAME,
    KEY_AUX,
    KEY_HIDDEN,
    KEY_INPUT_IDS,
    KEY_LOSS_MASK,
    MANIFEST_NAME,
    SHARDS_DIR,
    shard_relpath,
    temp_name,
)
from hsx.manifest import (
    DATASET_FIELDS,
    ManifestError,
    RunManifest,
    manifest_fingerprint,
    manifest_mismatches,
    mismatched_fields,
    read_manifest,
    write_manifest,
)

_DISK_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class DiskFullError(OSError):
    """The filesystem ran out of space (or quota) while publishing; nothing partial was left."""


class ShardDataError(ValueError):
    """The tensors handed to the writer do not fit the run (shape, length, dtype, NaN...)."""


class ManifestMismatchError(ManifestError):
    """The output directory belongs to a different run; `mismatches` says what differs."""

    def __init__(self, output_dir: str, mismatches: list[str], advice: str = ""):
        self.mismatches = mismatches
        super().__init__(f"{output_dir} holds a different run: " + "; ".join(mismatches) + advice)


_READ_CHUNK = 4 << 20  # read-back buffer for the checksum: zlib.crc32 releases the GIL above 5 KiB
_tls = threading.local()  # one reusable read-back buffer per writer thread


class _WriteErrorFile:
    """A write-only file wrapper that keeps the first OSError a write raised (torch wraps it)."""

    def __init__(self, f: Any):
        self.f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        """All of `data` (torch.save ignores a short write's count, and the temp file is
        unbuffered: a short write must be continued here, or bytes would go missing)."""
        view = memoryview(data).cast("B")
        try:
            while view:
                n = self.f.write(view)
                if not n:
                    raise OSError(errno.EIO, "a write wrote nothing")
                view = view[n:]
        except OSError as e:
            self.error = e
            raise
        return len(data) if isinstance(data, (bytes, bytearray)) else memoryview(data).nbytes

    def flush(self) -> None:
        self.f.flush()


def file_crc32(path: str, dir_fd: int | None = None) -> tuple[int, int]:
    """(size, CRC32) of a whole file: the index's checksum, as `full` verification computes it.
    `path` is relative to `dir_fd` when given; never opened through a link.

    Large chunks into a reused buffer; zlib.crc32 and the reads run with the GIL released, and
    the bytes of a file just written come from the page cache."""
    buf = getattr(_tls, "buf", None)
    if buf is None:
        buf = _tls.buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    crc = pos = 0
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | _NOFOLLOW, dir_fd=dir_fd)
    try:
        while True:
            n = os.preadv(fd, [view], pos)
            if n <= 0:
                return pos, crc
            crc = zlib.crc32(view[:n], crc)
            pos += n
    finally:
        os.close(fd)


def _is_disk_full(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL_ERRNOS:
            return True
        if "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def _read_checked(t: torch.Tensor | FileBytes, key: str) -> torch.Tensor:
    """`t` in memory (a FileBytes read, its values checked where it says so: NonFiniteBytes
    naming `key`)."""
    try:
        return in_memory(t)
    except NonFiniteBytes as e:
        e.key = key
        raise


def _on_cpu(t: torch.Tensor | FileBytes, dtype: torch.dtype) -> torch.Tensor | FileBytes:
    """A contiguous CPU tensor of `dtype`: `t` itself (or a view) when it already is one; a
    FileBytes (build_payload kept it: of `dtype`) as it is."""
    if isinstance(t, FileBytes):
        return t
    return t.detach().to(device="cpu", dtype=dtype).contiguous()


# A shard whose states come from files (the sglang client) is written with O_DIRECT from an aligned
# buffer: its bytes skip the page cache (extraction/shards/direct.py says why). False: buffered.
DIRECT_IO = True
_STREAM_RECORD_MAX = (1 << 32) - (1 << 24)  # a FileBytes this large or larger goes through memory


def _batch_of_one(t: torch.Tensor | FileBytes) -> torch.Tensor | FileBytes:
    """[L, W] -> [1, L, W]."""
    return t.reshaped((1, *t.shape)) if isinstance(t, FileBytes) else t.unsqueeze(0)


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A tensor that owns exactly its bytes (torch.save writes whole storages)."""
    if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def _write_pieces(f: Any, pieces: list[Any], wrapper: _WriteErrorFile, real_file: bool) -> None:
    """Write every piece in order: on a real file by writev (one call for a run of pieces, GIL
    released); else through the file object (a test's wrapper), keeping the OSError a write raised."""
    if not real_file:
        wrapper.f = f
        for piece in pieces:
            wrapper.write(piece)
        return
    writev_all(f.fileno(), [memoryview(piece) for piece in pieces], f.name)


def _write_steps(f: Any, layout: torchzip.TorchZipLayout, payload: dict[str, Any]) -> tuple[int, int]:
    """Write torch.save(payload)'s file as the layout's steps give it (a payload with FileBytes),
    each FileBytes copied from its files while its CRC32 is taken (the records after it need it):
    through a DirectSink (O_DIRECT from an aligned buffer: extraction/shards/direct.py) where
    DIRECT_IO is on, else runs of pieces by writev; (size, CRC32 of the file)."""
    fd, run, crc = f.fileno(), [], None
    sink = DirectSink(fd) if DIRECT_IO else None
    steps = layout.steps(payload)
    try:
        while True:
            piece = steps.send(crc)
            if isinstance(piece, FileBytes):
                if sink is None:
                    writev_all(fd, run, f.name)
                    run = []
                try:
                    crc = piece.copy_to(fd if sink is None else sink, layout.crc32)
                except NonFiniteBytes as e:  # the key, for write()'s message
                    e.key = next((k for k, v in payload.items() if v is piece), None)
                    raise
            else:
                if sink is None:
                    run.append(memoryview(piece))
                else:
                    sink.put(piece)
                crc = None if isinstance(piece, bytes) else layout.crc32(piece)
    except StopIteration as stop:
        if sink is None:
            writev_all(fd, run, f.name)
        else:
            sink.finish()
        return stop.value


def writev_all(fd: int, views: list[Any], name: str = "") -> None:
    """Every view, in order, to `fd` (writev, 512 at a time, resuming after a short write)."""
    views = [memoryview(v) for v in views if len(v)]
    i = 0
    while i < len(views):
        n = os.writev(fd, views[i : i + 512])
        if n <= 0:
            raise OSError(errno.EIO, f"writev wrote nothing to {name or fd}")
        while n and i < len(views):  # a short write: go on from where it stopped
            if n >= len(views[i]):
                n -= len(views[i])
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0


class ShardWriter:
    """Publishes one shard per sample into an output directory, crash-safely.

    On construction it writes run.json (or, with defer_manifest, leaves it to commit_manifest()),
    or checks an existing one (ManifestMismatchError when it differs). `publish` may be called from one background thread; the index append is
    locked so a second thread would also be safe.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        manifest: RunManifest,
        *,
        check_finite: bool = True,
        fsync_index: bool = True,
        defer_manifest: bool = False,
    ):
        self.output_dir = os.fspath(output_dir)
        self.manifest = manifest
        self.check_finite = check_finite
        self.fingerprint = manifest_fingerprint(manifest.to_dict())  # in every index line
        self.fsync_index = fsync_index
        self._dtype = getattr(torch, manifest.dtype)
        self._lock = threading.Lock()
        # Kept open for the writer's life, so a shard costs no open/close of its folder (for the
        # directory fsync) or of the index (for the append): each system call is also a moment
        # where a writer thread gives the GIL away and waits to take it back from the forward pass.
        # shards/ and each bucket are opened without following a link (module docstring).
        self._shards_fd: int | None = None
        self._dir_fds: dict[str, int] = {}
        self._index_fd: int | None = None
        # torch.save's bytes laid out directly, when they match this host's torch byte for byte.
        self._layout, self.write_mode = torchzip.layout_for(self._dtype)  # (None, why) if not
        os.makedirs(self.output_dir, exist_ok=True)  # OUTPUT itself: the operator's path
        self._open_shards()  # refused here when shards/ is a link: before anything is written
        index = os.path.join(self.output_dir, INDEX_NAME)
        if os.path.islink(index):  # the runner reads and mends the index before its first append
            raise LinkRefused(index)
        if os.path.exists(os.path.join(self.output_dir, MANIFEST_NAME)):
            existing = read_manifest(self.output_dir)
            mismatches = manifest_mismatches(existing, manifest)
            if mismatches:
                self._take_another_dataset(existing, mismatches)
        elif not defer_manifest:
            write_manifest(self.output_dir, manifest)
        # A new output's run.json, left to commit_manifest() (defer_manifest): the runner writes it
        # once the run can start, so a start that fails leaves no run.json to refuse the next one.
        self.manifest_pending = defer_manifest and not os.path.exists(os.path.join(self.output_dir, MANIFEST_NAME))

    def commit_manifest(self) -> None:
        """Write the run.json that construction deferred (defer_manifest, a new output); else nothing."""
        if self.manifest_pending:
            write_manifest(self.output_dir, self.manifest)
            self.manifest_pending = False

    def _take_another_dataset(self, existing: RunManifest, mismatches: list[str]) -> None:
        """run.json rewritten for this run when only the dataset differs and the output holds no
        sample yet (every row of the first run was an error: none is a result); else
        ManifestMismatchError, saying what to do when the dataset is what changed."""
        fields = mismatched_fields(existing, self.manifest)
        dataset = [name for name in fields if name in DATASET_FIELDS]
        if not dataset:
            raise ManifestMismatchError(self.output_dir, mismatches)
        done = len(read_index(self.output_dir).entries)
        if done == 0 and dataset == fields:
            write_manifest(self.output_dir, self.manifest)
            return
        raise ManifestMismatchError(
            self.output_dir,
            mismatches,
            f"; it holds {done} samples extracted from another version of the dataset: run with the "
            "dataset it was started with, or extract this one into another --output (rows fixed "
            "since, those errors.jsonl lists, can go in a file of their own and another --output)",
        )

    @property
    def writes_directly(self) -> bool:
        """True when shards are laid out by torchzip; False when torch.save writes them."""
        return self._layout is not None

    # -- start-up ---------------------------------------------------------------------------
    def remove_orphan_temps(self) -> int:
        """Delete temp files left by a crashed writer; returns how many. Call before publishing."""
        return remove_orphan_temps(self.output_dir)

    # -- publishing -------------------------------------------------------------------------
    def build_payload(
        self,
        sample_id: str,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        hidden_state: torch.Tensor | FileBytes,
        aux_hidden_state: torch.Tensor | FileBytes,
    ) -> dict[str, Any]:
        """The SpecForge-compatible dict, checked against the run (ShardDataError if it does not fit).
        A state given as FileBytes stays one (copied into the shard as it is written) where the
        shard is laid out by torchzip in the run's dtype; else it is read into memory here."""
        m = self.manifest
        hidden_state, aux_hidden_state = (
            t if self._stays_in_file(t) else _read_checked(t, key)
            for t, key in ((hidden_state, KEY_HIDDEN), (aux_hidden_state, KEY_AUX))
        )
        if hidden_state.dim() == 2:
            hidden_state = _batch_of_one(hidden_state)
        if aux_hidden_state.dim() == 2:
            aux_hidden_state = _batch_of_one(aux_hidden_state)
        ids = input_ids.reshape(-1) if input_ids.dim() == 2 and input_ids.shape[0] == 1 else input_ids
        mask = loss_mask.reshape(-1) if loss_mask.dim() == 2 and loss_mask.shape[0] == 1 else loss_mask
        length = ids.shape[0] if ids.dim() == 1 else -1
        want = {
            KEY_INPUT_IDS: (length,),
            KEY_LOSS_MASK: (length,),
            KEY_HIDDEN: (1, length, m.hidden_size),
            KEY_AUX: (1, length, m.num_aux * m.hidden_size),
        }
        got = {
            KEY_INPUT_IDS: tuple(ids.shape),
            KEY_LOSS_MASK: tuple(mask.shape),
            KEY_HIDDEN: tuple(hidden_state.shape),
            KEY_AUX: tuple(aux_hidden_state.shape),
        }
        if length < 1 or got != want:
            raise ShardDataError(f"sample {sample_id!r}: tensor shapes {got} do not match the run {want}")
        if self.check_finite:
            for key, t in ((KEY_HIDDEN, hidden_state), (KEY_AUX, aux_hidden_state)):
                if not bool(torch.isfinite(in_memory(t)).all()):
                    raise ShardDataError(f"sample {sample_id!r}: {key} has NaN or Inf values")
        return {
            KEY_INPUT_IDS: _on_cpu(ids, torch.int64),
            KEY_LOSS_MASK: _on_cpu(mask, torch.int64),
            KEY_HIDDEN: _on_cpu(hidden_state, self._dtype),
            KEY_AUX: _on_cpu(aux_hidden_state, self._dtype),
        }

    def _stays_in_file(self, t: torch.Tensor | FileBytes) -> bool:
        """A FileBytes the shard can take as it is: torchzip lays the shard out, the dtype is the
        run's, and the record needs no zip64 (torch.save writes those, from memory)."""
        return (
            isinstance(t, FileBytes)
            and self._layout is not None
            and t.dtype == self._dtype
            and t.nbytes < _STREAM_RECORD_MAX
        )

    def publish(
        self,
        sample_id: str,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        hidden_state: torch.Tensor | FileBytes,
        aux_hidden_state: torch.Tensor | FileBytes,
        num_tokens: int | None = None,
    ) -> IndexEntry:
        """Write one sample's shard atomically and record it in the index; returns its entry.

        hidden_state may be [L, H] or [1, L, H]; aux_hidden_state [L, k*H] or [1, L, k*H].
        Raises ShardDataError (nothing written) or DiskFullError (nothing left behind).
        """
        entry = self.write(sample_id, input_ids, loss_mask, hidden_state, aux_hidden_state, num_tokens)
        self.commit([entry])
        return entry

    def write(
        self,
        sample_id: str,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        hidden_state: torch.Tensor | FileBytes,
        aux_hidden_state: torch.Tensor | FileBytes,
        num_tokens: int | None = None,
    ) -> IndexEntry:
        """publish's first half: the shard complete and fsynced under its final name, not yet in
        the index (a crash now leaves an unindexed shard, which resume redoes). commit() makes a
        batch of them durable and done with one index write: the runner commits once per batch.
        """
        relpath = shard_relpath(sample_id)
        final = os.path.join(self.output_dir, relpath)
        try:
            payload = self.build_payload(sample_id, input_ids, loss_mask, hidden_state, aux_hidden_state)
            self._ensure_dir(os.path.dirname(final))
            size, crc = self._write_atomically(payload, final)
        except NonFiniteBytes as e:  # a state checked as it was copied (or read): nothing left
            raise ShardDataError(
                f"sample {sample_id!r}: {e.key or 'a state'} has NaN or Inf values: {e}"
            ) from None
        return IndexEntry(
            sample_id=sample_id,
            path=relpath,
            size=size,
            checksum=checksum_string(crc),
            num_tokens=int(num_tokens if num_tokens is not None else payload[KEY_INPUT_IDS].shape[0]),
            fingerprint=self.fingerprint,
        )

    def commit(self, entries: list[IndexEntry]) -> None:
        """Make written shards done: fsync each folder their renames changed, then append their
        index lines with one write and one fsync. On failure every one of them is taken back
        (unlinked: not indexed = not done, and disk and index agree); DiskFullError if the disk
        is full."""
        if not entries:
            return
        finals = [os.path.join(self.output_dir, e.path) for e in entries]
        indexed = False
        try:
            for directory in dict.fromkeys(map(os.path.dirname, finals)):
                os.fsync(self._ensure_dir(directory))
            data = b"".join(encode_index_line(index_record(e)) for e in entries)
            with self._lock:
                if self._index_fd is None:
                    self._index_fd = open_index_for_append(self.output_dir)
                write_index_bytes(self._index_fd, data, fsync=self.fsync_index)
                indexed = True
        except BaseException as e:
            if indexed:  # done and durable (an interrupt landed after it): keep them
                raise
            for final in finals:
                directory = os.path.dirname(final)
                fd = self._dir_fds.get(directory)
                if fd is not None:  # relative to the bucket the shard was written into
                    unlink_quiet(os.path.basename(final), dir_fd=fd)
            if isinstance(e, OSError) and _is_disk_full(e):
                ids = ", ".join(repr(entry.sample_id) for entry in entries[:3])
                raise DiskFullError(e.errno, f"disk full while indexing {ids}: {e}") from e
            raise

    def close(self) -> None:
        """Close the folder and index descriptors kept open (publishing again reopens them)."""
        with self._lock:
            fds = [
                *self._dir_fds.values(),
                *(fd for fd in (self._index_fd, self._shards_fd) if fd is not None),
            ]
            self._dir_fds, self._index_fd, self._shards_fd = {}, None, None
        for fd in fds:
            os.close(fd)

    def __del__(self) -> None:
        if getattr(self, "_lock", None) is not None:
            self.close()

    def _open_shards(self) -> int:
        """OUTPUT/shards, created if need be, opened without following a link: its fd, kept open."""
        fd = self._shards_fd
        if fd is None:
            fd = open_dir_nofollow(self.output_dir, SHARDS_DIR, create=True)
            with self._lock:
                if self._shards_fd is None:
                    self._shards_fd = fd
                else:  # another writer thread won
                    os.close(fd)
                    fd = self._shards_fd
        return fd

    def _ensure_dir(self, directory: str) -> int:
        """The shard folder (OUTPUT/shards/<bucket>), created (and its parent fsynced) if need be,
        opened without following a link: its fd, kept open. A shard's temp is created, renamed and
        unlinked relative to it: one open per bucket, not per shard."""
        fd = self._dir_fds.get(directory)
        if fd is not None:
            return fd
        try:
            fd = open_subdir(self._open_shards(), os.path.basename(directory), directory, create=True)
        except OSError as e:
            if _is_disk_full(e):
                raise DiskFullError(e.errno, f"disk full creating {directory}: {e}") from e
            raise
        kept = self._dir_fds.setdefault(directory, fd)  # another writer thread may have won
        if kept != fd:
            os.close(fd)
        return kept

    def _open_temp(self, path: str) -> Any:
        """Opened exclusively, unbuffered (pieces go to one writev; no isatty/lseek a buffered
        file costs), relative to its bucket's fd and never through a link; a seam tests use to
        inject write errors."""
        dir_fd, name = self._ensure_dir(os.path.dirname(path)), os.path.basename(path)
        return open(
            path,
            "xb",
            buffering=0,
            opener=lambda _p, flags: os.open(name, flags | _NOFOLLOW, 0o666, dir_fd=dir_fd),
        )

    def _write_atomically(self, payload: dict[str, Any], final: str) -> tuple[int, int]:
        """temp -> write -> fsync -> rename (commit fsyncs the folder); (size, CRC32 of the file)."""
        directory, name = os.path.split(final)
        dir_fd = self._ensure_dir(directory)  # write() opened it: a dict lookup
        tmp_name = temp_name(name)
        tmp = os.path.join(directory, tmp_name)
        wrapper = _WriteErrorFile(None)  # keeps the OSError of a write through a file object
        try:
            streamed = any(isinstance(t, FileBytes) for t in payload.values())
            encoded = None if streamed else self._encode(payload)
            with self._open_temp(tmp) as f:
                if streamed and _is_real_file(f, tmp):
                    size, crc = _write_steps(f, self._layout, payload)
                else:
                    if streamed:  # a test's wrapper file: the states read into memory first
                        payload = {k: in_memory(t) for k, t in payload.items()}
                        encoded = self._encode(payload)
                    if encoded is not None:
                        _write_pieces(f, encoded.pieces, wrapper, _is_real_file(f, tmp))
                    else:
                        wrapper.f = f
                        torch.save({k: _owned(t) for k, t in payload.items()}, wrapper)
                f.flush()
                os.fsync(f.fileno())
            if not streamed or encoded is not None:
                # After torch.save the checksum is the CRC32 of the bytes on disk, read back (page cache).
                size, crc = (encoded.size, encoded.crc) if encoded is not None else file_crc32(tmp_name, dir_fd)
            os.replace(tmp_name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException as e:
            unlink_quiet(tmp_name, dir_fd=dir_fd)
            cause = wrapper.error if wrapper.error is not None else e
            if _is_disk_full(cause) or _is_disk_full(e):
                code = getattr(cause, "errno", None) or errno.ENOSPC
                raise DiskFullError(code, f"disk full while writing {final}: {cause}") from e
            raise
        return size, crc

    def _encode(self, payload: dict[str, torch.Tensor]) -> torchzip.Encoded | None:
        """The shard's bytes as pieces, or None where torch.save must write it (no checked
        layout on this host, a record past 4 GiB, a dtype without a storage name)."""
        if self._layout is None:
            return None
        try:
            return self._layout.encode(payload)
        except (ValueError, KeyError):  # beyond 4 GiB, or a dtype the layout was not checked for
            return None


def _is_real_file(f: Any, path: str) -> bool:
    """`f` is the plain file just opened at `path` (not a test's wrapper or another file)."""
    return isinstance(f, io.FileIO) and getattr(f, "name", None) == path


def remove_orphan_temps(output_dir: str | os.PathLike[str]) -> int:
    """Delete writer temp files under OUTPUT (root and shards/); returns how many were removed."""
    return len(hsx.fsutil.remove_orphan_temps(os.fspath(output_dir)))
