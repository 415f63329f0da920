"""Tokenization in a child process, so the forward pass does not wait for the GIL.

On a GPU the hf backend's forward is Python launching kernels; every stretch of Python another
thread runs holds it up. After the shard writer stopped pickling through torch.save, the largest
such stretch was the chat template (jinja) and the tokenizer's Python: ~0.4 ms per sample. The
child reads the same dataset rows by their offsets, tokenizes them with the same `ChatTokenizer`
and sends back each sample's ids and mask as numpy arrays (raw bytes in the pipe); the parent
wraps them without a copy. Same code, same samples: a test compares every sample with the
in-thread path.

Frames on the pipes: 8-byte little-endian length + pickle (both ends are this file, same Python).
The child ignores SIGINT/SIGTERM (the runner decides how to stop) and exits when its stdin closes,
which also happens when the runner dies.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import subprocess
import sys
from typing import Any, BinaryIO

from extraction.backends.base import Sample
from extraction.dataset import DatasetEntry, RowError

_LEN = struct.Struct("<Q")


class TokenizerProcessError(RuntimeError):
    """The child is gone or answered something unusable; the caller tokenizes itself."""


def _send(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LEN.pack(len(data)) + data)
    stream.flush()


def _recv(stream: BinaryIO) -> Any:
    head = stream.read(_LEN.size)
    if len(head) != _LEN.size:
        raise EOFError("the other end closed the pipe")
    (n,) = _LEN.unpack(head)
    data = stream.read(n)
    if len(data) != n:
        raise EOFError("the other end closed the pipe mid-frame")
    return pickle.loads(data)


class TokenizerProcess:
    """A child process tokenizing planned windows of the dataset, one request at a time."""

    def __init__(self, model_dir: str, max_length: int | None, dataset: str):
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from extraction.tokenize_worker import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in, self._out = self.proc.stdin, self.proc.stdout
        _send(self._in, {"model": model_dir, "max_length": max_length, "dataset": dataset})
        self._ready: bool | None = None  # None: still loading

    def ready(self) -> bool:
        """True once the child has loaded its tokenizer (never blocks); raises if it failed."""
        return self._poll(0)

    def wait_ready(self, timeout: float) -> bool:
        """Block up to `timeout` seconds for the child to finish loading."""
        return self._poll(timeout)

    def _poll(self, timeout: float) -> bool:
        if self._ready is None and select.select([self._out], [], [], timeout)[0]:
            try:
                hello = _recv(self._out)
            except EOFError:
                raise TokenizerProcessError(f"exited with {self.proc.poll()} while loading") from None
            if hello != "ready":
                raise TokenizerProcessError(str(hello))
            self._ready = True
        return bool(self._ready)

    def tokenize(self, entries: list[DatasetEntry]) -> list[Sample | RowError]:
        """The window's samples (or their RowErrors) in the order given."""
        import torch

        try:
            _send(self._in, [(e.sample_id, e.line, e.offset) for e in entries])
            answer = _recv(self._out)
        except (OSError, EOFError) as e:
            raise TokenizerProcessError(f"pipe: {e} (exit status {self.proc.poll()})") from None
        if not isinstance(answer, list) or len(answer) != len(entries):
            raise TokenizerProcessError(f"unexpected answer: {str(answer)[:200]}")
        out: list[Sample | RowError] = []
        for item in answer:
            if item[0] == "ok":
                _, sample_id, ids, mask, truncated, meta = item
                out.append(Sample(sample_id, torch.from_numpy(ids), torch.from_numpy(mask), truncated, meta))
            else:
                _, line, reason, sample_id = item
                out.append(RowError(line, reason, sample_id))
        return out

    def close(self) -> None:
        try:
            self._in.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()


def tokenize_window(tokenizer: Any, dataset: str, entries: list[DatasetEntry]) -> list[Sample | RowError]:
    """In-process tokenization of a window: what the child runs, and the fallback."""
    from extraction.dataset import read_conversations

    out: list[Sample | RowError] = []
    for conv in read_conversations(dataset, entries):
        try:
            out.append(tokenizer.encode(conv))
        except Exception as e:  # a template that cannot render this row: a data problem
            out.append(RowError(conv.line, f"tokenization failed: {e}", conv.sample_id))
    return out


def serve() -> None:
    """The child: load the tokenizer, then answer windows until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the frames
    try:
        setup = _recv(inp)
    except EOFError:
        return
    try:
        from extraction.dataset import ChatTokenizer, load_tokenizer

        tokenizer = ChatTokenizer(load_tokenizer(setup["model"]), setup["max_length"])
    except Exception as e:
        _send(out, f"cannot load the tokenizer from {setup['model']}: {e}")
        return
    _send(out, "ready")
    while True:
        try:
            request = _recv(inp)
        except EOFError:
            return
        entries = [DatasetEntry(sid, line, offset) for sid, line, offset in request]
        answer: list[tuple[Any, ...]] = []
        for item in tokenize_window(tokenizer, setup["dataset"], entries):
            if isinstance(item, RowError):
                answer.append(("error", item.line, item.reason, item.sample_id))
            else:
                answer.append(
                    (
                        "ok",
                        item.sample_id,
                        item.input_ids.numpy(),
                        item.loss_mask.numpy(),
                        item.truncated,
                        item.meta,
                    )
                )
        try:
            _send(out, answer)
        except BrokenPipeError:
            return
