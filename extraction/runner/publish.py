"""Publish: the Publisher a run uses (one option chooses it), and the in-process one.

Contract:
- `make_publisher` builds the Publisher `--publisher` names (ExtractConfig.publisher): `process`
  (ProcessPublisher, extraction/runner/publish_process.py: a forked writer process), `thread`
  (ThreadPublisher, below), or `auto`: process for the in-process hf backend, thread for the
  sglang backend (whose forward runs in the server). Where no process can be had (no fork, no
  memory for its buffer, no pipe) it says so and falls back to threads: same shards.
- ThreadPublisher: one writer thread takes each batch off a queue of QUEUE_BATCHES (sglang:
  STREAM_QUEUE_WORKS; the forward waits when it is full), waits for its states to be on the host, and publishes it with the
  BatchPublisher, `writer_threads` shards at once (the order of index lines is the only thing
  that changes); once the forward pass is over, with drain_threads(). A writer that fails
  stops the run and keeps emptying the queue, so the forward never blocks on it. It never
  touches the GPU.
- `default_writer_threads`: the shards of a batch written at once: 1 on <= 4 usable cores, else 2
  (sglang: 2).
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any

from extraction.inputs.config import ExtractConfig
from extraction.publish.publisher import BatchPublisher, Publisher, Work, drain_threads, wait_ready
from extraction.runner.lifecycle import Lifecycle
from extraction.runner.plan import QUEUE_BATCHES
from extraction.runner.stream import STREAM_QUEUE_WORKS
from hsx import cores
from hsx.manifest import RunManifest


def default_writer_threads(backend: str = "hf") -> int:
    """More writer threads hold the GIL more, which slows a forward pass in this process. The
    sglang backend's forward runs in the server: 2, whatever the cores (one shard's fsync then
    overlaps the next one's write: stream.py hands them over in twos when they wait)."""
    if backend == "sglang":
        return 2
    return 1 if cores.usable_cores() <= 4 else 2


def publisher_kind(cfg: ExtractConfig) -> str:
    """ "process" or "thread", as --publisher asks (auto: process for the hf backend)."""
    if cfg.publisher == "auto":
        return "process" if cfg.backend == "hf" else "thread"
    return cfg.publisher


def make_publisher(
    cfg: ExtractConfig,
    manifest: RunManifest,
    max_positions: int,
    batch_publisher: BatchPublisher,
    ledger: Lifecycle,
    writer_threads: int,
) -> Publisher:
    """The run's Publisher (see the module's contract). A process is forked here: call it before
    the backend loads and before any other helper is forked."""
    if publisher_kind(cfg) == "process":
        if not hasattr(os, "fork"):
            ledger.log("no fork here: shards published by threads")
        else:
            from extraction.runner.publish_process import ProcessPublisher

            try:
                return ProcessPublisher(cfg, manifest, max_positions, batch_publisher, ledger, writer_threads)
            except OSError as e:  # no memory for the buffer, no process or pipe left: threads will do
                ledger.log(f"cannot start the writer process ({e}): shards published by threads")
    # sglang: the stream's window is the buffer; a short queue bounds the dumps held (stream.py)
    works = STREAM_QUEUE_WORKS if cfg.backend == "sglang" else QUEUE_BATCHES
    return ThreadPublisher(batch_publisher, ledger, writer_threads, works)


class ThreadPublisher:
    """Writer threads in the runner's process (see the module's contract)."""

    kind = "thread"
    put_key = "forward_wait_writer_s"
    host_empty = None  # published from the backend's own host memory

    def __init__(
        self, batch_publisher: BatchPublisher, ledger: Lifecycle, writer_threads: int, queue_works: int = QUEUE_BATCHES
    ):
        self.batch_publisher = batch_publisher
        self.ledger = ledger
        self.writer_threads = writer_threads
        self._queue: queue.Queue = queue.Queue(maxsize=queue_works)
        self._thread: threading.Thread | None = None

    def attach(self, backend: Any) -> None:
        pass

    def start(self) -> None:
        self._thread = threading.Thread(target=self._write, name="hsx-writer", daemon=True)
        self._thread.start()

    def put(self, work: Work) -> None:
        self._queue.put(work)

    def release_attempt(self) -> None:
        pass

    def drain(self) -> None:
        pass  # the writer reads ledger.forward_done itself

    def finish(self) -> None:
        self._queue.put(None)
        thread = self._thread
        while thread is not None and thread.is_alive():
            thread.join(timeout=0.5)

    def abandon(self) -> None:
        pass  # the writer reads ledger.stopped_writing() itself

    def close(self) -> None:
        self.batch_publisher.close()

    def _write(self) -> None:
        """The writer thread: waits for each batch's copy to the host, publishes its shards
        (BatchPublisher: disk guard, atomic publish, one index commit). Never touches the GPU."""
        try:
            self._write_loop()
        except BaseException as e:  # stop the run, and never leave the forward thread blocked
            self.ledger.writer_failed(e)  # on a full queue
            self.ledger.stop_event.set()
            while self._queue.get() is not None:  # the forward thread puts None last
                pass
        finally:
            self.batch_publisher.close()

    def _publish_threads(self) -> int:
        """How many shards of a batch are written at once: the run's writer threads - or the
        drain's, once the forward pass is over and nothing competes."""
        if self.ledger.forward_done.is_set():
            return drain_threads(self.writer_threads)
        return self.writer_threads

    def _write_loop(self) -> None:
        ledger, stopped = self.ledger, self.ledger.stopped_writing
        while True:
            work = self._queue.get()
            if work is None:
                return
            if stopped():
                continue  # drained, not written: these samples stay pending
            if not wait_ready(work, ledger):
                continue
            outcome = self.batch_publisher.publish(work.items(), self._publish_threads(), stopped)
            ledger.apply(work, outcome)
