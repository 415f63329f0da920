"""SGLang backend: prefill each sample on a patched SGLang server and read the hook's dump.

The bulk states never travel over HTTP (`return_hidden_states` sends JSON float lists, ~17x
slower): each sample is one POST /generate with its input_ids, a unique rid and max_new_tokens 1;
the server's dump hook writes the request's states to files in the dump directory (same node),
which we join (chunked prefill), check (the dumped input_ids must be the ones we sent, the layer
ids the ones the run records) and delete. The runner streams samples to `extract_one`, keeping
`window` (= --concurrency) requests in flight at all times, so the server always has requests to
batch (extraction/runner/stream.py); `extract(samples)` runs a list at once (tests, tools).

A dump is never mapped (a dump that shrinks or a disk read error fails that sample, not the
client) and its file is unlinked once read. The states are not read here at all: they are
FileBytes over the dump's open descriptors, copied into the shard as it is written; NaN/Inf as
extraction/sglang/dump_states.py decides from the hook's `finite` (true: copied unchecked, the hook
computed it on the bytes it wrote; no field: every value checked in the copy); only where the header
says it found a NaN/Inf (`finite` false) or the dump is format 1 are they read into memory of ours
(pread; the publisher refuses the NaN) and a
request chunked prefill cut into pieces is joined with one copy more (torch.cat).

The reply to POST /generate has a deadline for the whole of it (`reply_deadline`, default
REPLY_DEADLINE_S) and a size cap (`reply_max_bytes`, default REPLY_MAX_BYTES): the socket timeout
alone bounds each read, so a server dripping a byte a second never ended, and any body was
buffered whole (extraction/sglang/reply.py). Breaking either fails the sample (SGLangError naming
the server and the limit).

The dump directory must be writable by nobody but its owner and a trusted group
(hsx_dump_format.dump_dir_problem, the rule the server's hook applies too): refused at start otherwise.

The reply does not wait for the dump (docs/sglang_hook.md says why): when it leaves, the hook's
writer thread has taken every piece of the request, not necessarily written them. So the client
then waits for the pieces to be renamed into place, `dumps.wait_request`: woken by inotify (one
instance per waiting request, closed when its wait ends; a coarse poll where inotify is not to be
had), for up to `dump_timeout` seconds (default 120: the hook may hold HSX_DUMP_BUDGET_MB, 4096
MiB by default, ahead of a request's dump, ~14 s on a ~300 MiB/s disk, plus the queueing).

The server demands an API key (roles/sglang_server gives it --api-key; SGLang then answers 401 on
every endpoint but /health without it): the client sends `Authorization: Bearer <key>` (the key from
the config's api_key_file) on every request, and checks it at start on GET /model_info, which needs
it: a missing or wrong key fails the start with what to fix instead of failing every sample. A 401 or
403 later (the key was replaced and the server restarted) re-reads the file once; a key that is
still refused fails the sample at once (SGLangAuthError), with no retry of its own. Then GET
/server_info must say disable_radix_cache true (check_radix_cache): a server with its radix cache
serves a repeated prefix without computing it, so every sample would fail on its own.

When an attempt fails:
- a `.failed` marker (the hook could not write a piece): asked again at once with a new rid, up to
  `write_retries` times;
- a connection failure (the server restarting): wait for /health, ask again with a new rid, up to
  `connect_retries` times;
- an HTTP error, a 200 that is not JSON, a reply past its deadline or cap, a dump the reader
  refuses (at once: a piece is renamed into place whole, so it will not change), no complete dump
  within `dump_timeout`: the sample fails (SGLangError; the runner's --retries apply).
An attempt given up leaves no dump: its files are removed at once, and again (for pieces the hook
had not written yet) once a request sent after it has its dump in, as the hook's one writer writes
in order, and at close(). With several writers (DP attention: one per attention-TP group) a late
piece can land after that sweep; close() still removes what has landed by then.

After a crash (kill -9 of this client, or of the server mid-write) the next client removes what
no live request will read: the killed client's dumps (its rids carry another client token, and its
late pieces land after it died) and the dead server's temp files (dumps.stale_names). It does so at
start, every STALE_SWEEP_SECONDS while it runs, and at close, and only while it holds the dump
directory's client lock (one client per dump directory; a second one leaves others' files alone).
An entry it cannot or will not remove (a directory named like a dump, a temp whose pid is no
process id) is skipped and said once, through `log`: it never stops the client.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from extraction.backends.base import ModelInfo, Sample, SampleStates
from extraction.inputs.config import DEFAULT_DUMP_TIMEOUT, ConfigError, read_api_key
from extraction.sglang import dumps, hook, hsx_dump_format, reply

ENV_DUMP_DIR = hook.ENV_DIR  # the client reads the same variable the server's hook does
STALE_SWEEP_SECONDS = 1.0  # how often, at most, the dump directory is swept of what a crash left
# POST /generate's whole reply: a prefill of max_new_tokens 1 answers in seconds to minutes under
# load (as the per-read request_timeout, 600 s, allowed before) with a body of a few hundred bytes.
REPLY_DEADLINE_S = 600.0
REPLY_MAX_BYTES = 16 << 20


def _say(msg: str) -> None:
    print(f"hsx extract: {msg}", file=sys.stderr, flush=True)


class SGLangError(RuntimeError):
    """The server or its dump did not give usable states; the message says which sample and why."""


class SGLangAuthError(SGLangError):
    """The server refused the API key (HTTP 401/403): a missing or wrong key, not a passing fault."""


class _NoAnswer(Exception):
    """/generate got no answer (connection refused or reset, timed out): the server may be restarting."""


def _rid_part(sample_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", sample_id)[:64]


class SGLangBackend:
    name = "sglang"

    def __init__(
        self,
        server_url: str,
        dump_dir: str,
        model_dir: str,
        layer_ids: list[int],
        dtype: str = "bf16",
        concurrency: int = 8,
        request_timeout: float = 600.0,
        health_timeout: float = 600.0,
        dump_timeout: float = DEFAULT_DUMP_TIMEOUT,
        connect_retries: int = 3,
        write_retries: int = 2,
        keep_dumps: bool = False,
        api_key: str | None = None,
        api_key_file: str | None = None,
        reply_deadline: float = REPLY_DEADLINE_S,
        reply_max_bytes: int = REPLY_MAX_BYTES,
        log: Callable[[str], None] | None = None,
    ):
        self.url = server_url.rstrip("/")
        self.reply_deadline = reply_deadline
        self.reply_max_bytes = reply_max_bytes
        self.log = log or _say
        self._said: set[str] = set()  # strays in the dump directory already said
        # The key: given, or read from api_key_file (re-read when the server refuses it).
        self.api_key_file = api_key_file
        self.api_key = api_key if api_key is not None else self._read_key() if api_key_file else None
        self.dump_dir = dump_dir
        self.model_dir = model_dir
        self.layer_ids = list(layer_ids)
        self.dtype = dtype
        self.concurrency = max(1, int(concurrency))
        self.request_timeout = request_timeout
        self.health_timeout = health_timeout
        self.dump_timeout = dump_timeout
        self.connect_retries = connect_retries
        self.write_retries = write_retries
        self.keep_dumps = keep_dumps  # leave every dump file in place (debugging)
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="hsx-sglang")
        self._health_lock = threading.Lock()
        self._lock = threading.Lock()
        self._sent = 0  # requests sent so far
        # rid of an attempt given up -> requests sent by then (None once swept; close() sweeps all)
        self._given_up: dict[str, int | None] = {}
        self.window = self.concurrency  # requests the runner keeps in flight (stream.py)
        # Every rid of this client starts with this; what a killed client left has another token.
        self.rid_prefix = f"{dumps.RID_PREFIX}{uuid.uuid4().hex[:8]}-"
        self._stale_at = 0.0
        if not os.path.isdir(dump_dir):
            raise SGLangError(f"dump directory {dump_dir} does not exist (the server's {hook.ENV_DIR})")
        problem = hsx_dump_format.dump_dir_problem(dump_dir)
        if problem is not None:
            raise SGLangError(problem)
        self._client_lock = None if keep_dumps else dumps.client_lock(dump_dir)
        try:
            self.wait_healthy()
            self.check_key()
            self.check_radix_cache()
        except BaseException:
            self.close()
            raise
        self._sweep_stale(force=True)

    @classmethod
    def from_config(cls, cfg: Any, layer_ids: list[int]) -> SGLangBackend:
        """From `hsx extract` options; the dump dir is cfg.dump_dir or $HSX_DUMP_DIR."""
        dump_dir = getattr(cfg, "dump_dir", None) or os.environ.get(ENV_DUMP_DIR)
        if not dump_dir:
            raise SGLangError(f"the sglang backend needs the server's dump directory (set {ENV_DUMP_DIR})")
        return cls(
            cfg.server_url,
            dump_dir,
            cfg.model,
            layer_ids,
            dtype=cfg.dtype,
            concurrency=cfg.concurrency,
            dump_timeout=cfg.dump_timeout,
            api_key_file=getattr(cfg, "api_key_file", None),
        )

    # ---------------------------------------------------------------- server

    def _read_key(self) -> str:
        try:
            return read_api_key(self.api_key_file)
        except ConfigError as exc:
            raise SGLangAuthError(str(exc)) from None

    def _headers(self, key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _key_refused(self, what: str, status: int) -> SGLangAuthError:
        if not self.api_key:
            why = "and none was given: set api_key_file (hsx extract --api-key-file) to the server's key file"
        else:
            why = (
                f"and refused the key from {self.api_key_file or 'the one given'}: it is not the server's "
                "(roles/sglang_server writes it to sglang_server_api_key_file)"
            )
        return SGLangAuthError(
            f"{what}: {self.url} answered HTTP {status}: the server demands an API key {why}"
        )

    def _get(self, path: str, timeout: float) -> int:
        req = urllib.request.Request(self.url + path, headers=self._headers(self.api_key))
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    def check_key(self) -> None:
        """GET /model_info, which SGLang serves only with the key when it has one: SGLangAuthError
        (what to fix) for 401/403; anything else is left to the requests to report."""
        try:
            status = self._get("/model_info", timeout=30)
        except (OSError, http.client.HTTPException):
            return
        if status in (401, 403):
            raise self._key_refused("checking the API key on GET /model_info", status)

    def check_radix_cache(self) -> None:
        """GET /server_info (every supported release serves it, behind the key: its server
        arguments at the top level) must say `disable_radix_cache` true, else SGLangError naming
        the flag and the server. With the radix cache a repeated prefix is served from the cache,
        never computed, so the hook never sees its states: every sample would fail on its own
        ("starts at token N, not 0"), each of its retries too. Asked once at start, after the
        health wait (no second one); an answer that is not a JSON object saying true fails too."""
        where = f"{self.url}/server_info"
        fix = "start SGLang with --disable-radix-cache (roles/sglang_server's command line has it)"
        req = urllib.request.Request(where, headers=self._headers(self.api_key))
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                body = resp.read(self.reply_max_bytes + 1)
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise self._key_refused("checking the radix cache on GET /server_info", exc.code) from None
            raise SGLangError(
                f"{where} answered HTTP {exc.code}: cannot tell whether the server runs with "
                f"--disable-radix-cache, which the dump needs; {fix}"
            ) from None
        except (OSError, http.client.HTTPException) as exc:
            raise SGLangError(
                f"{where}: no answer ({getattr(exc, 'reason', exc)}): cannot tell whether the server "
                f"runs with --disable-radix-cache, which the dump needs"
            ) from None
        try:
            info = json.loads(body) if len(body) <= self.reply_max_bytes else None
        except ValueError:
            info = None
        if not isinstance(info, dict):
            raise SGLangError(
                f"{where} answered {len(body)} bytes, not a JSON object of server arguments: cannot tell "
                f"whether the server runs with --disable-radix-cache, which the dump needs"
            )
        if info.get("disable_radix_cache") is not True:
            raise SGLangError(
                f"{where} says disable_radix_cache {info.get('disable_radix_cache', 'missing')!r}: the server "
                "runs with its radix cache, which serves a repeated prefix without computing it, so its "
                f"states are never dumped and every sample would fail; {fix}"
            )

    def wait_healthy(self) -> None:
        """Block until GET /health answers 200; SGLangError after health_timeout seconds."""
        with self._health_lock:  # one waiter polls; the others then find it healthy at once
            deadline = time.monotonic() + self.health_timeout
            last = "no answer"
            while True:
                try:
                    status = self._get("/health", timeout=10)
                    if status == 200:
                        return
                    last = f"HTTP {status}"
                except (OSError, http.client.HTTPException) as exc:
                    last = str(getattr(exc, "reason", exc))
                if time.monotonic() >= deadline:
                    raise SGLangError(
                        f"{self.url}/health not ready after {self.health_timeout:.0f}s ({last})"
                    )
                time.sleep(min(1.0, max(0.05, self.health_timeout / 50)))

    def _generate(self, input_ids: list[int], rid: str, sample_id: str) -> dict:
        """POST /generate; SGLangError for an HTTP error or a reply that is not JSON (SGLangAuthError
        for a refused API key), _NoAnswer for a connection failure."""
        body = json.dumps(
            {
                "input_ids": input_ids,
                "rid": rid,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            }
        ).encode()
        for fresh_key in (False, True):  # a refused key: read the file again, once
            used = self.api_key
            try:
                answer = reply.post(
                    self.url + "/generate",
                    body,
                    {"Content-Type": "application/json", **self._headers(used)},
                    read_timeout=self.request_timeout,
                    deadline=self.reply_deadline,
                    max_bytes=self.reply_max_bytes,
                )
            except reply.ReplyLimit as exc:
                if exc.limit == "deadline":
                    why = "the server is stuck or overloaded; check its log (limit: reply_deadline)"
                else:
                    why = f"no SGLang reply to one token is that long; check what answers at {self.url} (limit: reply_max_bytes)"
                raise SGLangError(f"{sample_id}: {exc}: {why}") from None
            except (OSError, http.client.HTTPException) as exc:
                raise _NoAnswer(f"{type(exc).__name__}: {exc}") from None
            status, data = answer.status, answer.body
            if 200 <= status < 300:
                break
            detail = data[:300].decode(errors="replace")
            if status not in (401, 403):
                raise SGLangError(f"{sample_id}: /generate answered HTTP {status}: {detail}")
            if fresh_key or not self._reload_key(used):
                raise self._key_refused(f"{sample_id}: POST /generate", status)
        try:
            return json.loads(data or b"{}")
        except ValueError:
            raise SGLangError(
                f"{sample_id}: /generate answered {status} with a body that is not JSON: {data[:100]!r}"
            ) from None

    def _reload_key(self, used: str | None) -> bool:
        """Read api_key_file again (the key was replaced and the server restarted): True if it holds
        another key than `used`, the one refused (another request may have read it already)."""
        if not self.api_key_file:
            return False
        with self._lock:
            self.api_key = self._read_key()
            return self.api_key != used

    # ---------------------------------------------------------------- one sample

    def extract_one(self, sample: Sample) -> SampleStates:
        """One sample: its request (asked again on a lost reply or a `.failed` piece, each with a
        new rid) and its checked dump; SGLangError when it cannot be had."""
        ids = sample.input_ids.tolist()
        lost = failed = 0
        while True:
            rid = f"{self.rid_prefix}{_rid_part(sample.sample_id)}-{uuid.uuid4().hex[:12]}"
            try:
                dump = self._attempt(ids, rid, sample.sample_id)
                break
            except _NoAnswer as exc:
                lost += 1
                if lost > self.connect_retries:
                    raise SGLangError(f"{sample.sample_id}: /generate failed {lost} times: {exc}") from None
                self.wait_healthy()
            except dumps.DumpWriteFailed as exc:
                failed += 1
                if failed > self.write_retries:
                    raise SGLangError(
                        f"{sample.sample_id}: the server could not write its dump, {failed} times: {exc}"
                    ) from None
        if not torch.equal(dump.input_ids, sample.input_ids.to(torch.long)):
            raise SGLangError(f"{sample.sample_id}: the server dumped other input_ids than were sent")
        if dump.layer_ids != self.layer_ids:
            raise SGLangError(
                f"{sample.sample_id}: the server captured layers {dump.layer_ids} "
                f"(owner {dump.capture_owner}), the run needs {self.layer_ids}; "
                f"set {hook.ENV_LAYERS}={','.join(map(str, self.layer_ids))} on the server"
            )
        return SampleStates(
            sample_id=sample.sample_id,
            input_ids=sample.input_ids,
            hidden_state=dump.hidden_state,
            aux_hidden_state=dump.aux_hidden_state,
            finite=dump.finite,  # as the hook said (extraction/sglang/dump_states.py)
        )

    def _attempt(self, ids: list[int], rid: str, sample_id: str) -> dumps.RequestDump:
        """One request and, after its reply, its dump (read, then removed). An attempt that fails
        in any way is given up: what it left is removed, now and later."""
        with self._lock:
            self._sent += 1
            sent = self._sent
        try:
            self._generate(ids, rid, sample_id)
            dump = dumps.wait_request(self.dump_dir, rid, len(ids), self.dump_timeout, states_in_files=True)
        except BaseException as exc:
            self._give_up(rid)
            if isinstance(exc, dumps.DumpIncomplete):
                raise SGLangError(
                    f"{sample_id}: no complete dump after {self.dump_timeout:.0f}s: {exc} "
                    "(is the server patched, its hook active, and the dump dir the same?)"
                ) from None
            if isinstance(exc, dumps.DumpError) and not isinstance(exc, dumps.DumpWriteFailed):
                raise SGLangError(
                    f"{sample_id}: its dump was refused: {exc} (failed at once: a dump in place does not change)"
                ) from None
            raise
        if not self.keep_dumps:
            dumps.remove_request(self.dump_dir, rid)
        self._sweep(sent)
        self._sweep_stale()
        return dump

    def _give_up(self, rid: str) -> None:
        """Remove what a failed attempt left now; remember it for the pieces still to come."""
        if self.keep_dumps:
            return
        dumps.remove_request(self.dump_dir, rid)
        with self._lock:
            self._given_up[rid] = self._sent

    def _sweep(self, sent: int | None = None) -> None:
        """Remove what the attempts given up left. The request sent `sent`-th has its dump in: the
        hook's writer writes passes in order, so every piece of an attempt given up before that
        request was sent has been written (or has failed) by now. None (close): all of them."""
        with self._lock:
            if sent is None:
                due = list(self._given_up)
            else:
                due = [rid for rid, mark in self._given_up.items() if mark is not None and mark < sent]
            for rid in due:
                self._given_up[rid] = None
        for rid in due:
            dumps.remove_request(self.dump_dir, rid)

    def _sweep_stale(self, force: bool = False) -> None:
        """Remove what a crash left in the dump directory (dumps.stale_names: a killed client's
        dumps, a killed server's temps): at start, at most every STALE_SWEEP_SECONDS after a dump
        was read, and at close. Only the client holding the directory's lock does."""
        if self._client_lock is None:
            return
        now = time.monotonic()
        with self._lock:
            if not force and now - self._stale_at < STALE_SWEEP_SECONDS:
                return
            self._stale_at = now
        strays: list[str] = []
        try:
            names = dumps.stale_names(self.dump_dir, self.rid_prefix, strays)
        except OSError as exc:  # the directory unreadable: say so once, never fail a sample for it
            names, strays = [], [f". (not listed: {exc.strerror})"]
        for name in names:
            try:
                os.unlink(os.path.join(self.dump_dir, name))
            except FileNotFoundError:
                pass
            except OSError as exc:
                strays.append(f"{name} ({exc.strerror})")
        for stray in strays:
            if stray not in self._said:
                self._said.add(stray)
                self.log(
                    f"{os.path.join(self.dump_dir, stray)}: left alone in the dump directory (named like "
                    "a file of ours, but not one to remove); remove it by hand if nothing uses it"
                )

    # ---------------------------------------------------------------- Backend

    def model_info(self) -> ModelInfo:
        from extraction.backends.hf import dtype_name, model_revision, torch_dtype

        with open(os.path.join(self.model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        text = config.get("text_config") or config
        return ModelInfo(
            model=os.path.basename(os.path.abspath(self.model_dir)),
            revision=model_revision(self.model_dir),
            hidden_size=int(text["hidden_size"]),
            num_layers=int(text["num_hidden_layers"]),
            vocab_size=int(text["vocab_size"]),
            dtype=dtype_name(torch_dtype(self.dtype)),
        )

    def extract(self, samples: list[Sample]) -> list[SampleStates]:
        """All samples concurrently; the first failure is raised after every request finished."""
        futures = [self._pool.submit(self.extract_one, s) for s in samples]
        results, first_error = [], None
        for f in futures:
            try:
                results.append(f.result())
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the others finished
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return results

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._sweep()
        self._sweep_stale(force=True)
        if self._client_lock is not None:
            os.close(self._client_lock)
            self._client_lock = None
