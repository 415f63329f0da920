"""Produce: the plan's batches, tokenized, onto the forward's queue ahead of it.

Contract:
- Puts a `Work(samples, pending)` on the queue for each planned batch that holds at least one
  pending (not done) sample, in plan order, the batch whole (done samples too: see plan.py);
  then None, always, also when stopped or failed.
- A row the chat template cannot render is a data error: recorded (ledger.row_error, with its
  line) and left out; the run goes on.
- A pending sample cut to the model's context (no --max-length given: a cut nobody asked for) is
  recorded in errors.jsonl, kind "truncated" (not an error: its shard is written).
- By default it tokenizes in a child forked before the model loads (extraction/process/childgen.py; its
  Python never holds this process's GIL), a thread here only putting its batches on the queue;
  `in_process=False` (or no fork) tokenizes on that thread. Either way the same samples, bit for
  bit. The child never writes to the output (it drops the output's lock at once), ignores
  SIGINT/SIGTERM, and dies with the pipe.
- The queue holds TOKENIZE_AHEAD_BYTES of token tensors (at least QUEUE_BATCHES batches), so
  the first batches are tokenized while the model loads.
- A tokenizer child that dies or raises ends the run as failed, with the reason (ledger.fail).
- stop() stops and joins it (idempotent): it sets the run's stop_event.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from extraction.backends.base import Sample
from extraction.inputs.chat_tokenizer import ChatTokenizer
from extraction.inputs.config import ExtractConfig
from extraction.inputs.dataset import DatasetEntry, RowError, read_conversations
from extraction.inputs.preflight import UNTRUNCATED_TOKENS
from extraction.process.childgen import ChildFailed, ChildGenerator
from extraction.process.outputlock import OutputLock
from extraction.publish.publisher import Work
from extraction.runner.lifecycle import Lifecycle
from extraction.runner.plan import QUEUE_BATCHES, batches_of_window
from extraction.runner.timing import record_usage, thread_usage

# Token tensors (ids + mask, int64) the tokenizer may hold ahead of the forward (the batch queue). It
# starts before the model loads (minutes for a real target), so a run's first tens of thousands of
# samples are tokenized before the first forward. A batch is counted at its longest possible size.
TOKENIZE_AHEAD_BYTES = 256 << 20


def tokenize_ahead_batches(batch_size: int, max_length: int | None) -> int:
    """How many tokenized batches may wait for the forward: TOKENIZE_AHEAD_BYTES' worth, at least QUEUE_BATCHES."""
    per_batch = max(1, batch_size) * (max_length or UNTRUNCATED_TOKENS) * 16
    return max(QUEUE_BATCHES, TOKENIZE_AHEAD_BYTES // per_batch)


def truncated_record(sample: Sample, bound: int | None) -> dict[str, Any]:
    """errors.jsonl's record of a sample cut to the model's context (no --max-length given)."""
    return {
        "kind": "truncated",
        "sample_id": sample.sample_id,
        "line": sample.meta.get("line"),
        "tokens": int(sample.input_ids.numel()),
        "reason": f"cut to the model's context of {bound} tokens (no --max-length given): the rest of "
        "the conversation is not in its shard",
    }


class Producer:
    """The tokenizer stage (see the module's contract)."""

    def __init__(
        self,
        cfg: ExtractConfig,
        tokenizer: ChatTokenizer,
        windows: list[list[DatasetEntry]],
        done: set[str],
        out: queue.Queue,
        ledger: Lifecycle,
        output_lock: OutputLock,
        in_process: bool = True,
    ):
        self.cfg, self.tokenizer, self.windows, self.done = cfg, tokenizer, windows, done
        self.out, self.ledger, self.output_lock = out, ledger, output_lock
        self.in_process = in_process and hasattr(os, "fork")
        self.thread: threading.Thread | None = None
        self.child: ChildGenerator | None = None

    def start(self) -> None:
        """Fork the tokenizer process (a thread here takes its batches onto the queue), or
        tokenize on that thread."""
        items: Iterable[tuple[str, Any, Any]]
        if self.in_process:
            self.child = ChildGenerator(self._produce_portable)
            items = self._from_portable(self.child)
        else:
            items = self._produce_items()
        self.thread = threading.Thread(target=self._produce, args=(items,), name="hsx-tokenize", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop the tokenizer (process and thread; the thread may wait on a full queue) and join
        it; idempotent."""
        thread = self.thread
        if thread is None:
            return
        self.ledger.stop_event.set()
        if self.child is not None:
            self.child.close()  # its thread then reads the end of the pipe
        while True:
            try:
                if self.out.get_nowait() is None:
                    break
            except queue.Empty:
                if not thread.is_alive():
                    break
                time.sleep(0.01)
        thread.join(timeout=5)
        self.thread = self.child = None

    def _produce_items(self) -> Iterator[tuple[str, Any, Any]]:
        """The tokenizer's work, in order: ("batch", samples, pending ids) for each planned batch
        holding at least one pending sample, ("row_error", record, None) for a row that cannot be
        tokenized. Runs in the tokenizer process (or thread): it changes nothing here."""
        tokenizer, done, batch_size = self.tokenizer, self.done, self.cfg.batch_size
        note_cuts = self.cfg.max_length is None
        for window in self.windows:
            if all(e.sample_id in done for e in window):
                continue
            samples = []
            for conv in read_conversations(self.cfg.dataset, window, self.cfg.max_row_bytes):
                try:
                    samples.append(tokenizer.encode(conv))
                except Exception as e:  # a template that cannot render this row: a data problem
                    record = RowError(conv.line, f"tokenization failed: {e}", conv.sample_id).to_record()
                    yield "row_error", record, None
                    continue
                if note_cuts and samples[-1].truncated and conv.sample_id not in done:
                    yield "note", truncated_record(samples[-1], tokenizer.max_length), None
            for batch in batches_of_window(samples, batch_size):
                pending = {s.sample_id for s in batch if s.sample_id not in done}
                if pending:
                    yield "batch", batch, pending

    def _produce_portable(self) -> Iterator[tuple[str, Any, Any]]:
        """_produce_items for the tokenizer process: samples as numpy arrays, which pickle as
        their bytes (a tensor would pickle through torch.save, slowly, on both sides)."""
        # Its tensors are small and the parent may have used the intra-op thread pool before the
        # fork (an OpenMP pool is not fork-safe): one thread, no parallel regions here.
        torch.set_num_threads(1)
        self.output_lock.release()  # never writes there: a kill -9 of the runner frees the output at once
        for kind, value, pending in self._produce_items():
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

    def _produce(self, items: Iterable[tuple[str, Any, Any]]) -> None:
        """Tokenizer thread: takes the items (tokenized here, or received from the tokenizer
        process) onto the batch queue, and applies row errors."""
        stop, out = self.ledger.stop_event, self.out
        usage = thread_usage()
        try:
            for kind, value, pending in items:
                if stop.is_set():
                    break
                if kind == "row_error":
                    self.ledger.row_error(value)
                    continue
                if kind == "note":
                    self.ledger.error(value)
                    continue
                while not stop.is_set():
                    try:
                        out.put(Work(value, pending), timeout=0.2)
                        break
                    except queue.Full:
                        continue
        except ChildFailed as e:
            if not stop.is_set():
                self.ledger.fail(f"the tokenizer process failed: {e}")
        finally:
            out.put(None)
            record_usage(self.ledger.timings, "producer", usage)
