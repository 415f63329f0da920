"""One HTTP POST whose whole reply has a deadline and a size cap (the client's POST /generate).

urllib's `timeout` bounds each socket operation, not the reply: a server that sends a byte every
few seconds never times out, and `read()` buffers a body of any size. `post` bounds both:

- the deadline covers everything from the connection to the body's last byte (status line and
  headers included): a timer shuts the socket down when it passes, which ends any read blocked
  on it; ReplyLimit says so;
- the body is refused past `max_bytes`: at once when Content-Length says more, else once that
  many bytes have come (never more is read); ReplyLimit says so.

A connection that fails (refused, reset, closed unanswered, a read timeout) raises the OSError or
http.client.HTTPException as it came: the caller's "no answer" (a server restarting).
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass


class ReplyLimit(Exception):
    """The reply broke the deadline (`limit` "deadline") or the size cap ("size"); the message
    says which and its value."""

    def __init__(self, limit: str, message: str):
        super().__init__(message)
        self.limit = limit


@dataclass
class Reply:
    status: int
    body: bytes


def post(
    url: str, body: bytes, headers: dict[str, str], *, read_timeout: float, deadline: float, max_bytes: int
) -> Reply:
    """POST `body` to `url` (http or https); the reply's status and body, read whole within
    `deadline` seconds and at most `max_bytes` long (ReplyLimit otherwise); `read_timeout` still
    bounds each read."""
    parts = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname or "", parts.port, timeout=min(read_timeout, deadline))
    expired = threading.Event()
    held: list[socket.socket] = []  # the connection's socket (conn.sock is None once the reply
    # says the connection closes after it, while the reply is still read from that socket)

    def cut() -> None:
        expired.set()
        for sock in held:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a read blocked on it
            except OSError:
                pass

    started = time.monotonic()
    timer = threading.Timer(deadline, cut)
    timer.daemon = True
    timer.start()
    try:
        conn.connect()
        held.append(conn.sock)
        if expired.is_set():  # passed while connecting, before there was a socket to cut
            raise OSError("deadline passed while connecting")
        path = parts.path or "/"
        conn.request("POST", path + (f"?{parts.query}" if parts.query else ""), body=body, headers=headers)
        resp = conn.getresponse()
        length = resp.getheader("Content-Length")
        if length is not None and length.strip().isdigit() and int(length) > max_bytes:
            raise ReplyLimit(
                "size", f"{url} announced a reply of {int(length)} bytes, over the cap of {max_bytes}"
            )
        data = resp.read(max_bytes + 1)  # a cut socket ends it early, without an error
        if expired.is_set():
            raise OSError("deadline passed while reading")
        if len(data) > max_bytes:
            raise ReplyLimit("size", f"{url} sent a reply over the cap of {max_bytes} bytes")
        if length is not None and length.strip().isdigit() and len(data) < int(length):
            raise http.client.IncompleteRead(data, int(length) - len(data))
        return Reply(resp.status, data)
    except (OSError, http.client.HTTPException):
        if expired.is_set():
            raise ReplyLimit(
                "deadline",
                f"{url} did not send its whole reply within {deadline:g}s "
                f"(after {time.monotonic() - started:.1f}s)",
            ) from None
        raise
    finally:
        timer.cancel()
        conn.close()
