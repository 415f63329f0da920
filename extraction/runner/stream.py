"""Stream: a backend that serves samples one request at a time (sglang), a window always in flight.

The hf backend runs a planned batch as one forward (forward.py). A server backend has no batch of
ours to keep: the server batches the requests it has queued on its own. Waiting for a whole
planned batch before sending the next (a "round") leaves the server idle while the slowest request
of the round finishes, its dump is read and the round is published. Here instead:

Contract (for a backend with `extract_one(sample) -> SampleStates` and `window`, the requests it
wants in flight: SGLangBackend, `--concurrency`):
- The plan's pending samples are sent in plan order, with `window` of them in flight at all times
  (sent, and not yet handed to the publisher): a sample taken off the window frees its slot and
  the next is sent at once, across planned batches; no barrier anywhere.
- Samples whose states are in go to the publisher at once, in the order they complete: one to a
  Work, or those that came back while the forward thread waited in put() (the publisher busy: its
  one-Work queue full), up to `group` (its writer threads) to a Work, whose shards are written at
  once (one shard's fsync overlaps the other's write) and indexed with one commit. The index's
  order differs from run to run; nothing reads it in order (resume takes the indexed set). Samples done before are
  not sent at all (the hf backend re-runs a planned batch whole for bit-identity; a server's
  batching is not ours to reproduce).
- Each sample: up to 1 + --retries attempts with doubling backoff (--retry-backoff); a stop during
  a backoff ends them and leaves the sample pending, unless the run is aborting or pausing; a sample
  that still fails is recorded (ledger.sample_failed, with its attempts).
- A stop (signal, pause, abort): nothing more is sent; the requests in flight are finished and
  handed to the publisher, which publishes them unless it stopped writing (a second signal, a
  pause) - the same as the batch in flight on the hf path.
- Every call into the publisher and the ledger is made from the calling (forward) thread: a feeder
  thread sends, the backend's attempts run on `window` threads, their results come back here.
- Dumps held at once (on the server's dump file system, written or mapped): at most
  `dumps_held(window, group)`: the window, and `group` in the Work in the publisher's queue
  (STREAM_QUEUE_WORKS: the window is the stream's buffer) and in the one being published.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from extraction.backends.base import Sample, SampleStates
from extraction.publish.publisher import Work
from extraction.runner.forward import Forward


class StreamingBackend(Protocol):
    window: int  # requests it wants in flight

    def extract_one(self, sample: Sample) -> SampleStates: ...


def streams(backend: Any) -> bool:
    """True for a backend the runner streams samples to (one request each) instead of batches."""
    return callable(getattr(backend, "extract_one", None)) and int(getattr(backend, "window", 0)) > 0


def dumps_held(window: int, group: int) -> int:
    """Samples whose states may be held at once by a streamed run: the window, the thread
    publisher's queue (STREAM_QUEUE_WORKS Works of up to `group`) and the Work being published."""
    return window + (STREAM_QUEUE_WORKS + 1) * group


# Works the thread publisher's queue holds for a streamed run (the hf path's: plan.QUEUE_BATCHES).
STREAM_QUEUE_WORKS = 1
_FED = object()  # the feeder's last message: (_FED, samples sent)


