"""Atomic shard publication: a final `.pt` name never points to a partial file.

Protocol per sample: temp name in the shard's own directory -> torch.save -> fsync -> rename
-> fsync the directory -> append one line to the index (and fsync it). The index's checksum is
the CRC32 of the whole file, read back after the fsync (the same bytes `full` verification
checksums); torch.save writes by path, so its C++ writer does not hold the GIL. A crash at any point
leaves either no final file, or a complete fsynced one that the index may not list yet (the
verifier reports it as unindexed). Temp names start with '.' and end in '.tmp', so nothing
that looks for `.pt` files ever sees one.
"""

from __future__ import annotations

import atexit
import errno
import gc
import io
import os
import shutil
import tempfile
import threading
import zlib
from typing import Any

import torch

from extraction.shards import format as fmt
from extraction.shards.format import IndexEntry, ManifestError
from extraction.shards.manifest import RunManifest, manifest_mismatches, read_manifest, write_manifest

_DISK_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


class DiskFullError(OSError):
    """The filesystem ran out of space (or quota) while publishing; nothing partial was left."""


class ShardDataError(ValueError):
    """The tensors handed to the writer do not fit the run (shape, length, dtype, NaN...)."""


class ManifestMismatchError(ManifestError):
    """The output directory belongs to a different run; `mismatches` says what differs."""

    def __init__(self, output_dir: str, mismatches: list[str]):
        self.mismatches = mismatches
        super().__init__(f"{output_dir} holds a different run: " + "; ".join(mismatches))


_READ_CHUNK = 4 << 20  # read-back buffer for the checksum: zlib.crc32 releases the GIL above 5 KiB
_tls = threading.local()  # one reusable read-back buffer per writer thread


class _WriteErrorFile:
    """A write-only file wrapper that keeps the first OSError a write raised (torch wraps it)."""

    def __init__(self, f: Any):
        self.f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def file_crc32(path: str) -> tuple[int, int]:
    """(size, CRC32) of a whole file: the index's checksum, as `full` verification computes it.

    Large chunks into a reused buffer; zlib.crc32 and the reads run with the GIL released, and
    the bytes of a file just written come from the page cache."""
    buf = getattr(_tls, "buf", None)
    if buf is None:
        buf = _tls.buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    crc = pos = 0
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
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


