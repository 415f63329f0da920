"""TEST-ONLY stand-in for an SGLang server running our patched deepseek_v2.py. It is NOT SGLang.

It stands in for `python -m sglang.launch_server --model-path M ...` with the dump patch applied and
HSX_DUMP_DIR set, where no GPU (or no SGLang) is available: the lab hosts, CI, the sglang_server
role's tests. It answers the endpoints extraction uses, GET /health, GET /model_info, GET
/server_info (disable_radix_cache only: true, or false with --radix-cache / radix_cache=True) and
POST /generate (input_ids, rid, sampling_params.max_new_tokens), and produces the dump files by calling the
project's REAL hook module (extraction/sglang/hook.py, the file deployed into SGLang) with
ForwardBatch-like objects, exactly at the point the patched model would:

- a scheduler thread batches queued requests into forward passes of at most
  --chunked-prefill-size tokens, so long prompts are split across passes (chunked prefill) and
  several requests share a pass (ragged batches), with rids / extend_seq_lens_cpu /
  extend_prefix_lens_cpu filled in as SGLang does;
- each request's states come from the tiny model run in transformers (one unpadded forward per
  request, through extraction/backends/hf.py), captured layers in the hook's list form;
- the reply carries one greedy token id, as a max_new_tokens=1 generate would; as in SGLang it
  leaves when the request's last pass has run, not when the hook's writer thread has written its
  dump (the client waits for the dump's files).

With --sglang-package DIR (an installed SGLang package, patched by sglang_patch) it runs what that
install holds instead of importing the hook from the project: the patch blocks found between our
markers in DIR/srt/models/deepseek_v2.py are executed where the patched DeepseekV2Model runs them
(init block at start-up, forward block after each pass), and `sglang.hsx_dump_hook` is the module
deployed in DIR. So a patch that breaks the model breaks this server at start-up, an unpatched
install dumps nothing, and GET /hsx_patch tells which patch version the running server loaded.

With --api-key K (given directly or, as the sglang_server role does, in a --config YAML file, which
is merged as SGLang's ConfigArgumentMerger merges it) it enforces the key as SGLang's middleware does
(sglang/srt/utils/auth.py decide_request_auth, NORMAL level): every request but OPTIONS and paths
under /health, /ready and /metrics needs `Authorization: Bearer K` (scheme case-insensitive), else
401 {"error": "Unauthorized"}, before any routing. (GET /hsx_patch, TEST-ONLY and not SGLang's, is
open like /health.)

What it does not model: GPU numerics, CUDA graphs, tensor parallelism, the radix cache, decode.

With --null-model HIDDEN (the benchmarks: tests/bench/bench_sglang_path.py --client) there is no
model at all: a pass's states are views of one block of random bf16 rows, HIDDEN wide, the aux
states handed over packed (as 0.5.17+'s AuxHiddenStatePacker does), --num-layers layers for the
hook's default capture; --forward-us sleeps that long a token before the hook (the GPU's time).
GET /hsx_stats (TEST-ONLY) says how long the scheduler sat idle with no request to run, between the
first request's arrival and the last one's end.

    python tests/standin_sglang/server.py --model-path DIR --port 30000 [--chunked-prefill-size 64]
        [--sglang-package /opt/sglang/venv/lib/python3.11/site-packages/sglang]
        [--api-key K | --config FILE.yaml (holding api-key: K)]
        [--null-model 7168 --num-layers 61 --forward-us 0]
(unknown SGLang flags are accepted and ignored, so a unit file can keep its real command line).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import queue
import re
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import torch

_ROOT = Path(__file__).resolve().parents[2]  # a checkout (on a host: the installed wheel)
sys.path[:0] = [str(_ROOT), str(_ROOT / "module_utils")]

from extraction.backends.base import Sample  # noqa: E402
from extraction.sglang import hook  # noqa: E402
from hsx import sglang_patch  # noqa: E402

_BEGIN = re.compile(r"^([ \t]*)# >>> hsx-patch (\S+) block=(\S+) v=(\S+) ")
_END = re.compile(r"^[ \t]*# <<< hsx-patch (\S+) block=(\S+) <<<")


def load_patched_install(package: str) -> tuple[dict[str, object], dict[str, str]]:
    """The patch blocks of an installed SGLang (compiled, by block name) and what was found.

    Makes `sglang.hsx_dump_hook` the hook module deployed in the install (a bare `sglang` package
    object stands in for the real one, whose import needs a GPU stack)."""
    target = os.path.join(package, sglang_patch.TARGET)
    with open(target, encoding="utf-8") as f:
        text = f.read()
    ast.parse(text, target)  # a file that does not parse would not import in SGLang either
    blocks: dict[str, object] = {}
    versions: set[str] = set()
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = _BEGIN.match(lines[i])
        if m and m.group(2) == sglang_patch.PATCH_ID:
            indent, name = len(m.group(1)), m.group(3)
            versions.add(m.group(4))
            body = []
            i += 1
            while not (_END.match(lines[i]) and _END.match(lines[i]).group(2) == name):
                body.append(lines[i][indent:])
                i += 1
            blocks[name] = compile("\n".join(body) + "\n", f"{target}:{name}", "exec")
        i += 1
    pkg = type(sys)("sglang")
    pkg.__path__ = [package]
    sys.modules["sglang"] = pkg
    hook_path = os.path.join(package, sglang_patch.HOOK_FILENAME)
    if os.path.exists(hook_path):
        spec = importlib.util.spec_from_file_location(sglang_patch.HOOK_MODULE, hook_path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[sglang_patch.HOOK_MODULE] = module
        spec.loader.exec_module(module)
    info = {"id": sglang_patch.PATCH_ID, "version": ",".join(sorted(versions)) or "none", "file": target}
    return blocks, info


class ForwardMode:
    """The one ForwardMode member the hook looks at (by name)."""

    name = "EXTEND"


@dataclass
class _Request:
    rid: str
    input_ids: torch.Tensor
    done: threading.Event = field(default_factory=threading.Event)
    next_pos: int = 0
    states: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # final [L,H], per-layer [L,H]
    output_id: int | None = None
    error: str | None = None


class StandInServer:
    """The server object; tests run it in-process (start/stop), the script via serve_forever."""

    def __init__(
        self, model_path: str, host: str = "127.0.0.1", port: int = 0, chunk: int = 64, dtype: str = "bf16",
        sglang_package: str | None = None, min_request_seconds: float = 0.0, api_key: str | None = None,
        device: str = "cpu", null_hidden: int = 0, num_layers: int = 61, forward_us: float = 0.0,
        radix_cache: bool = False,
    ):
        from extraction.backends.hf import HFBackend

        self.api_key = api_key or None
        # GET /server_info's disable_radix_cache is `not radix_cache` (the role's command line
        # disables it; True stands in for a server started without that flag). Nothing else changes.
        self.radix_cache = bool(radix_cache)
        self.model_path = model_path

        # A real server computes on the GPU: its client mostly waits, the host's CPUs stay free. On
        # the lab's shared CPUs a floor on each request's time gives the same shape (and keeps a
        # 4-host lab's jobs from taking the CPUs the tests and Ansible need).
        self.min_request_seconds = max(0.0, float(min_request_seconds))

        self.chunk = max(1, int(chunk))
        self.null_hidden, self.forward_us = max(0, int(null_hidden)), max(0.0, float(forward_us))
        self._null_rows: torch.Tensor | None = None
        self.stats = {"idle_s": 0.0, "first_arrival": None, "last_done": None, "passes": 0, "hook_s": 0.0, "tokens": 0}
        if self.null_hidden:  # no model: HFBackend stays out (see _null_states)
            self.hf = SimpleNamespace(num_layers=int(num_layers), device=torch.device("cpu"))
        else:
            self.hf = HFBackend(model_path, layer_ids=[], dtype="bf16" if dtype == "auto" else dtype, device=device)
        # The two attributes of DeepseekV2Model the hook touches; attach() reads HSX_DUMP_* from
        # the environment, as in the real server.
        self.model = SimpleNamespace(
            config=SimpleNamespace(num_hidden_layers=self.hf.num_layers), layers_to_capture=[]
        )
        self.patch_blocks: dict[str, object] = {}
        self.patch_info: dict[str, str] = {"id": sglang_patch.PATCH_ID, "version": "project hook (no install)"}
        if sglang_package:
            self.patch_blocks, self.patch_info = load_patched_install(sglang_package)
            if "init" in self.patch_blocks:  # DeepseekV2Model.__init__ runs it; an error fails the load
                exec(self.patch_blocks["init"], {"__builtins__": __builtins__}, {"self": self.model})
        else:
            self.model._hsx_dump = hook.attach(self.model)
            if self.model._hsx_dump is not None:
                self.model._hsx_dump.version = "standin"
        if self.null_hidden:  # the random rows now, not in the first pass (seconds at K2.5 width)
            self._null_states(self.chunk)
        self.queue: queue.Queue[_Request | None] = queue.Queue()
        self.ready = threading.Event()
        self.httpd = ThreadingHTTPServer((host, port), self._handler())
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._threads: list[threading.Thread] = []

    # ---------------------------------------------------------------- model side

    def _states(self, req: _Request) -> None:
        """One unpadded forward of the whole prompt; the passes below cut pieces out of it."""
        if self.null_hidden:
            req.output_id = int(req.input_ids[-1])
            return
        layers = list(self.model.layers_to_capture)
        self.hf.set_layers(layers or [0])
        sample = Sample("x", req.input_ids, torch.ones_like(req.input_ids))
        if self.hf.device.type == "cuda":  # the states stay on the GPU, as in the server: the hook copies
            final, aux, _lengths = self.hf.forward_states([sample])
            hidden, packed = final[0], aux[0]
        else:
            (out,) = self.hf.extract([sample])
            hidden, packed = out.hidden_state, out.aux_hidden_state
        per_layer = list(packed.split(hidden.shape[-1], dim=-1)) if layers else []
        req.states = (hidden, per_layer)
        req.output_id = int(req.input_ids[-1])  # a token id stands in for the greedy sample

    def _null_states(self, tokens: int) -> tuple[torch.Tensor, SimpleNamespace]:
        """--null-model: a pass's final state [tokens, H] and its packed aux states [tokens, k*H], views
        of one block of random rows (grown when a pass needs more), as the packer hands them over."""
        k, h = len(self.model.layers_to_capture), self.null_hidden
        rows = self._null_rows
        if rows is None or rows.shape[0] < tokens or rows.shape[1] != (k + 1) * h:
            gen = torch.Generator().manual_seed(0)
            rows = torch.randn(max(tokens, self.chunk), (k + 1) * h, generator=gen).to(torch.bfloat16)
            self._null_rows = rows
        packed = rows[:tokens, h:]
        return rows[:tokens, :h], SimpleNamespace(finalize=lambda: packed)

    def _forward(self, pieces: list[tuple[_Request, int, int]]) -> None:
        """One prefill pass, as DeepseekV2Model.forward ends it: final state + aux list -> hook."""
        self.stats["passes"] += 1
        if self.null_hidden:
            tokens = sum(e - s for _, s, e in pieces)
            if self.forward_us:
                time.sleep(self.forward_us * 1e-6 * tokens)
            final, aux = self._null_states(tokens)
            return self._to_hook(pieces, final, aux)
        final = torch.cat([r.states[0][s:e] for r, s, e in pieces])
        aux = [
            torch.cat([r.states[1][k][s:e] for r, s, e in pieces]) for k in range(len(pieces[0][0].states[1]))
        ]
        self._to_hook(pieces, final, aux)

    def _to_hook(self, pieces: list[tuple[_Request, int, int]], final: torch.Tensor, aux: object) -> None:
        """The patched line at the end of DeepseekV2Model.forward: the pass's batch and states to the hook."""
        batch = SimpleNamespace(
            forward_mode=ForwardMode(),
            rids=[r.rid for r, _, _ in pieces],
            extend_seq_lens_cpu=[e - s for _, s, e in pieces],
            extend_prefix_lens_cpu=[s for _, s, _ in pieces],
            input_ids=torch.cat([r.input_ids[s:e] for r, s, e in pieces]),
        )
        t0 = time.perf_counter()
        if "forward" in self.patch_blocks:
            scope = {"self": self.model, "forward_batch": batch, "hidden_states": final, "aux_hidden_states": aux}
            exec(self.patch_blocks["forward"], {"__builtins__": __builtins__}, scope)
        elif not self.patch_blocks and getattr(self.model, "_hsx_dump", None) is not None:
            self.model._hsx_dump.after_forward(batch, final, aux)
        self.stats["hook_s"] += time.perf_counter() - t0  # the forward's critical path
        self.stats["tokens"] += int(batch.input_ids.shape[0])

    def _scheduler(self) -> None:
        active: list[_Request] = []
        while True:
            block = not active
            try:
                while True:
                    t0 = time.monotonic()
                    item = self.queue.get(block=block, timeout=None)
                    first = self.stats["first_arrival"]
                    if block and first is not None:  # idle: nothing to run (since the first request)
                        self.stats["idle_s"] += time.monotonic() - max(t0, first)
                    if item is None:
                        return
                    try:
                        self._states(item)
                        active.append(item)
                    except Exception as exc:  # a bad request fails alone
                        item.error = f"{type(exc).__name__}: {exc}"
                        item.done.set()
                    block = False
            except queue.Empty:
                pass
            if not active:
                continue
            budget, pieces = self.chunk, []
            for req in active:
                if budget == 0:
                    break
                n = min(budget, len(req.input_ids) - req.next_pos)
                pieces.append((req, req.next_pos, req.next_pos + n))
                budget -= n
            self._forward(pieces)
            for req, _s, e in pieces:
                req.next_pos = e
                if e == len(req.input_ids):
                    self.stats["last_done"] = time.monotonic()
                    req.done.set()
            active = [r for r in active if not r.done.is_set()]

    # ---------------------------------------------------------------- HTTP side

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _reply(self, code: int, body: dict | str) -> None:
                data = (json.dumps(body) if isinstance(body, dict) else body).encode()
                self.send_response(code)
                self.send_header(
                    "Content-Type", "application/json" if isinstance(body, dict) else "text/plain"
                )
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                """SGLang's decide_request_auth for a NORMAL endpoint; a 401 is sent when not."""
                if not server.api_key or self.command == "OPTIONS":
                    return True
                if self.path.startswith(("/health", "/ready", "/metrics", "/hsx_patch", "/hsx_stats")):
                    return True
                scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
                if scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), server.api_key.encode()):
                    return True
                self._reply(401, {"error": "Unauthorized"})
                return False

            def do_GET(self):
                if not self._authorized():
                    return None
                if self.path == "/model_info":
                    return self._reply(200, {"model_path": server.model_path, "is_generation": True})
                if self.path == "/server_info":  # SGLang's: its server arguments (and more) at the top
                    return self._reply(200, {"disable_radix_cache": not server.radix_cache})
                if self.path == "/hsx_patch":  # TEST-ONLY: the patch version this server loaded
                    return self._reply(200, server.patch_info)
                if self.path == "/hsx_stats":  # TEST-ONLY: the scheduler's idle time (benchmarks)
                    return self._reply(200, dict(server.stats))
                if self.path == "/health":
                    return self._reply(
                        200 if server.ready.is_set() else 503, "OK" if server.ready.is_set() else ""
                    )
                self._reply(404, {"error": f"no route {self.path}"})

            def do_POST(self):
                if not self._authorized():
                    return None
                if self.path != "/generate":
                    return self._reply(404, {"error": f"no route {self.path}"})
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                    ids = torch.tensor(body["input_ids"], dtype=torch.long)
                    if ids.dim() != 1 or ids.numel() == 0:
                        raise ValueError("input_ids must be a non-empty list of ints")
                    rid = str(body.get("rid") or os.urandom(8).hex())
                except Exception as exc:
                    return self._reply(400, {"error": f"bad request: {exc}"})
                req = _Request(rid, ids)
                started = time.monotonic()
                if server.stats["first_arrival"] is None:
                    server.stats["first_arrival"] = started
                server.queue.put(req)
                req.done.wait()
                time.sleep(max(0.0, server.min_request_seconds - (time.monotonic() - started)))
                if req.error:
                    return self._reply(500, {"error": req.error})
                meta = {
                    "id": rid,
                    "prompt_tokens": int(ids.numel()),
                    "completion_tokens": 1,
                    "finish_reason": {"type": "length", "length": 1},
                }
                self._reply(200, {"text": "", "output_ids": [req.output_id], "meta_info": meta})

        return Handler

    def start(self) -> StandInServer:
        for target in (self._scheduler, self.httpd.serve_forever):
            t = threading.Thread(target=target, daemon=True)
            t.start()
            self._threads.append(t)
        self.ready.set()
        return self

    def stop(self) -> None:
        self.ready.clear()
        self.queue.put(None)
        self.httpd.shutdown()
        self.httpd.server_close()
        for t in self._threads:
            t.join(timeout=10)
        dump = getattr(self.model, "_hsx_dump", None)
        if hasattr(dump, "flush"):  # the hook writes from its own thread: let it finish
            dump.flush(30)

    @property
    def url(self) -> str:
        host = self.httpd.server_address[0]
        return f"http://{host}:{self.port}"