class Stream:
    """The forward stage for a streaming backend (see the module's contract)."""

    def __init__(self, forward: Forward, group: int = 1):
        self.backend: StreamingBackend = forward.backend  # type: ignore[assignment]
        self.cfg, self.ledger, self.publisher = forward.cfg, forward.ledger, forward.publisher
        self.window = max(1, int(self.backend.window))
        self.group = max(1, int(group))
        self._slots = threading.Semaphore(self.window)
        self._done: queue.Queue = queue.Queue()

    def run(self, batch_q: queue.Queue, tick: Callable[[], None] = lambda: None) -> None:
        """Until the plan is done or the run stopped and what was sent came back: feeds the
        backend from `batch_q` (on a thread), publishes here. `tick` (the progress bar's rates) is
        called at most once a second."""
        tm = self.ledger.timings
        pool = ThreadPoolExecutor(self.window, thread_name_prefix="hsx-stream")
        feeder = threading.Thread(target=self._feed, args=(batch_q, pool), name="hsx-feed", daemon=True)
        feeder.start()
        sent, back, last_tick = None, 0, 0.0
        try:
            while sent is None or back < sent:
                came = [self._done.get()]
                while len(came) < self.group:  # what else came back while we waited in put()
                    try:
                        came.append(self._done.get_nowait())
                    except queue.Empty:
                        break
                for item in came:
                    if item[0] is _FED:
                        sent = item[1]
                came = [item for item in came if item[0] is not _FED]
                back += len(came)
                held = [got for got in (self._result(*item) for item in came) if got is not None]
                try:
                    if held:
                        self._put(held)
                finally:
                    for _ in came:
                        self._slots.release()
                if time.monotonic() - last_tick > 1:
                    last_tick = time.monotonic()
                    tick()
        except BaseException:
            self.ledger.stop_event.set()  # the feeder then sends nothing more and ends
            raise
        finally:
            feeder.join()
            pool.shutdown(wait=True)
            tm["stream_window"] = self.window

    def _feed(self, batch_q: queue.Queue, pool: ThreadPoolExecutor) -> None:
        """The feeder thread: each pending sample, in plan order, once a slot is free."""
        stop, tm = self.ledger.stop_event, self.ledger.timings
        sent = 0
        try:
            while not stop.is_set():
                t0 = time.perf_counter()
                work = batch_q.get()
                tm["forward_wait_batch_s"] += time.perf_counter() - t0
                if work is None:
                    break
                for sample in work.samples:
                    if sample.sample_id not in work.pending:
                        continue
                    while not self._slots.acquire(timeout=0.2):
                        if stop.is_set():
                            break
                    if stop.is_set():
                        break
                    future = pool.submit(self._attempts, sample)
                    future.add_done_callback(lambda f, s=sample: self._done.put((s, f)))
                    sent += 1
        except BaseException as e:  # never leave the forward thread waiting for a _FED
            self.ledger.fail(f"the stream's feeder failed: {type(e).__name__}: {e}")
        finally:
            self._done.put((_FED, sent))

    def _attempts(self, sample: Sample) -> tuple[SampleStates | None, str, int]:
        """Up to 1 + retries attempts with doubling backoff: (states or None, last error, attempts)."""
        cfg, stop = self.cfg, self.ledger.stop_event
        reason = ""
        for attempt in range(cfg.retries + 1):
            if attempt and stop.wait(cfg.retry_backoff * 2 ** (attempt - 1)):
                return None, reason or "stopped", attempt
            try:
                states = self.backend.extract_one(sample)
                Forward._check_results([sample], [states])
                return states, "", attempt + 1
            except Exception as e:  # any backend failure is retried; the reason goes to errors.jsonl
                reason = f"{type(e).__name__}: {e}"
        return None, reason, cfg.retries + 1

    def _result(self, sample: Sample, future: Future) -> tuple[Sample, SampleStates] | None:
        """A sample back from the backend: its states, or None when it failed (recorded, unless
        the run stopped while it was backing off: then left pending). On the forward thread."""
        ledger = self.ledger
        try:
            states, reason, attempts = future.result()
        except BaseException as e:  # _attempts catches Exception; this is a bug or an interrupt
            states, reason, attempts = None, f"{type(e).__name__}: {e}", 1
        if states is not None:
            ledger.consecutive_errors = 0
            return sample, states
        if not (ledger.stop_event.is_set() and ledger.abort is None and ledger.pause is None):
            ledger.sample_failed(sample, reason, attempts)
        return None

    def _put(self, held: list[tuple[Sample, SampleStates]]) -> None:
        """Samples whose states are in, to the publisher as one Work (on the forward thread)."""
        t0 = time.perf_counter()
        samples = [s for s, _ in held]
        self.publisher.put(Work(samples, {s.sample_id for s in samples}, [r for _, r in held]))
        self.ledger.timings[self.publisher.put_key] += time.perf_counter() - t0
