"""The sglang client against a tiny local HTTP server that misbehaves (#38): a reply that drips or
is oversized fails its sample with the server and the limit named; a dump directory others can
write is refused at start; strays in the dump directory are skipped and named once, never fatal."""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from extraction.backends.base import Sample
from extraction.backends.sglang import SGLangBackend, SGLangError
from extraction.sglang import hsx_dump_format

DRIP_BYTES, DRIP_PAUSE = 40, 0.05  # a drip that stops by itself after ~2 s
BIG = 64 << 10


class _Handler(BaseHTTPRequestHandler):
    mode = "ok"
    server_info = (200, b'{"disable_radix_cache": true}')  # GET /server_info: (status, body)

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._send(*type(self).server_info) if self.path == "/server_info" else self._send(200, b"{}")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        mode = type(self).mode
        if mode == "drip":
            self.send_response(200)
            self.send_header("Content-Length", str(DRIP_BYTES))
            self.end_headers()
            for _ in range(DRIP_BYTES):
                try:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                except OSError:  # the client cut it: stop
                    return
                time.sleep(DRIP_PAUSE)
        elif mode == "big":  # valid JSON, announced
            self._send(200, json.dumps({"text": "x" * BIG}).encode())
        elif mode == "big-unannounced":  # no Content-Length: the end is the connection's close
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(json.dumps({"text": "x" * BIG}).encode())
        else:
            self._send(200, b"{}")

    def _send(self, code: int, data: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server():
    handler = type("Handler", (_Handler,), {})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd, handler, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _sample() -> Sample:
    return Sample("s/000", torch.arange(3, 8), torch.ones(5, dtype=torch.long))


def _backend(url: str, dump_dir, **kw) -> SGLangBackend:
    return SGLangBackend(
        url, str(dump_dir), str(dump_dir), [1, 2, 3], health_timeout=5, dump_timeout=0.1, **kw
    )


def test_a_dripping_reply_fails_the_sample_at_the_deadline(server, tmp_path):
    _httpd, handler, url = server
    handler.mode = "drip"
    backend = _backend(url, tmp_path, reply_deadline=0.3)
    try:
        with pytest.raises(SGLangError) as e:
            backend.extract_one(_sample())
    finally:
        backend.close()
    assert f"s/000: {url}/generate did not send its whole reply within 0.3s" in str(e.value)
    assert "reply_deadline" in str(e.value)


@pytest.mark.parametrize("mode", ["big", "big-unannounced"])
def test_an_oversized_reply_is_refused_not_buffered(server, tmp_path, mode):
    _httpd, handler, url = server
    handler.mode = mode
    backend = _backend(url, tmp_path, reply_max_bytes=1024)
    try:
        with pytest.raises(SGLangError) as e:
            backend.extract_one(_sample())
    finally:
        backend.close()
    assert f"s/000: {url}/generate" in str(e.value) and "over the cap of 1024" in str(e.value)
    assert "reply_max_bytes" in str(e.value)


def test_a_dump_directory_others_can_write_is_refused_at_start(server, tmp_path):
    _httpd, _handler, url = server
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(SGLangError) as e:
        _backend(url, shared)
    assert str(e.value).startswith(f"dump directory {shared} is writable by every user (owner ")
    assert "mode 1777" in str(e.value) and f"chmod go-w {shared}" in str(e.value)


def test_strays_in_the_dump_directory_are_skipped_and_named_once(server, tmp_path):
    _httpd, _handler, url = server
    other = "hsx-0000dead-s-1"
    (tmp_path / hsx_dump_format.dump_name(other, 0)).mkdir()  # a directory named like another client's dump
    (tmp_path / f".{hsx_dump_format.dump_name(other, 16)}.{'9' * 20}.tmp").write_bytes(b"")
    said: list[str] = []
    backend = _backend(url, tmp_path, log=said.append)
    backend._sweep_stale(force=True)  # the sweep again, as it runs mid-run: not said twice
    backend.close()
    assert len(said) == 2, said
    assert any(f"{tmp_path / hsx_dump_format.dump_name(other, 0)} (not a regular file)" in s for s in said)
    assert any(f"pid {'9' * 20} is no process id" in s for s in said)
    assert all("left alone" in s for s in said)


@pytest.mark.parametrize(
    "answer, why",
    [
        ((200, b'{"disable_radix_cache": false}'), "runs with its radix cache"),
        ((200, b'{"disable_radix_cache": "true"}'), "runs with its radix cache"),
        ((200, b'{"version": "0.5.23"}'), "runs with its radix cache"),
        ((200, b"<html>"), "not a JSON object"),
        ((200, b"[true]"), "not a JSON object"),
        ((404, b'{"detail": "Not Found"}'), "HTTP 404"),
    ],
)
def test_a_server_with_its_radix_cache_or_no_answer_is_refused_at_start(server, tmp_path, answer, why):
    """The radix cache serves a repeated prefix without computing it, so the hook never sees its
    states: every sample would fail on its own ('starts at token N, not 0'). GET /server_info must
    say disable_radix_cache true, or the start fails naming the flag and the server."""
    _httpd, handler, url = server
    handler.server_info = answer
    with pytest.raises(SGLangError) as e:
        _backend(url, tmp_path)
    assert f"{url}/server_info" in str(e.value) and why in str(e.value), str(e.value)
    assert "--disable-radix-cache" in str(e.value)
