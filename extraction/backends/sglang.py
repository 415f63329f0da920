"""SGLang backend: prefill each sample on a patched SGLang server and read the hook's dump.

The bulk states never travel over HTTP (`return_hidden_states` sends JSON float lists, ~17x
slower): each sample is one POST /generate with its input_ids, a unique rid and max_new_tokens 1;
the server's dump hook writes the request's states to files in the dump directory (same node),
which we join (chunked prefill), check (the dumped input_ids must be the ones we sent, the layer
ids the ones the run records) and delete. Requests run `concurrency` at a time so the server can
batch them. Connection failures wait for /health (the server may be restarting) and retry.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from extraction.backends.base import ModelInfo, Sample, SampleStates
from extraction.sglang import dumps, hook

ENV_DUMP_DIR = hook.ENV_DIR  # the client reads the same variable the server's hook does


class SGLangError(RuntimeError):
    """The server or its dump did not give usable states; the message says which sample and why."""


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
        dump_timeout: float = 30.0,
        connect_retries: int = 3,
        keep_dumps: bool = False,
    ):
        self.url = server_url.rstrip("/")
        self.dump_dir = dump_dir
        self.model_dir = model_dir
        self.layer_ids = list(layer_ids)
        self.dtype = dtype
        self.concurrency = max(1, int(concurrency))
        self.request_timeout = request_timeout
        self.health_timeout = health_timeout
        self.dump_timeout = dump_timeout
        self.connect_retries = connect_retries
        self.keep_dumps = keep_dumps
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="hsx-sglang")
        self._health_lock = threading.Lock()
        if not os.path.isdir(dump_dir):
            raise SGLangError(f"dump directory {dump_dir} does not exist (the server's {hook.ENV_DIR})")
        self.wait_healthy()

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
        )

    # ---------------------------------------------------------------- server

    def _get(self, path: str, timeout: float) -> int:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

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

    def _generate(self, input_ids: list[int], rid: str) -> dict:
        body = json.dumps(
            {
                "input_ids": input_ids,
                "rid": rid,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            }
        ).encode()
        req = urllib.request.Request(
            self.url + "/generate", data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(req, timeout=self.request_timeout) as resp:
            return json.loads(resp.read() or b"{}")

    # ---------------------------------------------------------------- one sample

    def _one(self, sample: Sample) -> SampleStates:
        ids = sample.input_ids.tolist()
        for attempt in range(self.connect_retries + 1):
            rid = f"hsx-{_rid_part(sample.sample_id)}-{uuid.uuid4().hex[:12]}"
            try:
                self._generate(ids, rid)
                break
            except urllib.error.HTTPError as exc:
                detail = exc.read()[:300].decode(errors="replace")
                dumps.remove_request(self.dump_dir, rid)
                raise SGLangError(
                    f"{sample.sample_id}: /generate answered HTTP {exc.code}: {detail}"
                ) from None
            except (OSError, http.client.HTTPException) as exc:
                dumps.remove_request(self.dump_dir, rid)
                if attempt == self.connect_retries:
                    raise SGLangError(
                        f"{sample.sample_id}: /generate failed {attempt + 1} times: {exc}"
                    ) from None
                self.wait_healthy()
        try:
            dump = self._read_dump(rid, len(ids), sample.sample_id)
        finally:
            if not self.keep_dumps:
                dumps.remove_request(self.dump_dir, rid)
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
        )

    def _read_dump(self, rid: str, length: int, sample_id: str) -> dumps.RequestDump:
        """The hook writes before the response leaves the server; allow a moment for slow disks."""
        deadline = time.monotonic() + self.dump_timeout
        while True:
            try:
                return dumps.read_request(self.dump_dir, rid, expected_len=length)
            except dumps.DumpError as exc:
                if time.monotonic() >= deadline:
                    raise SGLangError(
                        f"{sample_id}: no complete dump after {self.dump_timeout:.0f}s: {exc} "
                        "(is the server patched, its hook active, and the dump dir the same?)"
                    ) from None
                time.sleep(0.02)

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
        futures = [self._pool.submit(self._one, s) for s in samples]
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
