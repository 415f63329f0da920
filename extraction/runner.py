"""The extraction run: dataset -> batches -> backend forward -> background writer -> shards.

Crash safety comes from the shard writer (temp -> fsync -> rename -> index line); this module
adds what a long run needs around it: resume that trusts only indexed shards passing `quick`,
a refusal to mix runs, a free-space guard, retries, clean stops on signals, and status.json.

Batches are planned from the whole (node-local) sample list, not from what is left: samples
are grouped in fixed windows of the dataset order and sorted by length inside each window. A
resume re-runs a planned batch whole even when some of its samples are already done (their
results are dropped), because padding and batch shape change float32 results in the last bits
(measured on the tiny model: up to 2e-8 between a sample alone and in a batch). So a resumed
run writes bit-identical tensors to an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import inspect
import itertools
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

try:
    import resource
except ImportError:  # not Unix: no usage figures in the timings
    resource = None  # type: ignore[assignment]

from extraction import heap
from extraction import layers as layer_mod
from extraction.backends.base import Backend, Sample, SampleStates
from extraction.backends.hf import dtype_name
from extraction.childgen import ChildFailed, ChildGenerator
from extraction.config import ExtractConfig
from extraction.dataset import (
    ChatTokenizer,
    DatasetEntry,
    RowError,
    chat_template_of,
    load_tokenizer,
    read_conversations,
    scan_dataset,
    sha256_text,
    tokenizer_hash,
)
from extraction.diskguard import DiskGuard, DiskLow, estimate_shard_bytes
from extraction.outputlock import OutputBusy, OutputLock
from extraction.publisher import BatchPublisher, Item, Outcome, all_finite  # noqa: F401  (all_finite: tests)
from extraction.shards import (
    DiskFullError,
    ManifestError,
    ManifestMismatchError,
    RunManifest,
    ShardWriter,
    read_index,
)
from extraction.shards import format as fmt
from extraction.status import ERRORS_NAME, StatusReporter, StatusThread, now_iso
from extraction.writerproc import (
    FLAG_ABANDON,
    FLAG_DRAIN,
    Arena,
    ArenaFull,
    Place,
    WireItem,
    WriterGone,
    WriterProcess,
    copy_into,
)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_PAUSED = 75  # EX_TEMPFAIL: free space and run again
EXIT_SIGINT = 130
EXIT_SIGTERM = 143

WINDOW_BATCHES = 16  # a planning window holds this many batches' worth of samples
QUEUE_BATCHES = 4  # batches buffered between forward -> writer (and at least this many tokenizer -> forward)
# Token tensors (ids + mask, int64) the tokenizer may hold ahead of the forward (the batch queue). It
# starts before the model loads (minutes for a real target), so a run's first tens of thousands of
# samples are tokenized before the first forward. A batch is counted at its longest possible size.
TOKENIZE_AHEAD_BYTES = 256 << 20
_UNTRUNCATED_TOKENS = 32768  # the size a batch is counted at when --max-length is not set
# Shards published at once; 0: 1 on <= 4 cores, else 2. More writers hold the GIL more (torch.save's
# record writing does), which slows the forward thread: on an H200 host 2 beat 4 (docs/benchmarks.md).
WRITER_THREADS = 0
# Once the forward pass is over nothing competes for the GIL: the shards still queued (the last
# batch or two, which the run waits for) are published by up to this many threads at once.
DRAIN_WRITER_THREADS = 8
# Publish shards in a forked child process (extraction/writerproc.py) instead of threads here: its
# system calls and Python then never take the GIL from the forward pass. For the hf backend (the
# forward runs in this process); HSX_WRITER=thread in the environment turns it off.
WRITER_PROCESS = True
# The states of this many batches (at their longest) may wait for the writer process, in a shared
# mapping: the forward pass waits for space beyond that, as it waits on the queue for a thread.
WRITER_BUFFER_BATCHES = QUEUE_BATCHES + 2
WRITER_BUFFER_MAX = 8 << 30
# On a GPU, the share of that buffer the device's copies land in; the rest takes what the courier
# copies in itself (a batch too large for the device's share, the one-by-one retry path).
DEVICE_BUFFER_SHARE = 0.75
# Tokenize in a forked child process (extraction/childgen.py) instead of a thread: its Python then
# never takes the GIL from the forward pass. HSX_TOKENIZER=thread in the environment turns it off.
TOKENIZER_PROCESS = True

_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


class RunError(Exception):
    """Stops the run before any work; `code` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code


def assigned_to(sample_id: str, shard_index: int, num_shards: int) -> bool:
    """Node assignment by a hash of the stable id: no coordination, stable under reordering."""
    if num_shards == 1:
        return True
    h = int.from_bytes(hashlib.sha256(sample_id.encode("utf-8")).digest()[:8], "big")
    return h % num_shards == shard_index