def _owned(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A CPU, contiguous tensor that owns exactly its bytes (torch.save writes whole storages)."""
    t = t.detach().to(device="cpu", dtype=dtype).contiguous()
    if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


class ShardWriter:
    """Publishes one shard per sample into an output directory, crash-safely.

    On construction it writes run.json, or checks an existing one (ManifestMismatchError when
    it differs). `publish` may be called from one background thread; the index append is
    locked so a second thread would also be safe.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        manifest: RunManifest,
        *,
        check_finite: bool = True,
        fsync_index: bool = True,
    ):
        self.output_dir = os.fspath(output_dir)
        self.manifest = manifest
        self.check_finite = check_finite
        self.fsync_index = fsync_index
        self._dtype = getattr(torch, manifest.dtype)
        self._lock = threading.Lock()
        self._known_dirs: set[str] = set()
        self._by_path = True  # off after a by-path save failed where a file-object save worked
        os.makedirs(os.path.join(self.output_dir, fmt.SHARDS_DIR), exist_ok=True)
        if os.path.exists(os.path.join(self.output_dir, fmt.MANIFEST_NAME)):
            existing = read_manifest(self.output_dir)
            mismatches = manifest_mismatches(existing, manifest)
            if mismatches:
                raise ManifestMismatchError(self.output_dir, mismatches)
        else:
            write_manifest(self.output_dir, manifest)

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
        hidden_state: torch.Tensor,
        aux_hidden_state: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """The SpecForge-compatible dict, checked against the run (ShardDataError if it does not fit)."""
        m = self.manifest
        if hidden_state.dim() == 2:
            hidden_state = hidden_state.unsqueeze(0)
        if aux_hidden_state.dim() == 2:
            aux_hidden_state = aux_hidden_state.unsqueeze(0)
        ids = input_ids.reshape(-1) if input_ids.dim() == 2 and input_ids.shape[0] == 1 else input_ids
        mask = loss_mask.reshape(-1) if loss_mask.dim() == 2 and loss_mask.shape[0] == 1 else loss_mask
        length = ids.shape[0] if ids.dim() == 1 else -1
        want = {
            fmt.KEY_INPUT_IDS: (length,),
            fmt.KEY_LOSS_MASK: (length,),
            fmt.KEY_HIDDEN: (1, length, m.hidden_size),
            fmt.KEY_AUX: (1, length, m.num_aux * m.hidden_size),
        }
        got = {
            fmt.KEY_INPUT_IDS: tuple(ids.shape),
            fmt.KEY_LOSS_MASK: tuple(mask.shape),
            fmt.KEY_HIDDEN: tuple(hidden_state.shape),
            fmt.KEY_AUX: tuple(aux_hidden_state.shape),
        }
        if length < 1 or got != want:
            raise ShardDataError(f"sample {sample_id!r}: tensor shapes {got} do not match the run {want}")
        if self.check_finite:
            for key, t in ((fmt.KEY_HIDDEN, hidden_state), (fmt.KEY_AUX, aux_hidden_state)):
                if not bool(torch.isfinite(t).all()):
                    raise ShardDataError(f"sample {sample_id!r}: {key} has NaN or Inf values")
        return {
            fmt.KEY_INPUT_IDS: _owned(ids, torch.int64),
            fmt.KEY_LOSS_MASK: _owned(mask, torch.int64),
            fmt.KEY_HIDDEN: _owned(hidden_state, self._dtype),
            fmt.KEY_AUX: _owned(aux_hidden_state, self._dtype),
        }

    def publish(
        self,
        sample_id: str,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        hidden_state: torch.Tensor,
        aux_hidden_state: torch.Tensor,
        num_tokens: int | None = None,
    ) -> IndexEntry:
        """Write one sample's shard atomically and record it in the index; returns its entry.

        hidden_state may be [L, H] or [1, L, H]; aux_hidden_state [L, k*H] or [1, L, k*H].
        Raises ShardDataError (nothing written) or DiskFullError (nothing left behind).
        """
        payload = self.build_payload(sample_id, input_ids, loss_mask, hidden_state, aux_hidden_state)
        relpath = fmt.shard_relpath(sample_id)
        final = os.path.join(self.output_dir, relpath)
        directory = os.path.dirname(final)
        self._ensure_dir(directory)
        size, crc = self._write_atomically(payload, final)
        entry = IndexEntry(
            sample_id=sample_id,
            path=relpath,
            size=size,
            checksum=fmt.checksum_string(crc),
            num_tokens=int(num_tokens if num_tokens is not None else payload[fmt.KEY_INPUT_IDS].shape[0]),
        )
        try:
            with self._lock:
                fmt.append_index(self.output_dir, [fmt.index_record(entry)], fsync=self.fsync_index)
        except OSError as e:
            # Not indexed = not done: take the shard back so disk and index agree.
            fmt._unlink_quiet(final)
            if _is_disk_full(e):
                raise DiskFullError(e.errno, f"disk full while indexing {sample_id!r}: {e}") from e
            raise
        return entry

    def _ensure_dir(self, directory: str) -> None:
        if directory in self._known_dirs:
            return
        if not os.path.isdir(directory):
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as e:
                if _is_disk_full(e):
                    raise DiskFullError(e.errno, f"disk full creating {directory}: {e}") from e
                raise
            fmt.fsync_dir(os.path.dirname(directory))
        self._known_dirs.add(directory)

    def _open_temp(self, path: str) -> Any:
        """Opened exclusively; a seam tests use to inject write errors."""
        return open(path, "xb")

    def _write_atomically(self, payload: dict[str, torch.Tensor], final: str) -> tuple[int, int]:
        """temp -> torch.save -> fsync -> checksum read back -> rename -> fsync dir; (size, crc)."""
        directory, name = os.path.split(final)
        tmp = os.path.join(directory, fmt.temp_name(name))
        wrapper = _WriteErrorFile(None)  # keeps the OSError of a write through a file object
        try:
            done = self._save_temp(payload, tmp, wrapper, by_path=self._by_path)
            if not done:
                # torch's C++ writer failed: its errors carry no errno, and it may still hold the
                # file open. Write a new temp through a file object, whose OSError says what went
                # wrong (ENOSPC -> DiskFullError), or which succeeds.
                fmt._unlink_quiet(tmp)
                gc.collect()  # close the failed writer's file now: its space counts on a full disk
                tmp = os.path.join(directory, fmt.temp_name(name))
                self._save_temp(payload, tmp, wrapper, by_path=False)
                self._by_path = False  # not a full disk: something about this host; stop trying
            # The index checksum is the CRC32 of the bytes on disk, read back (from the page cache).
            size, crc = file_crc32(tmp)
            os.replace(tmp, final)
            fmt.fsync_dir(directory)
        except BaseException as e:
            fmt._unlink_quiet(tmp)
            cause = wrapper.error if wrapper.error is not None else e
            if _is_disk_full(cause) or _is_disk_full(e):
                code = getattr(cause, "errno", None) or errno.ENOSPC
                raise DiskFullError(code, f"disk full while writing {final}: {cause}") from e
            raise
        return size, crc

    def _save_temp(
        self, payload: dict[str, torch.Tensor], tmp: str, wrapper: _WriteErrorFile, by_path: bool
    ) -> bool:
        """Create `tmp` exclusively, torch.save into it and fsync it; False when saving by path
        failed (the caller retries through a file object). Other errors raise."""
        with self._open_temp(tmp) as f:
            if by_path and _is_real_file(f, tmp):
                try:
                    # By path, torch's C++ writer writes the records with the GIL released
                    # (through a file object it takes the GIL for every write call).
                    _save_by_path(payload, tmp)
                    # It never checks its last flush: a lost tail shows as a missing zip directory.
                    _check_complete(tmp)
                except Exception:
                    return False
            else:
                wrapper.f = f
                torch.save(payload, wrapper)
                f.flush()
            os.fsync(f.fileno())
        return True


