"""The Runner: one `hsx extract` invocation, the stages wired together and nothing else.

dataset -> plan (plan.py) -> tokenizer (produce.py) -> forward with retries (forward.py) ->
Publisher (publish.py: writer threads or a writer process) -> shards; resume (resume.py) decides
what is done before any of it starts, and the Lifecycle (lifecycle.py) holds the run's state,
its signals, status.json and the exit status.

Crash safety comes from the shard writer (temp -> fsync -> rename -> index line); the runner adds
what a long run needs around it: a resume that trusts only indexed shards passing `quick` (an
output with every sample done exits before the model loads: "already complete N/N"), a refusal
to mix runs, run.json written only once the run can start (the backend loaded and checked), one
run per output (a lock), a free-space guard, retries, clean stops on signals, and status.json.
Threads: the forward runs on the caller's thread; the tokenizer's feeder, the publisher's threads
and the status thread run beside it.
"""

from __future__ import annotations

import os
import queue
import sys
import time
from collections.abc import Callable

from extraction.backends.base import Backend
from extraction.inputs.config import ExtractConfig
from extraction.process import heap
from extraction.process.outputlock import OutputLock
from extraction.publish.diskguard import DiskGuard, estimate_shard_bytes
from extraction.publish.publisher import BatchPublisher, Publisher
from extraction.runner.batchlog import BatchLog
from extraction.runner.forward import (
    Forward,
    check_backend,
    cpu_forward_threads,
    forward_threads,
    make_backend,
)
from extraction.runner.lifecycle import Lifecycle, RunError
from extraction.runner.metrics import MetricsReporter, run_info
from extraction.runner.plan import node_samples, plan_windows, record_bucket_totals
from extraction.runner.produce import Producer, tokenize_ahead_batches
from extraction.runner.progress import closing_line
from extraction.runner.publish import default_writer_threads, make_publisher
from extraction.runner.resume import (
    ITEMSIZE,
    load_inputs,
    open_output,
    remove_empty_shards_dir,
    update_run_json,
    verified_done,
)
from extraction.runner.stream import Stream, streams
from extraction.runner.timing import minor_faults, new_timings, record_usage, thread_usage
from hsx.exitcodes import EXIT_FAILED, EXIT_OK
from hsx.status import ERRORS_NAME, StatusThread


