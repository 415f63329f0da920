"""Forward: a planned batch through the backend, with retries, on the forward thread.

Contract:
- `Forward.forward(work)` returns the batch with its results (the states may still be on their
  way to the host: `work.ready` blocks until they are there), or None when it has nothing to
  publish. A batch is tried up to 1 + --retries times with doubling backoff (--retry-backoff); a
  stop during a backoff ends the tries. A batch that still fails is retried sample by sample to
  find the one that breaks it (those results are not bit-identical to the batched plan in fp32,
  but a failing batch has no bits to be identical to); each sample that fails is recorded with its
  attempts (ledger.sample_failed), the others are returned.
- A backend result must answer the batch it was given (count, ids, input ids); anything else is
  a failed attempt.
- A backend with `extract_async` (hf) only queues the batch; with the publisher's `host_empty`
  its states go straight into the publisher's memory. The one-by-one path never uses
  host_empty (what the failed batch holds there is not sent yet).
- Out of memory in the forward (is_out_of_memory) is never retried: the same allocation would
  fail again (and on a CPU host the next one may be the kernel's OOM killer's, for the whole run).
  A batch goes on to the one-by-one search at once; a sample alone that runs out of memory fails
  (errors.jsonl: "out of memory in the forward (not retried): ...", attempts 1), the run goes on.
- On a CPU device the forward runs on `cpu_forward_threads` torch threads, restored after.
- With a `batch_log` (runner/batchlog.py; the hf backend), every batch that ran is recorded there
  before it is returned (so before the publisher indexes any of it): its rows in order, and the
  ones it publishes; a sample of the one-by-one search, alone.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from extraction.backends.base import Backend, Sample, SampleStates
from extraction.inputs.config import ExtractConfig
from extraction.publish.publisher import Publisher, Work
from extraction.runner.batchlog import BatchLog
from extraction.runner.lifecycle import Lifecycle, RunError
from hsx import cores
from hsx.exitcodes import EXIT_FAILED
from hsx.manifest import RunManifest

OOM_REASON = "out of memory in the forward (not retried)"


def is_out_of_memory(error: BaseException) -> bool:
    """An allocation failed: torch.OutOfMemoryError (CUDA; torch's own checks), Python's
    MemoryError, or a RuntimeError whose allocator says so (torch's CPU allocator: "not enough
    memory"; others: "out of memory")."""
    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(error).lower() if isinstance(error, RuntimeError) else ""
    return "out of memory" in text or "not enough memory" in text


def _free_device_cache() -> None:
    """Give what a failed allocation left cached back to the device (CUDA), so the next batch
    starts from the memory it would have had."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def make_backend(cfg: ExtractConfig, layer_ids: list[int]) -> Backend:
    if cfg.backend == "hf":
        from extraction.backends.hf import HFBackend

        return HFBackend(cfg.model, layer_ids, dtype=cfg.dtype, device=cfg.device)
    from extraction.backends import sglang  # helper-owned; constructed from the same config

    return sglang.SGLangBackend.from_config(cfg, layer_ids)


def check_backend(backend: Backend, manifest: RunManifest, cfg: ExtractConfig) -> None:
    """The backend must serve the model run.json describes (hidden size, layers)."""
    info = backend.model_info()
    m = manifest
    if (info.hidden_size, info.num_layers) != (m.hidden_size, m.num_layers):
        raise RunError(
            f"the {cfg.backend} backend serves a model with hidden {info.hidden_size}, "
            f"{info.num_layers} layers; {cfg.model}/config.json says {m.hidden_size}, {m.num_layers}",
            EXIT_FAILED,
        )


def forward_cpu_threads(cores: int, writer_threads: int) -> int:
    """torch threads for a forward pass on the CPU: every core but one per writer thread and one
    for the tokenizer, where that leaves the forward >= 3/4 of the cores; else every core.

    torch's default takes every core, so the runner's own threads take cores from the forward's
    OpenMP team, which then waits at each barrier for the thread that lost its core. On few cores
    giving the forward fewer threads costs more than that."""
    keep = cores - writer_threads - 1
    return keep if keep >= 0.75 * cores else cores


def cpu_forward_threads(cfg: ExtractConfig, writer_threads: int) -> int | None:
    """torch's threads for a forward on a CPU device (None on another device): --cpu-threads,
    else OMP_NUM_THREADS's, else forward_cpu_threads' (at most the caller's setting)."""
    if cfg.backend != "hf" or not cfg.device.startswith("cpu"):
        return None
    if cfg.cpu_threads:
        return cfg.cpu_threads
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    # never more than the caller's: a process forked after OpenMP ran must keep 1 thread
    return min(torch.get_num_threads(), forward_cpu_threads(cores.usable_cores(), writer_threads))


@contextlib.contextmanager
def forward_threads(
    cfg: ExtractConfig, writer_threads: int, log: Callable[[str], None], timings: dict[str, float]
) -> Iterator[None]:
    """On a CPU device, torch's threads for the forward (cpu_forward_threads), restored after."""
    threads = cpu_forward_threads(cfg, writer_threads)
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    log(f"forward on {threads} torch threads ({cores.usable_cores()} cores here)")
    timings["forward_threads"] = threads
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Forward:
    """The forward stage (see the module's contract), for one backend and publisher."""

    def __init__(
        self,
        backend: Backend,
        cfg: ExtractConfig,
        ledger: Lifecycle,
        publisher: Publisher,
        batch_log: BatchLog | None = None,
    ):
        self.backend, self.cfg, self.ledger, self.publisher = backend, cfg, ledger, publisher
        self.batch_log = batch_log
        self._async = getattr(backend, "extract_async", None)
        host_empty = publisher.host_empty
        # into the publisher's memory where it gives some (the writer process's buffer)
        self._async_shared = (
            functools.partial(self._async, host_empty=host_empty)
            if self._async is not None and host_empty is not None
            else self._async
        )

    def forward(self, work: Work) -> Work | None:
        ledger = self.ledger
        results, ready, states, reason, attempts = self._try_extract(work.samples)
        if results is not None:
            ledger.consecutive_errors = 0
            work.results, work.ready, work.batch = results, ready, states
            self._note(work.samples, work.pending)
            return work
        if ledger.stop_event.is_set() and ledger.abort is None and ledger.pause is None:
            return None  # interrupted while backing off
        if len(work.samples) == 1:
            ledger.sample_failed(work.samples[0], reason, attempts)
            return None
        ledger.log(
            f"batch of {len(work.samples)} failed after {attempts} attempts ({reason}); trying one by one"
        )
        kept_samples, kept_results = [], []
        for s in work.samples:
            if s.sample_id not in work.pending:
                continue
            if ledger.stop_event.is_set():
                break
            res, ready, _, why, n = self._try_extract([s], shared=False)
            if res is not None and ready is not None:
                try:
                    ready()
                except Exception as e:
                    res, why = None, f"copy to host failed: {type(e).__name__}: {e}"
            if res is None:
                if not ledger.stop_event.is_set() or ledger.abort:
                    ledger.sample_failed(s, why, n)
                continue
            ledger.consecutive_errors = 0
            self._note([s], {s.sample_id})
            kept_samples.append(s)
            kept_results.append(res[0])
        return Work(kept_samples, work.pending, kept_results) if kept_samples else None

    def _note(self, samples: list[Sample], pending: set[str]) -> None:
        """The batch that ran, into the batch log (torch's threads on a CPU device)."""
        if self.batch_log is not None:
            threads = torch.get_num_threads() if self.cfg.device.startswith("cpu") else None
            self.batch_log.record(((s.sample_id, int(s.input_ids.numel())) for s in samples), pending, threads)

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
        states are on the host, and the publisher calls it, so this thread goes on at once."""
        reason = ""
        extract_async = self._async_shared if shared else self._async
        cfg, stop = self.cfg, self.ledger.stop_event
        for attempt in range(cfg.retries + 1):
            if attempt:
                delay = cfg.retry_backoff * 2 ** (attempt - 1)
                if stop.wait(delay):
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
                self.publisher.release_attempt()
                if is_out_of_memory(e):  # the same allocation again would fail the same way
                    _free_device_cache()
                    return None, None, None, f"{OOM_REASON}: {reason}", attempt + 1
        return None, None, None, reason, cfg.retries + 1

    @staticmethod
    def _check_results(batch: list[Sample], results: list[SampleStates]) -> None:
        if len(results) != len(batch):
            raise RuntimeError(f"backend returned {len(results)} results for {len(batch)} samples")
        for s, r in zip(batch, results, strict=True):
            if r.sample_id != s.sample_id:
                raise RuntimeError(f"backend returned {r.sample_id!r} where {s.sample_id!r} was expected")
            if r.input_ids is not s.input_ids and not bool((r.input_ids.cpu() == s.input_ids).all()):
                raise RuntimeError(f"{s.sample_id!r}: backend saw other input_ids than were sent")