def _link_dir() -> str:
    """This thread's private directory for the `archive` link (see _save_by_path)."""
    pid, d = getattr(_tls, "link_dir", (None, ""))
    if pid != os.getpid():  # first use in this thread, or a forked child: a directory of its own
        d = tempfile.mkdtemp(prefix="hsx-save-")
        _tls.link_dir = (os.getpid(), d)
        atexit.register(shutil.rmtree, d, True)
    return d


def _save_by_path(payload: dict[str, torch.Tensor], path: str) -> None:
    """torch.save(payload, path), through a link named `archive` in a private directory.

    torch.save by path names the zip's records after the file (`<name>/data.pkl`); through a
    file object they are `archive/...`. Saving through a link called `archive` keeps the bytes
    identical to a file-object save (stable names: the `quick` layout memo and byte-identical
    reruns rely on them) while torch writes the file itself with the GIL released."""
    link = os.path.join(_link_dir(), "archive")
    os.symlink(os.path.abspath(path), link)
    try:
        torch.save(payload, link)
    finally:
        os.unlink(link)


def _is_real_file(f: Any, path: str) -> bool:
    """`f` is the plain file just opened at `path` (not a test's wrapper or another file)."""
    return isinstance(f, io.BufferedWriter) and getattr(f, "name", None) == path


def _check_complete(path: str) -> None:
    """The file ends in a zip directory that lies inside it (format's own parser); ShardBad else."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        fmt.read_zip_records(fmt._Reader(fd, os.fstat(fd).st_size))
    finally:
        os.close(fd)


def remove_orphan_temps(output_dir: str | os.PathLike[str]) -> int:
    """Delete writer temp files under OUTPUT (root and shards/); returns how many were removed."""
    return len(fmt.remove_orphan_temps(os.fspath(output_dir)))