def merge_config_file(argv: list[str]) -> list[str]:
    """`--config FILE` as SGLang's ConfigArgumentMerger takes it: the YAML's keys become arguments
    in front of the others (the command line wins), `--config FILE` is dropped."""
    if "--config" not in argv:
        return argv
    import yaml

    i = argv.index("--config")
    with open(argv[i + 1], encoding="utf-8") as f:
        config = yaml.safe_load(f) or {}
    args: list[str] = []
    for key, value in config.items():
        if isinstance(value, bool):
            args += [f"--{key}"] if value else []
        elif isinstance(value, list):
            args += [f"--{key}", *map(str, value)] if value else []
        else:
            args += [f"--{key}", json.dumps(value) if isinstance(value, dict) else str(value)]
    return args + argv[:i] + argv[i + 2 :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--chunked-prefill-size", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--sglang-package", help="run the patch and hook of this installed SGLang package")
    parser.add_argument("--min-request-seconds", type=float, default=0.0,
                        help="answer no /generate sooner than this (stands in for the GPU's time; frees the CPUs)")
    parser.add_argument("--api-key", help="demand this key as SGLang does (Authorization: Bearer)")
    parser.add_argument("--radix-cache", action="store_true",
                        help="GET /server_info says disable_radix_cache false (a server without --disable-radix-cache)")
    parser.add_argument("--null-model", type=int, default=0, metavar="HIDDEN",
                        help="no model: random states this wide (benchmarks); --num-layers, --forward-us apply")
    parser.add_argument("--num-layers", type=int, default=61, help="--null-model: the model's layers")
    parser.add_argument("--forward-us", type=float, default=0.0, help="--null-model: a pass's time, us a token")
    parser.add_argument("--device", default="cpu", help="where the model runs (cuda: the states reach the hook on the GPU)")
    args, _ignored = parser.parse_known_args(merge_config_file(sys.argv[1:] if argv is None else argv))
    server = StandInServer(
        args.model_path, args.host, args.port, args.chunked_prefill_size, args.dtype, args.sglang_package,
        args.min_request_seconds, args.api_key, args.device, args.null_model, args.num_layers, args.forward_us,
        args.radix_cache,
    ).start()
    print(
        f"stand-in SGLang server on {server.url} (dumps: {os.environ.get(hook.ENV_DIR) or 'off'}; "
        f"patch {server.patch_info['id']} v{server.patch_info['version']}; "
        f"API key {'demanded' if server.api_key else 'off'})", flush=True
    )
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