class Runner:
    """One `hsx extract` invocation. `backend_factory` lets tests inject a backend. For tests and
    benchmarks that compare variants: `writer_threads` (shards of a batch written at once; 0:
    default_writer_threads()) and `tokenizer_process` (False: tokenize on a thread of this
    process). How shards are published is the config's `publisher`."""

    def __init__(
        self,
        cfg: ExtractConfig,
        backend_factory: Callable[[ExtractConfig, list[int]], Backend] = make_backend,
        log: Callable[[str], None] | None = None,
        *,
        writer_threads: int = 0,
        tokenizer_process: bool = True,
    ):
        self.cfg = cfg
        self.backend_factory = backend_factory
        self.log = log or (lambda msg: print(f"hsx extract: {msg}", file=sys.stderr, flush=True))
        self.timings = new_timings()
        self.life = Lifecycle(cfg, self.log, self.timings)
        self.forward_done = self.life.forward_done  # no batch will be put to the publisher any more
        self.writer_threads = writer_threads or default_writer_threads(cfg.backend)
        self.tokenizer_process = tokenizer_process
        self.output_lock = OutputLock(cfg.output)
        self.batch_q: queue.Queue = queue.Queue(
            maxsize=tokenize_ahead_batches(cfg.batch_size, cfg.max_length)
        )
        self.producer: Producer | None = None
        self.publisher: Publisher | None = None

    def prepare(self) -> None:
        """Everything before the first forward: may raise RunError (nothing written on a refusal)."""
        cfg, life = self.cfg, self.life
        inputs = load_inputs(cfg)
        self.model_cfg, self.layer_ids, self.scan = inputs.model_cfg, inputs.layer_ids, inputs.scan
        self.tokenizer, self.manifest = inputs.tokenizer, inputs.manifest
        self.bound_change = inputs.bound_change
        self.itemsize = ITEMSIZE[self.manifest.dtype]
        self.writer = open_output(cfg.output, self.manifest, self.output_lock, self.log)
        self.assigned = node_samples(self.scan.entries, cfg, self.manifest.buckets)
        if self.manifest.buckets:
            record_bucket_totals(cfg.output, self.manifest.buckets, cfg.assign, self.scan.entries, self.log)
        t0 = time.monotonic()
        self.done, bad = verified_done(
            cfg.output, self.manifest, {e.sample_id for e in self.assigned}, life.error
        )
        self.resume_seconds = time.monotonic() - t0
        if self.done or bad:
            self.log(
                f"resume: {len(self.done)} sample(s) already done, {bad} indexed shard(s) failed quick and "
                f"will be redone ({self.resume_seconds:.1f}s)"
            )
        estimate = estimate_shard_bytes(
            self.tokenizer.max_length or 0, self.manifest.hidden_size, self.manifest.num_aux, self.itemsize
        )
        self.guard = life.guard = DiskGuard(cfg.output, cfg.reserve_bytes, estimate)
        self.batch_publisher = BatchPublisher(self.writer, self.guard, self.itemsize)
        reporter = MetricsReporter(
            cfg.output,
            len(self.assigned),
            len(self.done),
            self.guard.reserve,
            info=run_info(cfg, self.manifest),
            shard_estimate=lambda: self.guard.largest,
            textfile_dir=cfg.metrics_textfile_dir,
            log=self.log,
        )
        self.reporter = life.reporter = reporter
        reporter.row_errors = len(self.scan.errors)
        reporter.extra = {
            "model": self.manifest.model,
            "dataset": os.path.abspath(cfg.dataset),
            "shard_index": cfg.shard_index,
            "num_shards": cfg.num_shards,
            "buckets": self.manifest.buckets,
            "assign": cfg.assign,
            "resume_seconds": round(self.resume_seconds, 3),
            "resume_bad_shards": bad,
        }
        for err in self.scan.errors:
            life.error(err.to_record())
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
        code = None
        try:
            code = self._extract()
            return code
        finally:  # every exit of a started run ends in one summary line (progress.closing_line)
            self.log(closing_line(self.reporter, code, self.cfg.output))

    def _extract(self) -> int:
        cfg, life, reporter, tm = self.cfg, self.life, self.reporter, self.timings
        if self.assigned and len(self.done) == len(self.assigned):  # nothing to load the model for
            n = len(self.assigned)
            reporter.set_state("done", f"already complete: {n}/{n}")
            reporter.write()
            self.writer.close()
            self.log(f"already complete: {n}/{n} samples in {cfg.output}; nothing to do (the model was not loaded)")
            return EXIT_OK
        handlers = life.install_signals()
        reporter.set_state("starting", "loading the model")
        reporter.write()
        left = reporter.total - reporter.done
        self.log(f"starting: {left} of {reporter.total} samples to do; loading the model ({cfg.backend} backend)")
        status_thread = None
        batch_log: BatchLog | None = None
        if cpu_forward_threads(cfg, self.writer_threads) is not None:
            heap.keep_freed_memory()  # before the forks: the helpers keep theirs too
        heap.release_free_memory()  # what the heap holds free now would be shared with the helpers
        try:
            # The writer process first: no thread of this run is running yet to fork beside. Then
            # the tokenizer, which tokenizes the first batches while the model loads (the first
            # planning window must be tokenized whole before its first batch exists).
            self.publisher = make_publisher(
                cfg,
                self.manifest,
                self.model_cfg["max_positions"],
                self.batch_publisher,
                life,
                self.writer_threads,
            )
            life.on_abandon = self.publisher.abandon
            windows = plan_windows(self.assigned, cfg.batch_size)
            self.producer = Producer(
                cfg,
                self.tokenizer,
                windows,
                self.done,
                self.batch_q,
                life,
                self.output_lock,
                self.tokenizer_process,
            )
            self.producer.start()
            t0 = time.perf_counter()
            try:
                self.backend = self.backend_factory(cfg, self.layer_ids)
            except Exception as e:
                reporter.set_state("failed", f"cannot start the {cfg.backend} backend: {e}")
                reporter.write()  # status.json and the metrics say failed, not starting
                self.log(f"cannot start the {cfg.backend} backend: {e}")
                return EXIT_FAILED
            self.publisher.attach(self.backend)
            tm["ready_at"] = time.perf_counter()
            tm["ready_cpu_at"] = time.process_time()
            tm["ready_faults_at"] = minor_faults()
            tm["model_load_s"] = tm["ready_at"] - t0
            check_backend(self.backend, self.manifest, cfg)
            self.writer.commit_manifest()  # the run can start: now a new output gets its run.json
            if self.bound_change is not None:
                update_run_json(cfg.output, self.manifest)
                old, new = self.bound_change["from"], self.bound_change["to"]
                self.log(
                    f"max_length: bound tightened from {old if old is not None else 'none'} to {new} tokens: "
                    f"samples already done keep theirs, new ones are cut at {new} (run.json: bound_history)"
                )
            reporter.set_state("running")
            reporter.write()
            lines = life.open_bar()
            tick = life.refresh_free if lines is None else lambda: (life.refresh_free(), lines.tick())
            status_thread = StatusThread(reporter, cfg.status_interval, tick)
            status_thread.start()
            if cfg.backend == "hf":  # what the canary rebuilds (a server makes its own batches)
                batch_log = BatchLog(cfg.output, cfg.device, self.log)
            with forward_threads(cfg, self.writer_threads, self.log, tm):
                self._pipeline(Forward(self.backend, cfg, life, self.publisher, batch_log))
        except RunError as e:
            reporter.set_state("failed", str(e))
            self.log(str(e))
            return e.code
        finally:
            if self.producer is not None:
                self.producer.stop()
            if self.publisher is not None:
                self.publisher.close()
            if batch_log is not None:
                batch_log.close()
            if status_thread is not None:
                status_thread.stop()
            life.restore_signals(handlers)
            if life.bar is not None:
                life.bar.close()
            self.writer.close()
            if self.writer.manifest_pending:  # the start failed: leave a new output as it was found
                remove_empty_shards_dir(cfg.output)
            backend = getattr(self, "backend", None)
            if backend is not None:
                try:
                    backend.close()
                except Exception:
                    pass
        code = life.exit_code()
        reporter.write()
        return code

    def _pipeline(self, forward: Forward) -> None:
        """The forward thread: batches off the tokenizer's queue, through the forward, to the
        publisher, until the plan is done or the run stops; then the drain."""
        life, publisher, batch_q, tm = self.life, self.publisher, self.batch_q, self.timings
        assert publisher is not None and self.producer is not None
        publisher.start()
        stop, put_key = life.stop_event, publisher.put_key
        last_bar = 0.0
        usage = thread_usage()
        try:
            if streams(forward.backend):  # sglang: a window of requests in flight, no batch barrier
                tick = life.bar_postfix if life.bar is not None else lambda: None
                return Stream(forward, self.writer_threads).run(batch_q, tick)
            while not stop.is_set():
                t0 = time.perf_counter()
                work = batch_q.get()
                t1 = time.perf_counter()
                tm["forward_wait_batch_s"] += t1 - t0
                if work is None:
                    break
                done = forward.forward(work)
                t2 = time.perf_counter()
                tm["forward_s"] += t2 - t1
                if done is None:  # nothing to publish: what its attempts took is free again
                    publisher.release_attempt()
                else:
                    publisher.put(done)
                    tm[put_key] += time.perf_counter() - t2
                if life.bar is not None and time.monotonic() - last_bar > 1:
                    last_bar = time.monotonic()
                    life.bar_postfix()
        finally:
            record_usage(tm, "forward_thread", usage)
            t0 = time.perf_counter()
            life.forward_done.set()
            publisher.drain()
            self.producer.stop()
            publisher.finish()
            tm["pipeline_end_at"] = time.perf_counter()
            tm["pipeline_end_cpu_at"] = time.process_time()
            tm["pipeline_end_faults_at"] = minor_faults()
            tm["drain_s"] = tm["pipeline_end_at"] - t0
