"""Run a generator in a forked child process and read its items back through a pipe.

Why: the runner's tokenizing is Python (the chat template is rendered by jinja) and, on a thread,
takes the GIL from the forward pass for ~0.3-0.6 ms per sample. In a child forked before the model
loads it runs on another core under its own GIL; this process only unpickles the results (numpy
arrays: tens of microseconds a batch).

The child shares nothing with this process after the fork but the pipe: it never touches the
output directory, and it ends by itself when this process goes away (its next write fails), so a
kill -9 of the runner leaves nothing behind that matters.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

FRAME = struct.Struct("<Q")  # a message: its pickle's length, then the pickle
_ITEM, _END, _FAILED = 0, 1, 2


class ChildFailed(RuntimeError):
    """The child raised, or died before it said it was done."""


class ChildGenerator:
    """`for item in ChildGenerator(make_items)`: make_items() runs in a forked child."""

    def __init__(self, make_items: Callable[[], Iterable[Any]]):
        r, w = os.pipe()
        # While the child lives, a page this process writes that the child still shares is copied
        # first (a fault, and a TLB flush across this process's threads). The cyclic GC writes to
        # every object it tracks on a full collection: frozen (left out of collections for good,
        # as the gc docs advise before a fork), the objects from before the fork stay unwritten.
        # Thawed by close(), unless this process had frozen objects itself.
        self._thaw = gc.get_freeze_count() == 0
        gc.freeze()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the caller's code
            os.close(r)
            _child(make_items, w)
        os.close(w)
        self.pid: int | None = pid
        self._status = ""
        self._lock = threading.Lock()
        self._file = os.fdopen(r, "rb")

    def __iter__(self) -> Iterator[Any]:
        """The child's items, read on whichever thread iterates (which owns the pipe's end)."""
        read = self._file.read
        try:
            while True:
                head = read(FRAME.size)
                if len(head) < FRAME.size:
                    raise ChildFailed(f"the child process ended without finishing ({self._collect()})")
                (n,) = FRAME.unpack(head)
                payload = read(n)
                if len(payload) < n:
                    raise ChildFailed(f"the child process ended mid-message ({self._collect()})")
                kind, value = pickle.loads(payload)
                if kind == _END:
                    self._collect()
                    return
                if kind == _FAILED:
                    raise ChildFailed(value)
                yield value
        finally:
            self._file.close()

    def close(self) -> None:
        """Stop the child if it still runs, and collect it: the iterating thread then reads the
        end of the pipe. Idempotent, from any thread."""
        with self._lock:
            if self.pid is not None:
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._collect()
        if self._thaw:  # here, not when the items end: a full collection then could stall the
            self._thaw = False  # consumer (the forward pass) mid-run
            gc.unfreeze()  # cycles made before the fork are collectable again

    def _collect(self) -> str:
        """Wait for the child (once) and say how it ended."""
        with self._lock:
            if self.pid is not None:
                self._status = reap(self.pid)
                self.pid = None
            return self._status


def reap(pid: int) -> str:
    """Wait for a child process and say how it ended ("exit status N", "killed by SIGKILL")."""
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:  # collected by someone else's wait()
        status = 0
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.WEXITSTATUS(status)}"


def _child(make_items: Callable[[], Iterable[Any]], w: int) -> None:
    """Send each item, then the end (or the failure); exit without running the parent's code."""
    code = 0
    try:
        # A Ctrl-C reaches the whole process group and `systemctl stop` sends SIGTERM to the whole
        # control group: the parent decides when this child stops (it stops itself cleanly, then
        # kills the child); a child that died of the same signal first would read as a failure.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            for item in make_items():
                _send(w, _ITEM, item)
            _send(w, _END, None)
        except BrokenPipeError:  # the parent has gone or stopped listening
            code = 1
        except BaseException as e:  # told to the parent, which raises it there
            _send(w, _FAILED, f"{type(e).__name__}: {e}")
            code = 1
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _send(w: int, kind: int, value: Any) -> None:
    send_message(w, (kind, value))


def send_message(fd: int, message: Any) -> None:
    """Write one framed message (FRAME) to a pipe, whole."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(FRAME.pack(len(payload)) + payload)
    while view:
        view = view[os.write(fd, view) :]