def tokenize_ahead_batches(batch_size: int, max_length: int | None) -> int:
    """How many tokenized batches may wait for the forward: TOKENIZE_AHEAD_BYTES' worth, at least QUEUE_BATCHES."""
    per_batch = max(1, batch_size) * (max_length or _UNTRUNCATED_TOKENS) * 16
    return max(QUEUE_BATCHES, TOKENIZE_AHEAD_BYTES // per_batch)


def plan_windows(entries: list[DatasetEntry], batch_size: int) -> list[list[DatasetEntry]]:
    """Fixed windows of the dataset order; batches are cut inside a window by length."""
    size = batch_size * WINDOW_BATCHES
    return [entries[i : i + size] for i in range(0, len(entries), size)]


def batches_of_window(samples: list[Sample], batch_size: int) -> list[list[Sample]]:
    """Sort a window's samples by length (ties by id) and cut batches: little padding, fixed plan."""
    ordered = sorted(samples, key=lambda s: (int(s.input_ids.numel()), s.sample_id))
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


def read_model_config(model_dir: str) -> dict[str, Any]:
    """hidden size, layers, vocab from config.json (a text_config inside wins for VLM wrappers)."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except OSError as e:
        raise RunError(f"{path}: cannot read model config: {e.strerror}") from None
    except ValueError as e:
        raise RunError(f"{path}: invalid JSON: {e}") from None
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    try:
        return {
            "hidden_size": int(text["hidden_size"]),
            "num_layers": int(text["num_hidden_layers"]),
            "vocab_size": int(text["vocab_size"]) if text.get("vocab_size") else None,
            "max_positions": int(text.get("max_position_embeddings") or _UNTRUNCATED_TOKENS),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise RunError(f"{path}: model config lacks {e}") from None


def _end_torn_index_line(output_dir: str) -> None:
    """A crash mid-append can leave the index without its final newline; the next append would
    then be glued to the fragment and lost with it. End the fragment with a newline first, so it
    stays a single damaged line that read_index skips. (Belongs in the shard writer; see report.)"""
    path = os.path.join(output_dir, fmt.INDEX_NAME)
    try:
        with open(path, "rb+") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
                f.flush()
                os.fsync(f.fileno())
    except FileNotFoundError:
        return


def _minor_faults() -> float:
    if resource is None:
        return 0.0
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def thread_usage() -> tuple[float, int, int]:
    """This thread's (CPU seconds, voluntary, involuntary context switches), for the timings:
    a forward thread that waits on the GIL switches voluntarily, one that loses its core to
    another task involuntarily. Zeros where the platform has no per-thread usage."""
    try:
        ru = resource.getrusage(resource.RUSAGE_THREAD)  # type: ignore[union-attr]
    except (AttributeError, OSError):  # not Unix (resource None), or not Linux
        return 0.0, 0, 0
    return ru.ru_utime + ru.ru_stime, ru.ru_nvcsw, ru.ru_nivcsw


def _record_usage(timings: dict[str, float], name: str, before: tuple[float, int, int]) -> None:
    """Add this thread's usage since `before` to timings as NAME_cpu_s, NAME_vcsw, NAME_ivcsw."""
    for suffix, now, then in zip(("cpu_s", "vcsw", "ivcsw"), thread_usage(), before, strict=True):
        timings[f"{name}_{suffix}"] = timings.get(f"{name}_{suffix}", 0) + now - then


def forward_cpu_threads(cores: int, writer_threads: int) -> int:
    """torch threads for a forward pass on the CPU: every core but one per writer thread and one
    for the tokenizer, where that leaves the forward >= 3/4 of the cores; else every core.

    torch's default takes every core, so the runner's own threads take cores from the forward's
    OpenMP team, which then waits at each barrier for the thread that lost its core. On few cores
    giving the forward fewer threads costs more than that (2 cores: 1 thread 0.61x vs 2 threads
    0.68-0.82x of a forward-only loop on 2)."""
    keep = cores - writer_threads - 1
    return keep if keep >= 0.75 * cores else cores


def writer_buffer_bytes(batch_size: int, max_tokens: int, token_bytes: int) -> int:
    """The writer process's shared buffer: WRITER_BUFFER_BATCHES batches at their longest, at
    least two samples at their longest, never more than WRITER_BUFFER_MAX or an eighth of the
    memory (it is pinned on a GPU host). A sample too long for it is published by the runner."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        memory = 8 * WRITER_BUFFER_MAX
    cap = min(WRITER_BUFFER_MAX, memory // 8)
    sample = max_tokens * token_bytes
    return min(cap, max(2 * sample, WRITER_BUFFER_BATCHES * batch_size * sample))


def make_backend(cfg: ExtractConfig, layer_ids: list[int]) -> Backend:
    if cfg.backend == "hf":
        from extraction.backends.hf import HFBackend

        return HFBackend(cfg.model, layer_ids, dtype=cfg.dtype, device=cfg.device)
    from extraction.backends import sglang  # helper-owned; constructed from the same config

    return sglang.SGLangBackend.from_config(cfg, layer_ids)


@dataclass
class _Work:
    """One planned batch on its way: all samples ran; only `pending` ones get written."""

    samples: list[Sample]
    pending: set[str]
    results: list[SampleStates] = field(default_factory=list)
    ready: Callable[[], Any] | None = None  # blocks until the results' tensors are on the host
    batch: tuple[torch.Tensor, torch.Tensor] | None = None  # the results' states are views of these
    allocs: list[int] = field(default_factory=list)  # its blocks of the writer process's buffer


class Runner:
    """One `hsx extract` invocation. `backend_factory` lets tests inject a failing backend."""

    def __init__(
        self,
        cfg: ExtractConfig,
        backend_factory: Callable[[ExtractConfig, list[int]], Backend] = make_backend,
        log: Callable[[str], None] | None = None,
    ):
        self.cfg = cfg
        self.backend_factory = backend_factory
        self.log = log or (lambda msg: print(f"hsx extract: {msg}", file=sys.stderr, flush=True))
        self.stop_event = threading.Event()
        self.forward_done = threading.Event()  # no batch will be queued for the writer any more
        self.abandon_event = threading.Event()
        self.stop_signal: int | None = None
        self.pause: DiskLow | DiskFullError | None = None
        self.abort: str | None = None
        self.consecutive_errors = 0
        self.failed_samples: set[str] = set()
        self.bar: Any = None
        self._errors_lock = threading.Lock()
        self.producer: threading.Thread | None = None
        self.producer_child: ChildGenerator | None = None
        self.writer_threads = WRITER_THREADS or (1 if fmt.usable_cores() <= 4 else 2)
        self.writer_proc: WriterProcess | None = None
        self.output_lock = OutputLock(cfg.output)
        self._allocs: list[int] = []  # writer-buffer blocks the batch in the forward has taken
        self._in_writer: dict[int, tuple[_Work, list[int]]] = {}  # batch id -> (batch, blocks it frees)
        self._in_writer_lock = threading.Lock()
        self._batch_ids = itertools.count()  # each part of a batch sent to the writer process
        self._host_empty_ok = False  # the backend's host buffers may come from the writer's buffer
        self._forward_sends = False  # the forward thread sends its batches to the writer process
        self._published_here = 0  # samples too long for the writer's buffer, published by this process
        self.batch_q: queue.Queue = queue.Queue(
            maxsize=tokenize_ahead_batches(cfg.batch_size, cfg.max_length)
        )
        # Where the time went (seconds; perf_counter stamps for the start/end marks). The model
        # is ready at `ready_at`; `pipeline_end_at` is after the last shard is indexed.
        self.timings: dict[str, float] = {
            "model_load_s": 0.0,
            "forward_wait_batch_s": 0.0,
            "forward_s": 0.0,
            "forward_wait_writer_s": 0.0,
            "forward_send_s": 0.0,  # a CPU forward sending its batches to the writer process itself
            "writer_wait_copy_s": 0.0,
            "writer_publish_s": 0.0,
            "drain_s": 0.0,
            "ready_at": 0.0,
            "pipeline_end_at": 0.0,
            "ready_cpu_at": 0.0,  # process CPU seconds (all threads), for benchmarks
            "pipeline_end_cpu_at": 0.0,
            "ready_faults_at": 0.0,  # this process's minor page faults so far, for benchmarks
            "pipeline_end_faults_at": 0.0,
        }

    # ------------------------------------------------------------------ set-up

    def _manifest(self, model_cfg: dict[str, Any], layer_ids: list[int], tokenizer: Any, ds_hash: str):
        cfg = self.cfg
        from extraction.backends.hf import model_revision

        return RunManifest(
            model=os.path.basename(os.path.abspath(cfg.model)),
            revision=model_revision(cfg.model),
            hidden_size=model_cfg["hidden_size"],
            num_layers=model_cfg["num_layers"],
            layer_ids=layer_ids,
            layer_convention=layer_mod.CANONICAL,
            dtype=_DTYPE_NAMES[cfg.dtype],
            final_normed=True,
            vocab_size=model_cfg["vocab_size"],
            tokenizer_hash=tokenizer_hash(cfg.model),
            chat_template_hash=sha256_text(chat_template_of(tokenizer)),
            dataset_path=os.path.basename(cfg.dataset),
            dataset_hash=ds_hash,
            extra={
                "max_length": cfg.max_length,
                "model_dir": os.path.abspath(cfg.model),
                "dataset_file": os.path.abspath(cfg.dataset),
                "backend": cfg.backend,
                "batch_size": cfg.batch_size,
                "host": socket.gethostname(),
            },
        )

    def _check_extra(self, manifest: RunManifest) -> None:
        """max_length changes what a shard holds but is not a manifest field: compare it here."""
        path = os.path.join(self.cfg.output, fmt.MANIFEST_NAME)
        if not os.path.exists(path):
            return
        existing = fmt.read_manifest_dict(self.cfg.output)
        extra = existing.get("extra") or {}
        if "max_length" in extra and extra["max_length"] != manifest.extra["max_length"]:
            raise RunError(
                f"{self.cfg.output} holds a different run: max_length: existing run has "
                f"{extra['max_length']!r}, this run wants {manifest.extra['max_length']!r}"
            )

    def _existing_done(self, manifest: RunManifest, wanted: set[str]) -> tuple[set[str], int]:
        """Samples whose shard is indexed and passes `quick`; plus how many indexed ones failed."""
        state = read_index(self.cfg.output)
        expect = fmt.Expect.from_manifest(manifest.to_dict())
        done: set[str] = set()
        bad = 0
        for sid, entry in state.entries.items():
            if sid not in wanted:
                continue
            try:
                fmt.check_shard(os.path.join(self.cfg.output, entry.path), expect, "quick", entry)
            except (fmt.ShardBad, fmt.ShardIOError) as e:
                bad += 1
                self._error({"kind": "resume", "sample_id": sid, "reason": f"redo: {e}"})
                continue
            done.add(sid)
        return done, bad

    def _error(self, record: dict[str, Any]) -> None:
        record = {"time": now_iso(), **record}
        with self._errors_lock:
            with open(os.path.join(self.cfg.output, ERRORS_NAME), "a", encoding="utf-8") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")

    # ------------------------------------------------------------------ pipeline threads

    def _produce_items(
        self, tokenizer: ChatTokenizer, windows: list[list[DatasetEntry]], done: set[str]
    ) -> Iterator[tuple[str, Any, Any]]:
        """The tokenizer's work, in order: ("batch", samples, pending ids) for each planned batch
        holding at least one pending sample, ("row_error", record, None) for a row that cannot be
        tokenized. Runs in the tokenizer process (or thread): it changes nothing here."""
        for window in windows:
            if all(e.sample_id in done for e in window):
                continue
            samples = []
            for conv in read_conversations(self.cfg.dataset, window):
                try:
                    samples.append(tokenizer.encode(conv))
                except Exception as e:  # a template that cannot render this row: a data problem
                    record = RowError(conv.line, f"tokenization failed: {e}", conv.sample_id).to_record()
                    yield "row_error", record, None
            for batch in batches_of_window(samples, self.cfg.batch_size):
                pending = {s.sample_id for s in batch if s.sample_id not in done}
                if pending:
                    yield "batch", batch, pending

    def _produce_portable(
        self, tokenizer: ChatTokenizer, windows: list[list[DatasetEntry]], done: set[str]
    ) -> Iterator[tuple[str, Any, Any]]:
        """_produce_items for the tokenizer process: samples as numpy arrays, which pickle as
        their bytes (a tensor would pickle through torch.save, slowly, on both sides)."""
        # Its tensors are small and the parent may have used the intra-op thread pool before the
        # fork (an OpenMP pool is not fork-safe): one thread, no parallel regions here.
        torch.set_num_threads(1)
        self.output_lock.release()  # never writes there: a kill -9 of the runner frees the output at once
        for kind, value, pending in self._produce_items(tokenizer, windows, done):
            if kind == "batch":
                value = [
                    (s.sample_id, s.input_ids.numpy(), s.loss_mask.numpy(), s.truncated, s.meta)
                    for s in value
                ]
            yield kind, value, pending

    @staticmethod
    def _from_portable(items: Iterable[tuple[str, Any, Any]]) -> Iterator[tuple[str, Any, Any]]:
        """The tokenizer process's items back as _produce_items gives them (samples as tensors,
        sharing the received arrays' memory)."""
        for kind, value, pending in items:
            if kind == "batch":
                value = [
                    Sample(sid, torch.from_numpy(ids), torch.from_numpy(mask), truncated, meta)
                    for sid, ids, mask, truncated, meta in value
                ]
            yield kind, value, pending

    def _produce(self, items: Iterable[tuple[str, Any, Any]], out: queue.Queue) -> None:
        """Tokenizer thread: takes the items (tokenized here, or received from the tokenizer
        process) onto the batch queue, and applies row errors."""
        usage = thread_usage()
        try:
            for kind, value, pending in items:
                if self.stop_event.is_set():
                    break
                if kind == "row_error":
                    self._error(value)
                    with self.reporter.lock:
                        self.reporter.row_errors += 1
                        self.reporter.total -= 1
                    continue
                while not self.stop_event.is_set():
                    try:
                        out.put(_Work(value, pending), timeout=0.2)
                        break
                    except queue.Full:
                        continue
        except ChildFailed as e:
            if not self.stop_event.is_set():
                self.abort = f"the tokenizer process failed: {e}"
                self.log(self.abort)
                self.stop_event.set()
        finally:
            out.put(None)
            _record_usage(self.timings, "producer", usage)

    def _write(self, work_q: queue.Queue) -> None:
        """Writer thread: waits for each batch's copy to the host, publishes its shards
        (BatchPublisher: disk guard, atomic publish, one index commit), counts them. Never
        touches the GPU.

        With writer_threads > 1 a batch's shards are published by that many threads at once
        (the copies, the CRC and fsync release the GIL); each shard is still atomic and indexed
        after its rename, so only the order of index lines changes. After the forward pass has
        ended, the batches left are published by up to DRAIN_WRITER_THREADS threads (the drain)."""
        try:
            self._write_loop(work_q)
        except BaseException as e:  # stop the run, and never leave the forward thread blocked
            self._writer_failed(e)  # on a full queue
            self.stop_event.set()
            while work_q.get() is not None:  # the forward thread puts None last
                pass
        finally:
            self.publisher.close()

    def _publish_threads(self) -> int:
        """How many shards of a batch are written at once: the run's writer threads - or the
        drain's, once the forward pass is over and nothing competes."""
        if self.forward_done.is_set():
            return max(self.writer_threads, min(DRAIN_WRITER_THREADS, fmt.usable_cores()))
        return self.writer_threads

    def _stopped_writing(self) -> bool:
        return self.abandon_event.is_set() or self.pause is not None

    def _write_loop(self, work_q: queue.Queue) -> None:
        while True:
            work = work_q.get()
            if work is None:
                return
            if self._stopped_writing():
                continue  # drained, not written: these samples stay pending
            if not self._wait_ready(work):
                continue
            outcome = self.publisher.publish(
                self._items(work), self._publish_threads(), self._stopped_writing
            )
            self._apply(work, outcome)

    def _wait_ready(self, work: _Work) -> bool:
        """Block until the batch's states are on the host; False (its samples failed) when the
        device reports an error there."""
        if work.ready is None:
            return True
        t0 = time.perf_counter()
        try:
            work.ready()
        except Exception as e:  # an asynchronous device error surfaces here
            for sample in work.samples:
                if sample.sample_id in work.pending:
                    self._sample_failed(sample, f"copy to host failed: {type(e).__name__}: {e}")
            return False
        finally:
            self.timings["writer_wait_copy_s"] += time.perf_counter() - t0
        return True

    @staticmethod
    def _items(work: _Work) -> list[Item]:
        return [
            Item(s.sample_id, s.input_ids, s.loss_mask, st.hidden_state, st.aux_hidden_state, st.finite)
            for s, st in zip(work.samples, work.results, strict=True)
            if s.sample_id in work.pending
        ]

    def _apply(self, work: _Work, outcome: Outcome) -> None:
        """A published batch's outcome into the run: failed samples, the pause, the counters."""
        self.timings["writer_publish_s"] += outcome.publish_s
        self.guard.largest = max(self.guard.largest, outcome.largest)
        if outcome.last_free is not None:
            self.guard.last_free = outcome.last_free
        if outcome.free is not None:
            self.reporter.free_bytes = outcome.free
        by_id = {s.sample_id: s for s in work.samples}
        for sid, reason in outcome.failed:
            self._sample_failed(by_id[sid], reason)
        if outcome.pause is not None:
            self._pause(outcome.pause)
        for entry in outcome.written:
            self.reporter.add_written(entry.num_tokens, entry.size)
            self.reporter.free_bytes = (self.reporter.free_bytes or 0) - entry.size
            if self.bar is not None:
                self.bar.update(1)

    def _writer_failed(self, e: BaseException) -> str:
        """The publishing side raised: a full disk (its bookkeeping's writes, errors.jsonl say) is
        a pause like any other; anything else a bug that fails the run. The reason, logged."""
        reason = f"the writer failed: {type(e).__name__}: {e}"
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            self._pause(e if isinstance(e, DiskFullError) else DiskFullError(e.errno, reason))
            return reason
        if self.abort is None:
            self.abort = reason
        self.log(reason)
        return reason

    def _pause(self, reason: DiskLow | DiskFullError) -> None:
        if isinstance(reason, DiskLow):
            self.reporter.free_bytes = reason.free  # the figure the pause message quotes
        if self.pause is None:
            self.pause = reason
            self.log(f"pausing: {reason}")
        self.stop_event.set()

    def _sample_failed(self, sample: Sample, reason: str, attempts: int | None = None) -> None:
        self.failed_samples.add(sample.sample_id)
        self.reporter.add_error()
        rec = {
            "kind": "sample",
            "sample_id": sample.sample_id,
            "line": sample.meta.get("line"),
            "reason": reason,
        }
        if attempts is not None:
            rec["attempts"] = attempts
        self._error(rec)
        self.consecutive_errors += 1
        if self.consecutive_errors >= self.cfg.max_consecutive_errors and self.abort is None:
            self.abort = (
                f"{self.consecutive_errors} samples failed in a row (--max-consecutive-errors "
                f"{self.cfg.max_consecutive_errors}); last: {reason}"
            )
            self.stop_event.set()

    # ------------------------------------------------------------------ forward with retries

    def _try_extract(
        self, batch: list[Sample], shared: bool = True
    ) -> tuple[
        list[SampleStates] | None,
        Callable[[], Any] | None,
        tuple[torch.Tensor, torch.Tensor] | None,
        str,
        int,
    ]:
        """Up to 1 + retries attempts with doubling backoff; (results, ready, the batch's host
        tensors or None (PendingStates.batch), last error, attempts).

        A backend with `extract_async` (hf) only queues the batch: `ready` then blocks until its
        states are on the host, and the writer thread calls it, so this thread goes on at once."""
        reason = ""
        extract_async = getattr(self.backend, "extract_async", None)
        if extract_async is not None and self._host_empty_ok and shared:  # in the writer's buffer
            extract_async = functools.partial(extract_async, host_empty=self._host_empty)
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                delay = self.cfg.retry_backoff * 2 ** (attempt - 1)
                if self.stop_event.wait(delay):
                    return None, None, None, reason or "stopped", attempt
            try:
                ready = states = None
                if extract_async is not None:
                    handle = extract_async(batch)
                    results, ready, states = handle.results, handle.wait, getattr(handle, "batch", None)
                else:
                    results = self.backend.extract(batch)
                self._check_results(batch, results)
                return results, ready, states, "", attempt + 1
            except Exception as e:  # any backend failure is retried; the reason goes to errors.jsonl
                reason = f"{type(e).__name__}: {e}"
                self._free_failed_attempt()
        return None, None, None, reason, self.cfg.retries + 1

    def _free_failed_attempt(self) -> None:
        """Free the writer-buffer blocks a failed attempt took (a CPU forward's states, a GPU's
        copies: once those have landed), so that its retries and the one-by-one path have the
        room; on a broken device context they stay taken (the run is ending)."""
        allocs, self._allocs = self._allocs, []
        if allocs and self.cfg.device.startswith("cuda"):
            try:
                torch.cuda.synchronize()  # its copies into them may still be landing
            except Exception:
                return
        self._free(allocs)

    @staticmethod
    def _check_results(batch: list[Sample], results: list[SampleStates]) -> None:
        if len(results) != len(batch):
            raise RuntimeError(f"backend returned {len(results)} results for {len(batch)} samples")
        for s, r in zip(batch, results, strict=True):
            if r.sample_id != s.sample_id:
                raise RuntimeError(f"backend returned {r.sample_id!r} where {s.sample_id!r} was expected")
            if r.input_ids is not s.input_ids and not bool((r.input_ids.cpu() == s.input_ids).all()):
                raise RuntimeError(f"{s.sample_id!r}: backend saw other input_ids than were sent")

    def _host_empty(self, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor] | None:
        """Host memory for a batch's states in the writer process's buffer (pinned on a GPU);
        None (the backend then uses memory of its own, and _send copies) when the buffer cannot
        take the batch without waiting on batches not sent yet."""
        assert self.writer_proc is not None
        try:
            tensors, block = self.writer_proc.arena.empty(specs)
        except (ArenaFull, ValueError, WriterGone):  # WriterGone: the run is ending anyway
            return None
        self._allocs.append(block)
        return tensors

    def _forward(self, work: _Work) -> _Work | None:
        results, ready, states, reason, attempts = self._try_extract(work.samples)
        if results is not None:
            self.consecutive_errors = 0
            work.results, work.ready, work.batch = results, ready, states
            return work
        if self.stop_event.is_set() and self.abort is None and self.pause is None:
            return None  # interrupted while backing off
        if len(work.samples) == 1:
            self._sample_failed(work.samples[0], reason, attempts)
            return None
        # Find the sample that breaks the batch: one at a time (these are not bit-identical to the
        # batched plan in fp32, but a failing batch has no bits to be identical to).
        self.log(
            f"batch of {len(work.samples)} failed after {attempts} attempts ({reason}); trying one by one"
        )
        kept_samples, kept_results = [], []
        for s in work.samples:
            if s.sample_id not in work.pending:
                continue
            if self.stop_event.is_set():
                break
            # not in the writer's buffer: what this batch already holds there is not sent yet
            res, ready, _, why, n = self._try_extract([s], shared=False)
            if res is not None and ready is not None:
                try:
                    ready()
                except Exception as e:
                    res, why = None, f"copy to host failed: {type(e).__name__}: {e}"
            if res is None:
                if not self.stop_event.is_set() or self.abort:
                    self._sample_failed(s, why, n)
                continue
            self.consecutive_errors = 0
            kept_samples.append(s)
            kept_results.append(res[0])
        return _Work(kept_samples, work.pending, kept_results) if kept_samples else None

    # ------------------------------------------------------------------ signals

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
            self.log(f"{signal.Signals(signum).name}: finishing the batch in flight, then stopping")
            self.stop_event.set()
        else:
            self.log(f"{signal.Signals(signum).name} again: abandoning unwritten samples")
            self.abandon_event.set()
            if self.writer_proc is not None:
                self.writer_proc.arena.set_flag(FLAG_ABANDON)

    # ------------------------------------------------------------------ the run

    def prepare(self) -> None:
        """Everything before the first forward: may raise RunError (nothing written on a refusal)."""
        cfg = self.cfg
        if not os.path.isdir(cfg.model):
            raise RunError(f"--model {cfg.model}: not a directory")
        if not os.path.isfile(cfg.dataset):
            raise RunError(f"--dataset {cfg.dataset}: not a file")
        if os.path.exists(cfg.output) and not os.path.isdir(cfg.output):
            raise RunError(f"--output {cfg.output}: exists and is not a directory")
        model_cfg = self.model_cfg = read_model_config(cfg.model)
        try:
            self.layer_ids = layer_mod.parse_layers(cfg.layers, model_cfg["num_layers"], cfg.layer_convention)
        except layer_mod.LayerSpecError as e:
            raise RunError(f"--layers: {e}") from None
        self.scan = scan_dataset(cfg.dataset)
        try:
            tokenizer = load_tokenizer(cfg.model)
        except Exception as e:
            raise RunError(f"cannot load the tokenizer from {cfg.model}: {e}") from None
        if chat_template_of(tokenizer) is None:
            raise RunError(f"{cfg.model}: the tokenizer has no chat template")
        self.tokenizer = ChatTokenizer(tokenizer, cfg.max_length)
        self.manifest = self._manifest(model_cfg, self.layer_ids, tokenizer, self.scan.sha256)
        self.itemsize = _ITEMSIZE[self.manifest.dtype]
        self._check_extra(self.manifest)
        try:
            os.makedirs(cfg.output, exist_ok=True)
            # before anything here writes to the output or removes from it
            unlocked = self.output_lock.acquire()
            if unlocked:
                self.log(unlocked)
        except OutputBusy as e:
            raise RunError(str(e), EXIT_FAILED) from None
        except OSError as e:  # a full disk is a pause here too: the job unit leaves it to a person
            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            raise RunError(f"--output {cfg.output}: {e}", EXIT_PAUSED if full else EXIT_USAGE) from None
        try:
            # The NaN/Inf check is the publisher's (Item.nonfinite): on the device when the backend can.
            self.writer = ShardWriter(cfg.output, self.manifest, check_finite=False)
        except ManifestMismatchError as e:
            raise RunError(f"refusing to resume: {e}") from None
        except ManifestError as e:
            raise RunError(str(e)) from None
        except OSError as e:
            raise RunError(f"--output {cfg.output}: {e}") from None
        if not self.writer.writes_directly:
            self.log(f"shards written by torch.save ({self.writer.write_mode}): slower, same bytes")
        _end_torn_index_line(cfg.output)
        removed = self.writer.remove_orphan_temps()
        if removed:
            self.log(f"removed {removed} temp file(s) left by an interrupted writer")

        assigned = [e for e in self.scan.entries if assigned_to(e.sample_id, cfg.shard_index, cfg.num_shards)]
        if cfg.limit is not None:
            assigned = assigned[: cfg.limit]
        self.assigned = assigned
        t0 = time.monotonic()
        self.done, bad = self._existing_done(self.manifest, {e.sample_id for e in assigned})
        self.resume_seconds = time.monotonic() - t0
        if self.done or bad:
            self.log(
                f"resume: {len(self.done)} sample(s) already done, {bad} indexed shard(s) failed quick and "
                f"will be redone ({self.resume_seconds:.1f}s)"
            )
        estimate = estimate_shard_bytes(
            cfg.max_length or 0, self.manifest.hidden_size, self.manifest.num_aux, self.itemsize
        )
        self.guard = DiskGuard(cfg.output, cfg.reserve_bytes, estimate)
        self.publisher = BatchPublisher(self.writer, self.guard, self.itemsize)
        self.reporter = StatusReporter(cfg.output, len(assigned), len(self.done), self.guard.reserve)
        self.reporter.row_errors = len(self.scan.errors)
        self.reporter.extra = {
            "model": self.manifest.model,
            "dataset": os.path.abspath(cfg.dataset),
            "shard_index": cfg.shard_index,
            "num_shards": cfg.num_shards,
            "resume_seconds": round(self.resume_seconds, 3),
        }
        for err in self.scan.errors:
            self._error(err.to_record())
        if self.scan.errors:
            self.log(f"{len(self.scan.errors)} malformed row(s) skipped (see {cfg.output}/{ERRORS_NAME})")

    def run(self) -> int:
        """The whole run: prepare, extract, the exit status; the output's lock dropped after."""
        try:
            return self._run()
        finally:
            self.close()

    def close(self) -> None:
        """Drop the output directory's lock (after prepare() alone, say; run() does it itself)."""
        self.output_lock.release()

    def _run(self) -> int:
        try:
            self.prepare()
        except RunError as e:
            self.log(str(e))
            return e.code
        cfg = self.cfg
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                handlers[sig] = signal.signal(sig, self._on_signal)
        self.reporter.set_state("starting", "loading the model")
        self.reporter.write()
        status_thread = None
        if self._cpu_forward_threads() is not None:
            heap.keep_freed_memory()  # before the forks: the helpers keep theirs too
        heap.release_free_memory()  # what the heap holds free now would be shared with the helpers
        # Tokenize the first batches while the model loads: the first planning window must be
        # tokenized whole before its first batch exists.
        self._start_writer_process()  # first: no thread of this run is running yet to fork beside
        self._start_producer()
        try:
            t0 = time.perf_counter()
            try:
                self.backend = self.backend_factory(cfg, self.layer_ids)
            except Exception as e:
                self.reporter.set_state("failed", f"cannot start the {cfg.backend} backend: {e}")
                self.log(f"cannot start the {cfg.backend} backend: {e}")
                return EXIT_FAILED
            self._share_writer_buffer()
            self.timings["ready_at"] = time.perf_counter()
            self.timings["ready_cpu_at"] = time.process_time()
            self.timings["ready_faults_at"] = _minor_faults()
            self.timings["model_load_s"] = self.timings["ready_at"] - t0
            self._check_backend()
            self.reporter.set_state("running")
            self.reporter.write()
            status_thread = StatusThread(self.reporter, cfg.status_interval, self._refresh_free)
            status_thread.start()
            self._open_bar()
            with self._forward_threads():
                self._pipeline()
        except RunError as e:
            self.reporter.set_state("failed", str(e))
            self.log(str(e))
            return e.code
        finally:
            self._stop_producer()
            self._stop_writer_process()
            if status_thread is not None:
                status_thread.stop()
            for sig, old in handlers.items():
                signal.signal(sig, old)
            if self.bar is not None:
                self.bar.close()
            writer = getattr(self, "writer", None)
            if writer is not None:
                writer.close()
            backend = getattr(self, "backend", None)
            if backend is not None:
                try:
                    backend.close()
                except Exception:
                    pass
        code = self._finish()
        self.reporter.write()
        return code

    def _cpu_forward_threads(self) -> int | None:
        """torch's threads for a forward on a CPU device (None on another device): --cpu-threads,
        else OMP_NUM_THREADS's, else forward_cpu_threads' (at most the caller's setting)."""
        cfg = self.cfg
        if cfg.backend != "hf" or not cfg.device.startswith("cpu"):
            return None
        if cfg.cpu_threads:
            return cfg.cpu_threads
        if os.environ.get("OMP_NUM_THREADS"):
            return torch.get_num_threads()
        # never more than the caller's: a process forked after OpenMP ran must keep 1 thread
        return min(torch.get_num_threads(), forward_cpu_threads(fmt.usable_cores(), self.writer_threads))

    @contextlib.contextmanager
    def _forward_threads(self) -> Iterator[None]:
        """On a CPU device, torch's threads for the forward (_cpu_forward_threads), restored after."""
        threads = self._cpu_forward_threads()
        if threads is None:
            yield
            return
        before = torch.get_num_threads()
        self.log(f"forward on {threads} torch threads ({fmt.usable_cores()} cores here)")
        self.timings["forward_threads"] = threads
        torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _check_backend(self) -> None:
        info = self.backend.model_info()
        m = self.manifest
        if (info.hidden_size, info.num_layers) != (m.hidden_size, m.num_layers):
            raise RunError(
                f"the {self.cfg.backend} backend serves a model with hidden {info.hidden_size}, "
                f"{info.num_layers} layers; {self.cfg.model}/config.json says {m.hidden_size}, {m.num_layers}",
                EXIT_FAILED,
            )

    def _refresh_free(self) -> None:
        try:
            self.reporter.free_bytes = self.guard.check(0) if self.pause is None else self.reporter.free_bytes
        except DiskLow as e:
            self.reporter.free_bytes = e.free
        with self.reporter.lock:
            self.reporter.reserve_bytes = self.guard.reserve

    def _open_bar(self) -> None:
        want = self.cfg.progress
        if want == "off" or (want == "auto" and not sys.stderr.isatty()):
            return
        from tqdm import tqdm

        self.bar = tqdm(
            total=self.reporter.total,
            initial=self.reporter.done,
            unit="sample",
            dynamic_ncols=True,
            smoothing=0.1,
        )

    def _start_producer(self) -> None:
        """Tokenize in a forked process (TOKENIZER_PROCESS), a thread here taking its batches onto
        the queue; or, without fork or with HSX_TOKENIZER=thread, tokenize on that thread."""
        windows = plan_windows(self.assigned, self.cfg.batch_size)
        items: Iterable[tuple[str, Any, Any]]
        if TOKENIZER_PROCESS and hasattr(os, "fork") and os.environ.get("HSX_TOKENIZER") != "thread":
            tokenizer, done = self.tokenizer, self.done
            self.producer_child = ChildGenerator(lambda: self._produce_portable(tokenizer, windows, done))
            items = self._from_portable(self.producer_child)
        else:
            items = self._produce_items(self.tokenizer, windows, self.done)
        self.producer = threading.Thread(
            target=self._produce, args=(items, self.batch_q), name="hsx-tokenize", daemon=True
        )
        self.producer.start()

    def _writer_process_wanted(self) -> bool:
        return (
            WRITER_PROCESS
            and self.cfg.backend == "hf"
            and hasattr(os, "fork")
            and os.environ.get("HSX_WRITER") != "thread"
        )

    def _start_writer_process(self) -> None:
        """Fork the writer process (before the model loads: the child must hold no CUDA state)
        with its shared buffer; or leave the writer to threads here."""
        if not self._writer_process_wanted():
            return
        m = self.manifest
        size = writer_buffer_bytes(
            self.cfg.batch_size,
            min(self.cfg.max_length or self.model_cfg["max_positions"], self.model_cfg["max_positions"]),
            (1 + m.num_aux) * m.hidden_size * self.itemsize,
        )
        threads = min(DRAIN_WRITER_THREADS, fmt.usable_cores())
        try:
            self.writer_proc = WriterProcess(self.publisher, Arena(size), self.writer_threads, threads)
        except OSError as e:  # no memory for the buffer, no process or pipe left: threads will do
            self.log(f"cannot start the writer process ({e}): shards published by threads")
            return
        self.log(
            f"shards published by a writer process (pid {self.writer_proc.pid}, {size / 2**20:.1f} MiB buffer)"
        )

    def _share_writer_buffer(self) -> None:
        """Let the forward's states go straight into the writer's buffer, where the backend can
        put them there (hf's `host_empty`).

        On a CPU the forward writes them there itself, and sends each batch to the writer process
        itself: nothing is left to copy or wait for, and a courier thread would only take the GIL
        from the forward (each hand-over a wait in the forward's next op: ~10 a batch). On a GPU
        the buffer is page-locked, so the device's copies land in it, and the courier waits for
        each batch's copy before it sends."""
        wp = self.writer_proc
        if wp is None:
            return
        extract_async = getattr(self.backend, "extract_async", None)
        shares = extract_async is not None and "host_empty" in inspect.signature(extract_async).parameters
        if not self.cfg.device.startswith("cuda"):
            self._host_empty_ok = shares
            self._forward_sends = shares or extract_async is None  # host tensors once the call returns
            return
        if not shares:
            return
        t0 = time.perf_counter()
        err = wp.arena.register_cuda(torch.device(self.cfg.device))
        self.timings["pin_s"] = time.perf_counter() - t0
        if err is not None:
            self.log(
                f"cannot pin the writer's buffer ({err}): states copied into it from torch's pinned memory"
            )
            return
        wp.arena.split(DEVICE_BUFFER_SHARE)
        self._host_empty_ok = True

    def _stop_writer_process(self) -> None:
        """Collect the writer process (killed if it still runs: an error path) and unpin its
        buffer; idempotent."""
        wp = self.writer_proc
        if wp is None:
            return
        self.writer_proc = None
        wp.close()
        wp.arena.close("the run has ended")
        try:
            wp.arena.release()
        except Exception as e:  # a broken CUDA context: the process ends soon anyway
            self.log(f"cannot unpin the writer's buffer: {e}")

    def _free(self, allocs: list[int]) -> None:
        if self.writer_proc is not None:
            for offset in allocs:
                self.writer_proc.arena.free(offset)

    def _courier(self, work_q: queue.Queue) -> None:
        """Hands the forward's batches to the writer process on a GPU: waits for each batch's copy
        to the host, then sends it (_send)."""
        wp = self.writer_proc
        assert wp is not None
        usage = thread_usage()
        try:
            while True:
                work = work_q.get()
                if work is None:
                    return
                self._deliver(work)
        except BaseException as e:  # never leave the forward thread blocked on a full queue
            self._sending_failed(e)
            while (work := work_q.get()) is not None:
                self._free_after_copies(work)
        finally:
            wp.end()
            _record_usage(self.timings, "courier", usage)

    def _send(self, work: _Work) -> None:
        """Send a batch to the writer process: its states that are not in the shared buffer yet
        put there first (the whole batch in one block where it can be, else sample by sample;
        a sample too long for the buffer published here)."""
        places = self._batch_into_buffer(work)
        wire: list[WireItem] = []
        blocks: list[int] = []
        for i, (s, st) in enumerate(zip(work.samples, work.results, strict=True)):
            if s.sample_id not in work.pending:
                continue
            place = places[i] if places is not None else None
            try:
                if place is not None:  # copied with its batch
                    hidden, aux = place
                else:
                    try:
                        hidden, aux = self._shared(st, blocks)
                    except ArenaFull:  # what it holds is this batch's: send that part first
                        if not wire:
                            raise
                        self._submit(work, wire, blocks)
                        wire, blocks = [], []
                        hidden, aux = self._shared(st, blocks)
            except (ValueError, ArenaFull) as e:  # longer than the buffer (no --max-length)
                self._publish_here(work, s, st, e)
                continue
            wire.append(
                WireItem(s.sample_id, s.input_ids.numpy(), s.loss_mask.numpy(), hidden, aux, st.finite)
            )
        self._submit(work, wire, blocks + work.allocs)  # its last part frees the whole batch's

    def _deliver(self, work: _Work) -> None:
        """A batch from the forward to the writer process (the courier's, or on a CPU the forward
        thread's own): dropped when the run has stopped writing, failed when its copy to the host
        did, else sent once its states are on the host."""
        if self._stopped_writing():
            self._free_after_copies(work)  # not written: these samples stay pending
            return
        if not self._wait_ready(work):
            self._free(work.allocs)
            return
        self._send(work)

    def _send_here(self, work: _Work) -> None:
        """The forward thread's own delivery (_forward_sends), failing as the courier fails."""
        try:
            self._deliver(work)
        except BaseException as e:  # its blocks stay taken, as the courier leaves them: the run ends
            self._sending_failed(e)

    def _sending_failed(self, e: BaseException) -> None:
        """Sending to the writer process failed: the run stops, and a forward waiting for space
        in the buffer wakes (no batch will free any now)."""
        reason = str(e) if isinstance(e, WriterGone) else self._writer_failed(e)
        self.stop_event.set()
        self.writer_proc.arena.close(reason)  # type: ignore[union-attr]

    def _batch_into_buffer(self, work: _Work) -> list[tuple[Place, Place] | None] | None:
        """Copy a batch's two state tensors whole into one block of the writer's buffer (padding
        and all): each result's (hidden, aux) place there as _shared gives it, None for a result
        whose states are not the first rows of its row; None for the whole batch when the states
        are in the buffer already (the usual case: a CPU forward writes them there, a GPU's copies
        land there) or the batch does not fit it (_shared then copies sample by sample).

        For the states in the backend's own memory (the buffer had no room for them when the
        forward began; a GPU's copies into torch's pinned memory). Why whole: each NumPy copy and
        torch call releases the GIL, and a CPU forward (whose ops release it too) then waits to
        take it back: a copy per sample and tensor made ~30 hand-overs a batch. Here: two copies,
        the rest integer arithmetic."""
        if work.batch is None or not any(s.sample_id in work.pending for s in work.samples):
            return None
        arena = self.writer_proc.arena  # type: ignore[union-attr]
        final, aux = work.batch
        if arena.offset_of(final) is not None or not (final.is_contiguous() and aux.is_contiguous()):
            return None
        try:
            block, (at_final, at_aux) = copy_into(arena, final, aux)
        except (ArenaFull, ValueError):
            return None
        work.allocs.append(block)  # freed with the batch's last part, as the device's blocks are
        (_, width, hidden), layers = final.shape, aux.shape[2]
        row_final, row_aux = width * hidden * final.element_size(), width * layers * aux.element_size()
        ptr_final, ptr_aux = final.data_ptr(), aux.data_ptr()
        name_final, name_aux = dtype_name(final.dtype), dtype_name(aux.dtype)
        places: list[tuple[Place, Place] | None] = []
        for row, st in enumerate(work.results):
            h, a = st.hidden_state, st.aux_hidden_state
            n = h.shape[0]
            if (
                h.data_ptr() != ptr_final + row * row_final
                or a.data_ptr() != ptr_aux + row * row_aux
                or tuple(h.shape) != (n, hidden)
                or tuple(a.shape) != (n, layers)
                or h.dtype != final.dtype
                or a.dtype != aux.dtype
            ):
                places.append(None)
                continue
            places.append(
                (
                    (at_final + row * row_final, (n, hidden), name_final),
                    (at_aux + row * row_aux, (n, layers), name_aux),
                )
            )
        return places

    def _free_after_copies(self, work: _Work) -> None:
        """Free a batch's blocks that were never sent, once its copies into them are done."""
        if work.allocs and work.ready is not None:
            try:
                work.ready()
            except Exception:  # a device error: nothing is copying any more
                pass
        self._free(work.allocs)

    def _publish_here(self, work: _Work, sample: Sample, st: SampleStates, why: Exception) -> None:
        """A sample too long for the writer's buffer, published by this process beside the writer
        process (temp names carry the pid; index lines are appended whole, with O_APPEND)."""
        if not self._published_here:
            self.log(f"sample {sample.sample_id!r}: {why}: published by the runner itself (set --max-length)")
        self._published_here += 1
        item = Item(
            sample.sample_id,
            sample.input_ids,
            sample.loss_mask,
            st.hidden_state,
            st.aux_hidden_state,
            st.finite,
        )
        self._apply(work, self.publisher.publish([item], 1, self._stopped_writing))

    def _submit(self, work: _Work, wire: list[WireItem], blocks: list[int]) -> None:
        """Send (part of) a batch; its outcome will free `blocks`."""
        assert self.writer_proc is not None
        batch_id = next(self._batch_ids)
        with self._in_writer_lock:
            self._in_writer[batch_id] = (work, blocks)
        self.writer_proc.submit(batch_id, wire)
        self.writer_proc.arena.mark_sent(blocks)  # after: a send that failed leaves none to wait for

    def _shared(self, st: SampleStates, blocks: list[int]) -> list[Place]:
        """(offset, shape, dtype name) of a sample's two state tensors in the writer's buffer,
        copied there first (one block, added to `blocks`) if they are not in it (the CPU's
        states, or a GPU's in torch's pinned memory)."""
        assert self.writer_proc is not None
        arena = self.writer_proc.arena
        tensors = (st.hidden_state, st.aux_hidden_state)
        offsets = [arena.offset_of(t) for t in tensors]
        if None in offsets:
            block, offsets = copy_into(arena, *tensors)
            blocks.append(block)
        return [(o, tuple(t.shape), dtype_name(t.dtype)) for o, t in zip(offsets, tensors, strict=True)]

    def _collect_outcomes(self) -> None:
        """Applies the writer process's outcomes as they come; a writer that failed or died ends
        the run as failed, and wakes a forward pass waiting for buffer space."""
        wp = self.writer_proc
        assert wp is not None
        usage = thread_usage()
        try:
            for batch_id, outcome in wp.outcomes():
                with self._in_writer_lock:
                    work, blocks = self._in_writer.pop(batch_id)
                self._free(blocks)
                self._apply(work, outcome)
        except BaseException as e:
            if isinstance(e, WriterGone):
                reason = str(e)
                if self.abort is None:
                    self.abort = reason
                self.log(reason)
            else:
                reason = self._writer_failed(e)
            self.stop_event.set()
            wp.arena.close(reason)
            wp.kill()
        finally:
            _record_usage(self.timings, "outcomes", usage)

    def _stop_producer(self) -> None:
        """Stop the tokenizer (process and thread; the thread may wait on a full queue) and join
        it; idempotent."""
        producer = self.producer
        if producer is None:
            return
        self.stop_event.set()
        if self.producer_child is not None:
            self.producer_child.close()  # its thread then reads the end of the pipe
        while True:
            try:
                if self.batch_q.get_nowait() is None:
                    break
            except queue.Empty:
                if not producer.is_alive():
                    break
                time.sleep(0.01)
        producer.join(timeout=5)
        self.producer = self.producer_child = None

    def _pipeline(self) -> None:
        batch_q = self.batch_q
        write_q: queue.Queue = queue.Queue(maxsize=QUEUE_BATCHES)
        wp = self.writer_proc
        send_here = wp is not None and self._forward_sends  # else the courier sends (or no process)
        if send_here:
            writers = [threading.Thread(target=self._collect_outcomes, name="hsx-outcomes", daemon=True)]
        elif wp is not None:
            writers = [
                threading.Thread(target=self._courier, args=(write_q,), name="hsx-courier", daemon=True),
                threading.Thread(target=self._collect_outcomes, name="hsx-outcomes", daemon=True),
            ]
        else:
            writers = [threading.Thread(target=self._write, args=(write_q,), name="hsx-writer", daemon=True)]
        for writer in writers:
            writer.start()
        tm = self.timings
        last_bar = 0.0
        usage = thread_usage()
        try:
            while not self.stop_event.is_set():
                t0 = time.perf_counter()
                work = batch_q.get()
                t1 = time.perf_counter()
                tm["forward_wait_batch_s"] += t1 - t0
                if work is None:
                    break
                done = self._forward(work)
                t2 = time.perf_counter()
                tm["forward_s"] += t2 - t1
                if done is None:  # nothing to write: what its attempts took is free again
                    self._free_failed_attempt()
                else:
                    done.allocs, self._allocs = self._allocs, []
                    if send_here:
                        self._send_here(done)
                        tm["forward_send_s"] += time.perf_counter() - t2
                    else:
                        write_q.put(done)
                        tm["forward_wait_writer_s"] += time.perf_counter() - t2
                if self.bar is not None and time.monotonic() - last_bar > 1:
                    last_bar = time.monotonic()
                    snap = self.reporter.snapshot_rates()
                    self.bar.set_postfix(tok_s=f"{snap[1]:.0f}", errors=self.reporter.errors, refresh=False)
        finally:
            _record_usage(tm, "forward_thread", usage)
            t0 = time.perf_counter()
            self.forward_done.set()
            if self.writer_proc is not None:
                self.writer_proc.arena.set_flag(FLAG_DRAIN)
            self._stop_producer()
            if send_here:
                wp.end()  # type: ignore[union-attr]  # the courier's last word otherwise
            write_q.put(None)
            for writer in writers:
                while writer.is_alive():
                    writer.join(timeout=0.5)
            tm["pipeline_end_at"] = time.perf_counter()
            tm["pipeline_end_cpu_at"] = time.process_time()
            tm["pipeline_end_faults_at"] = _minor_faults()
            tm["drain_s"] = tm["pipeline_end_at"] - t0

    def _finish(self) -> int:
        r = self.reporter
        if self.abort is not None and self.pause is not None:
            # A failure beside a pause (a full disk's own failures are pauses: _writer_failed): the
            # job unit restarts a failure and leaves a pause to a person, whose "free space" would
            # be the wrong advice. The restart finds the disk as it is and pauses again if need be.
            msg = f"{self.abort} (the run had also paused: {self.pause})"
            r.set_state("failed", msg)
            self.log(f"aborting: {msg}")
            return EXIT_FAILED
        if self.pause is not None:
            free = self.guard.last_free
            msg = (
                f"free {free} bytes < reserve {self.guard.reserve} bytes + next shard"
                if isinstance(self.pause, DiskLow)
                else f"disk full while writing ({self.pause}); free {free} bytes"
            )
            r.set_state("paused: disk low", msg + "; free space and run again to resume")
            self.log(f"paused: {msg}; exit {EXIT_PAUSED}")
            return EXIT_PAUSED
        if self.stop_signal is not None:
            r.set_state("interrupted", f"stopped by {signal.Signals(self.stop_signal).name}")
            return EXIT_SIGINT if self.stop_signal == signal.SIGINT else EXIT_SIGTERM
        if self.abort is not None:
            r.set_state("failed", self.abort)
            self.log(f"aborting: {self.abort}")
            return EXIT_FAILED
        missing = r.total - r.done
        if missing > 0:
            msg = f"{missing} sample(s) failed (see {ERRORS_NAME}); run again to retry them"
            r.set_state("failed", msg)
            self.log(msg)
            return EXIT_FAILED
        r.set_state("done", f"{r.written} written, {r.skipped_existing} already there")
        self.log(f"done: {r.done}/{r.total} samples ({r.written} written this run)")
        return EXIT_OK


def iter_batches_for_bench(
    cfg: ExtractConfig, entries: list[DatasetEntry], tokenizer: ChatTokenizer
) -> Iterator[list[Sample]]:
    """The runner's own batch plan, for benchmarks comparing it with a bare forward loop."""
    for window in plan_windows(entries, cfg.batch_size):
        samples = [tokenizer.encode(c) for c in read_conversations(cfg.dataset, window)]
        yield from batches_of_window(samples, cfg.batch_size)
