"""Hidden-state dump hook that runs INSIDE the SGLang server (deployed as `sglang/hsx_dump_hook.py`).

Why it is built this way, what it assumes about SGLang (file and function names) and the evidence:
docs/sglang_hook.md in the hsx repository. The contracts:

- `attach(model)`, at the end of the patched model's __init__ (DeepseekV2Model, LlamaModel,
  Qwen2Model): None (inactive) unless HSX_DUMP_DIR is set, and when the model's forward is not the
  patched one (`model._hsx_dump_class`, set by the patch line before it where the patch has it);
  otherwise it claims capture by setting `model.layers_to_capture` to a list of its own.
- `hook.after_forward(forward_batch, hidden_states, aux_hidden_states)`, just before the forward
  returns (`hidden_states` after `self.norm`): returns the aux states the model must return (`[]`
  when the hook owns capture, SGLang's own when EAGLE-3/DFlash set the list) and hands each prefill
  pass (EXTEND/MIXED, attention-TP rank 0) to one writer thread. It waits only while the dumps in
  flight fill HSX_DUMP_BUDGET_MB (back-pressure: a dump is never dropped, never partial).
- Only requests of the client are dumped: rid starting with hsx_dump_format.RID_PREFIX. SGLang's
  own (GET /health's HEALTH_CHECK_<hex>, the start-up warm-up) are skipped, their rows left in
  place; a pass with none of the client's costs nothing (no copy, no writer).
- To the client: per request and prefill piece, `<rid>.<offset>.pt` (format hsx-sglang-dump/2: a
  JSON header, then each tensor's raw bytes at a page boundary: hsx_dump_format.py beside it), visible only
  complete (temp name + rename), or a `<rid>.<offset>.failed` marker holding why it was not
  written. When a request's reply leaves, its pieces have been taken, not yet written: the
  client waits for the renames (extraction.sglang.dumps.wait_request).
- It never raises into SGLang: anything unexpected is logged once per kind and the pass skipped.
  The standard library only at module level, torch imported lazily.

Configuration (environment of the server process):
  HSX_DUMP_DIR        directory for dump files; unset or empty -> the hook stays inactive.
  HSX_DUMP_LAYERS     comma-separated layer ids in the HF hidden_states index convention (= SGLang's
                      capture index); default SGLang's EAGLE-3 default [2, N//2, N-3].
  HSX_DUMP_BUDGET_MB  host memory the dumps in flight may hold (default 4096; on CUDA pinned, of
                      which torch's caching host allocator may keep ~2x cached). Full -> the
                      forward waits for the writer.
"""

from __future__ import annotations

import atexit
import collections
import functools
import logging
import os
import threading
import time
from typing import Any

FORMAT_MODULE = "hsx_dump_format"  # the dump format, deployed beside this file (one source of truth)


def _load_format() -> Any:
    """The dump format module beside this file: `sglang.hsx_dump_format` as deployed, or
    `extraction.sglang.hsx_dump_format` in the project; loaded from its file when this module was
    itself loaded from a file outside a package. Missing -> ImportError: attach() never runs
    without it (the patch's import of the hook fails, and SGLang runs unpatched)."""
    import importlib
    import importlib.util
    import sys

    if __package__:
        return importlib.import_module(f"{__package__}.{FORMAT_MODULE}")
    module = sys.modules.get(FORMAT_MODULE)
    if module is None:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), FORMAT_MODULE + ".py")
        spec = importlib.util.spec_from_file_location(FORMAT_MODULE, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"no {FORMAT_MODULE} beside {__file__}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[FORMAT_MODULE] = module
        spec.loader.exec_module(module)
    return module


fmt = _load_format()
ENV_DIR = "HSX_DUMP_DIR"
ENV_LAYERS = "HSX_DUMP_LAYERS"
ENV_BUDGET = "HSX_DUMP_BUDGET_MB"
DEFAULT_BUDGET_MB = 4096
EXIT_DRAIN_SECONDS = 60.0
STALL_LOG_SECONDS = 60.0  # a back-pressure wait this long is logged (and again every as long)
MARKER_MODE = 0o640  # a failure marker: the server account writes it, its group (the job) reads it
PREFILL_MODES = ("EXTEND", "MIXED")
OWNER_HOOK = "hook"
OWNER_SGLANG = "sglang"  # EAGLE-3/DFlash set layers_to_capture; we pass through

log = logging.getLogger("hsx_dump_hook")
_logged: set[str] = set()
_lock = threading.Lock()


def _log_once(key: str, msg: str, *args: Any, exc_info: bool = False) -> None:
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    log.warning("hsx dump hook: " + msg + " (logged once)", *args, exc_info=exc_info)


def default_layer_ids(num_layers: int) -> list[int]:
    """SGLang's EAGLE-3 default capture ids [2, N//2, N-3]; refused when not three distinct layers
    (N=6 gives [2, 3, 3]; SGLang would capture layer 3 once and the aux state would be 2H wide)."""
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) != 3 or ids[-1] >= num_layers:
        raise ValueError(
            f"default layers {ids} of a {num_layers}-layer model are not distinct; set {ENV_LAYERS}"
        )
    return ids


def parse_layer_ids(text: str, num_layers: int) -> list[int]:
    ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    if not ids:
        raise ValueError(f"{ENV_LAYERS}={text!r} names no layers")
    if sorted(set(ids)) != ids:
        raise ValueError(f"{ENV_LAYERS}={text!r}: ids must be strictly increasing")
    if ids[0] < 1 or ids[-1] >= num_layers:
        raise ValueError(
            f"{ENV_LAYERS}={text!r}: ids must lie in 1..{num_layers - 1} (HF hidden_states index)"
        )
    return ids


def parse_budget(text: str) -> int:
    """HSX_DUMP_BUDGET_MB (MiB, may be fractional) -> bytes."""
    try:
        mb = float(text)
    except ValueError:
        raise ValueError(f"{ENV_BUDGET}={text!r} is not a number of MiB") from None
    if not 0 < mb < float("inf"):  # refuses nan and inf too (int() of those would raise unexplained)
        raise ValueError(f"{ENV_BUDGET}={text!r} must be a finite number > 0")
    return max(1, int(mb * 2**20))


def _first_of(default: Any, *lookups: tuple[str, Any]) -> Any:
    """read(module) of the first (module, read) whose module imports and whose read does not raise."""
    import importlib

    for module, read in lookups:
        try:
            return read(importlib.import_module(module))
        except Exception:
            pass
    return default


def sglang_version() -> str:
    return _first_of(
        "unknown",
        ("importlib.metadata", lambda m: m.version("sglang")),
        ("sglang.version", lambda m: str(m.__version__)),
    )


def attention_tp_rank() -> int:
    """Rank within the attention-TP group (which holds the same tokens); 0 when not distributed."""
    return _first_of(
        0,
        ("sglang.srt.layers.dp_attention", lambda m: int(m.get_attention_tp_rank())),
        ("sglang.srt.distributed.parallel_state", lambda m: int(m.get_attn_tp_group().rank_in_group)),
        ("torch.distributed", lambda m: int(m.get_rank()) if m.is_available() and m.is_initialized() else 0),
    )


def _num_layers(model: Any) -> int:
    config = getattr(model, "config", None)
    n = getattr(config, "num_hidden_layers", None)
    return int(n) if n is not None else len(model.layers)


def _forward_problem(model: Any) -> str | None:
    """Why the model's forward would never call after_forward, or None. The patch of a model file
    other than deepseek_v2.py sets `model._hsx_dump_class` to the class whose __init__ it patched;
    a subclass with a forward of its own (Qwen3Model from SGLang 0.5.21) runs that __init__ but not
    the patched forward, and a hook claiming capture there would make it return aux states its
    caller does not expect. Without the attribute (deepseek_v2.py's patch v2) nothing is checked."""
    patched = getattr(model, "_hsx_dump_class", None)
    if patched is None:
        return None
    runs = getattr(type(model), "forward", None)
    if runs is not None and runs is getattr(patched, "forward", None):
        return None
    owner = getattr(runs, "__qualname__", repr(runs)).rsplit(".", 1)[0]
    return f"{owner}.forward is not the patched {patched.__qualname__}.forward (it never calls the hook)"


def attach(model: Any, environ: dict[str, str] | None = None) -> DumpHook | None:
    """Called from the patched model's __init__; returns None (inactive) unless HSX_DUMP_DIR is set
    and the model runs the patched forward (_forward_problem)."""
    env = os.environ if environ is None else environ
    try:
        directory = env.get(ENV_DIR, "")
        if not directory:
            return None
        problem = _forward_problem(model)
        if problem is not None:
            _log_once("attach-forward", "not attached, SGLang runs unpatched: %s", problem)
            return None
        num_layers = _num_layers(model)
        text = env.get(ENV_LAYERS, "")
        layer_ids = parse_layer_ids(text, num_layers) if text else default_layer_ids(num_layers)
        budget = parse_budget(env.get(ENV_BUDGET, "") or str(DEFAULT_BUDGET_MB))
        os.makedirs(directory, exist_ok=True)
        problem = fmt.dump_dir_problem(directory)
        if problem is not None:
            _log_once("attach-dir", "not attached, SGLang runs unpatched: %s", problem)
            return None
        hook = DumpHook(model, directory, layer_ids, budget_bytes=budget)
        log.info(
            "hsx dump hook: dumping prefill states of layers %s to %s (budget %.0f MiB)",
            layer_ids,
            directory,
            budget / 2**20,
        )
        return hook
    except Exception:
        _log_once("attach", "not attached, SGLang runs unpatched", exc_info=True)
        return None


def pack_aux(aux: Any) -> Any:
    """[tokens, k*H] from the list form or the AuxHiddenStatePacker form."""
    import torch

    if isinstance(aux, torch.Tensor):
        return aux
    if hasattr(aux, "finalize"):
        return aux.finalize()
    return torch.cat(list(aux), dim=-1)


class _Piece:
    """One request's rows of one pass, what one dump file holds (tensors not yet exact-owned);
    `rows` in the order of the pass's sources: final state, input ids, aux parts. `finite`: the
    rows' finiteness computed on the GPU (a host bool per row), or None (CPU: the writer checks)."""

    __slots__ = ("rid", "offset", "hidden", "ids", "aux", "finite")

    def __init__(self, rid: str, offset: int, rows: list[Any], finite: Any = None):
        self.rid, self.offset = rid, offset
        self.hidden, self.ids, self.aux = rows[0], rows[1], rows[2:]
        self.finite = finite

    def all_finite(self) -> bool:
        """No NaN/Inf in the piece's states (the header's FINITE_FIELD): the rows' flags computed on
        the GPU, or (CPU path) the values checked here, in the writer thread, on the very bytes it
        writes next (fmt.states_finite)."""
        if self.finite is not None:
            return bool(self.finite.all())
        return fmt.states_finite(self.hidden, self.aux)


class _Pass:
    """The dump work of one forward pass, as the writer takes it."""

    __slots__ = ("pieces", "nbytes", "ready", "device", "layer_ids", "owner", "version")

    def __init__(self, pieces: list[_Piece], nbytes: int, layer_ids: list[int], owner: str, version: str):
        self.pieces = pieces
        self.nbytes = nbytes
        self.ready: Any = None  # CUDA event to synchronize before the host bytes are read
        self.device: Any = None  # its CUDA device
        self.layer_ids, self.owner, self.version = layer_ids, owner, version


class _Writer:
    """The writer thread and the memory budget it shares with the forward (one Condition)."""

    def __init__(self, budget: int, write_pass: Any):
        self.budget = budget
        self._write_pass = write_pass
        self.cond = threading.Condition()
        self.queue: collections.deque[_Pass] = collections.deque()
        self.held = 0  # bytes admitted and not yet released
        self.busy = False
        self.thread: threading.Thread | None = None
        self.pid = 0
        self.waited = 0.0  # seconds the forward waited for room (back-pressure)
        self.write_seconds = 0.0
        self.bytes_written = 0

    # ------------------------------------------------------------ the forward's side

    def _ensure_thread(self) -> None:
        if self.thread is not None and self.pid == os.getpid() and self.thread.is_alive():
            return
        if self.pid != os.getpid():  # first use, or a forked child: nothing in flight is ours
            self.cond = threading.Condition()
            self.queue.clear()
            self.held, self.busy = 0, False
            if self.pid == 0:
                atexit.register(self.drain_at_exit)
            self.pid = os.getpid()
        self.thread = threading.Thread(target=self._run, name="hsx-dump-writer", daemon=True)
        self.thread.start()

    def admit(self, nbytes: int) -> None:
        """Wait until `nbytes` fit in the budget beside the bytes in flight, then hold them; a pass
        larger than the whole budget waits until nothing is in flight and then goes alone."""
        self._ensure_thread()
        if nbytes > self.budget:
            _log_once("oversize", "a pass of %.0f MiB exceeds %s; it goes alone", nbytes / 2**20, ENV_BUDGET)
        with self.cond:
            t0 = time.perf_counter()
            while self.held and self.held + nbytes > self.budget:  # back-pressure, logged if long
                if not self.cond.wait(STALL_LOG_SECONDS):
                    log.warning(
                        "hsx dump hook: the forward has waited %.0f s for the dump writer (%.0f MiB in "
                        "flight, budget %.0f MiB); is the dump disk stuck?",
                        time.perf_counter() - t0,
                        self.held / 2**20,
                        self.budget / 2**20,
                    )
            self.waited += time.perf_counter() - t0
            self.held += nbytes

    def submit(self, job: _Pass) -> None:
        with self.cond:
            self.queue.append(job)
            self.cond.notify_all()

    def release(self, nbytes: int) -> None:
        with self.cond:
            self.held -= nbytes
            self.cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every pass taken so far is written (or failed); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while self.queue or self.busy:
                if self.thread is None or not self.thread.is_alive() or self.pid != os.getpid():
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cond.wait(left)
        return True

    def drain_at_exit(self) -> None:
        if self.pid != os.getpid() or not (self.queue or self.busy):
            return
        if not self.flush(EXIT_DRAIN_SECONDS):
            log.warning("hsx dump hook: %d passes not written at exit", len(self.queue))

    # ------------------------------------------------------------ the writer thread

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queue:
                    self.cond.wait()
                job = self.queue.popleft()
                self.busy = True
            t0 = time.perf_counter()
            try:
                self._write_pass(job)
            except BaseException as exc:  # noqa: BLE001 - the thread must survive anything
                _log_once(f"writer:{type(exc).__name__}", "writer error: %s", exc, exc_info=True)
            finally:
                job.pieces = []  # drop the references before the room is given back
                dt = time.perf_counter() - t0
                with self.cond:
                    self.write_seconds += dt
                    self.busy = False
                self.release(job.nbytes)


class DumpHook:
    def __init__(self, model: Any, directory: str, layer_ids: list[int], budget_bytes: int | None = None):
        self.model = model
        self.directory = directory
        self.layer_ids = list(layer_ids)
        self.owned: list[int] = list(layer_ids)
        model.layers_to_capture = self.owned
        self.version = sglang_version()
        self.rank: int | None = None
        self.budget = int(budget_bytes or DEFAULT_BUDGET_MB * 2**20)
        self.writer = _Writer(self.budget, self._write_pass)
        self.dumped = 0  # files written (for tests and logs)
        self.failed = 0  # pieces that could not be written
        self._streams: dict[Any, Any] = {}  # CUDA device -> side stream

    def owns_capture(self) -> bool:
        return self.model.layers_to_capture is self.owned

    def after_forward(self, forward_batch: Any, hidden_states: Any, aux_hidden_states: Any) -> Any:
        """Hand a prefill batch to the writer; return the aux states the model should return."""
        owned = True
        try:
            owned = self.owns_capture()
            if self._should_dump(forward_batch, hidden_states):
                self._take(forward_batch, hidden_states, aux_hidden_states, owned)
        except Exception as exc:
            _log_once(f"dump:{type(exc).__name__}", "batch skipped: %s", exc, exc_info=True)
        return [] if owned else aux_hidden_states

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every dump taken so far is written or has failed (tests, benchmarks, exit)."""
        return self.writer.flush(timeout)

    def stats(self) -> dict[str, float]:
        w = self.writer
        return {
            "dumped": self.dumped,
            "failed": self.failed,
            "held_bytes": w.held,
            "waited_s": w.waited,
            "write_s": w.write_seconds,
            "bytes_written": w.bytes_written,
        }

    def _should_dump(self, forward_batch: Any, hidden_states: Any) -> bool:
        mode = getattr(forward_batch.forward_mode, "name", str(forward_batch.forward_mode))
        if mode not in PREFILL_MODES:
            return False
        import torch

        try:
            if torch.compiler.is_compiling():
                _log_once("compiling", "forward is being compiled (prefill CUDA graphs on?); not dumping")
                return False
        except AttributeError:
            pass
        if getattr(hidden_states, "is_cuda", False) and torch.cuda.is_current_stream_capturing():
            _log_once(
                "capturing", "forward is being captured in a CUDA graph (prefill graphs on?); not dumping"
            )
            return False
        if self.rank is None:
            self.rank = attention_tp_rank()
        return self.rank == 0

    # ------------------------------------------------------------ the forward's side

    def _take(self, forward_batch: Any, hidden_states: Any, aux: Any, owned: bool) -> None:
        """Check the batch, cut it per request and hand it to the writer (may wait for room)."""
        import torch

        rids = getattr(forward_batch, "rids", None)
        seq_lens = getattr(forward_batch, "extend_seq_lens_cpu", None)
        prefix_lens = getattr(forward_batch, "extend_prefix_lens_cpu", None)
        if rids is None or seq_lens is None or prefix_lens is None:
            raise ValueError("forward batch lacks rids / extend_seq_lens_cpu / extend_prefix_lens_cpu")
        seq_lens = [int(n) for n in seq_lens]
        prefix_lens = [int(n) for n in prefix_lens]
        if not (len(rids) == len(seq_lens) == len(prefix_lens)):
            raise ValueError(
                f"{len(rids)} rids but {len(seq_lens)} extend lengths, {len(prefix_lens)} prefixes"
            )
        ours = [str(rid).startswith(fmt.RID_PREFIX) for rid in rids]
        if not any(ours):  # SGLang's own (/health's HEALTH_CHECK_<hex>, the warm-up): no client reads them
            return
        total = sum(seq_lens)
        input_ids = forward_batch.input_ids
        layer_ids = list(self.owned if owned else self.model.layers_to_capture)
        if not hasattr(aux, "finalize") and len(aux) != len(layer_ids):
            raise ValueError(f"{len(aux)} aux states for layers {layer_ids}")
        # The packer form is already [tokens, k*H]; the list form is cut per request and
        # concatenated per request by the writer, never for the whole batch.
        packed = pack_aux(aux) if hasattr(aux, "finalize") or not isinstance(aux, list | tuple) else None
        parts = [packed] if packed is not None else list(aux)
        tensors = [("hidden_states", hidden_states), ("input_ids", input_ids)] + [("aux", t) for t in parts]
        for name, t in tensors:
            if int(t.shape[0]) != total:
                raise ValueError(f"{name} has {int(t.shape[0])} rows, the batch extends {total} tokens")
        hidden = int(hidden_states.shape[-1])
        width = sum(int(t.shape[-1]) for t in parts)
        if width != hidden * len(layer_ids):
            raise ValueError(f"aux width {width} != {len(layer_ids)} layers x {hidden}")
        sources = [hidden_states.detach(), input_ids.detach()] + [t.detach() for t in parts]
        if not hidden_states.is_cuda:  # the writer keeps references, copies only what SGLang reuses
            reused = getattr(forward_batch, "aux_hidden_states_buffer", None)  # SGLang's, every pass
            if packed is not None and _shares_storage(packed, reused):
                sources[2] = packed.detach().clone()  # not ours to keep
            sources[1] = sources[1].to(torch.long, copy=True)  # tiny; the batch's ids are SGLang's
        owner = OWNER_HOOK if owned else OWNER_SGLANG
        job = _Pass([], sum(fmt.nbytes(t) for t in sources), layer_ids, owner, self.version)
        self.writer.admit(job.nbytes)  # what the pass holds: CPU, the rows; CUDA, their pinned copies
        try:
            finite = None
            if hidden_states.is_cuda:
                sources, finite = self._copy_to_host(sources, job)
            start = 0  # a pass's rows are contiguous per request, in rids order
            for rid, n, offset, mine in zip(rids, seq_lens, prefix_lens, ours, strict=True):
                if mine:
                    rows = [t[start : start + n] for t in sources]
                    finite_rows = None if finite is None else finite[start : start + n]
                    job.pieces.append(_Piece(str(rid), offset, rows, finite_rows))
                start += n  # another's rows are skipped in place
        except BaseException:
            # The room goes back, or the next pass would wait forever. Copies already queued into
            # the dropped pinned tensors are harmless: the caching host allocator notes the stream
            # of each non-blocking copy and reuses a freed block only once that stream passed it.
            self.writer.release(job.nbytes)
            raise
        self.writer.submit(job)

    def _copy_to_host(self, sources: list[Any], job: _Pass) -> tuple[list[Any], Any]:
        """Queue a copy of each source into a pinned host tensor of its own, on a side stream that
        first waits for the forward's stream, and record job.ready after them: the host tensors,
        and the rows' finiteness (fmt.rows_finite, computed on that stream, copied the same way)."""
        import torch

        device = sources[0].device
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        hosts = []
        with torch.cuda.stream(stream):
            finite = fmt.rows_finite(sources[0], sources[2:])  # on the side stream: off the forward's path
            host_finite = self._pinned(finite.shape, torch.bool)
            host_finite.copy_(finite, non_blocking=True)
            for t in sources:
                host = self._pinned(t.shape, t.dtype)
                host.copy_(t, non_blocking=True)
                if t.is_cuda:  # the caching allocator must not reuse it before this copy ran
                    t.record_stream(stream)
                hosts.append(host)
            job.ready = torch.cuda.Event(blocking=True)  # the writer sleeps on it, not spins
            job.ready.record(stream)
        job.device = device
        return hosts, host_finite

    def _pinned(self, shape: Any, dtype: Any) -> Any:
        """Pinned host memory from torch's caching host allocator (freed blocks are cached by
        power-of-two size and handed out again: cheap once warm)."""
        import torch

        return torch.empty(shape, dtype=dtype, pin_memory=True)

    # ------------------------------------------------------------ the writer's side

    def _write_pass(self, job: _Pass) -> None:
        if job.ready is not None:
            try:
                import torch

                # a new thread's current device is 0: a rank on cuda:N would open a context on GPU 0
                torch.cuda.set_device(job.device)
                job.ready.synchronize()
            except Exception as exc:
                for piece in job.pieces:
                    self._failed(piece, exc)
                return
        for piece in job.pieces:
            try:
                record = self._record(piece, job)
                self._write(fmt.dump_name(piece.rid, piece.offset), record)
                self.writer.bytes_written += sum(fmt.nbytes(t) for t in _tensors_of(record))
            except Exception as exc:
                self._failed(piece, exc)

    def _record(self, piece: _Piece, job: _Pass) -> dict[str, Any]:
        """The piece's header fields, and its tensors under `input_ids` (int64), `hidden_state`
        and `aux_parts` (written interleaved row by row: no concatenated copy is made)."""
        return {
            "format": fmt.FORMAT,
            "rid": piece.rid,
            "offset": piece.offset,
            "seq_len": piece.offset + int(piece.ids.shape[0]),
            "layer_ids": job.layer_ids,
            "capture_owner": job.owner,
            "sglang_version": job.version,
            fmt.FINITE_FIELD: piece.all_finite(),
            "input_ids": piece.ids.long(),
            "hidden_state": piece.hidden,
            "aux_parts": list(piece.aux),
        }

    def _save(self, record: dict[str, Any], path: str) -> None:
        header = {k: v for k, v in record.items() if k not in ("input_ids", "hidden_state", "aux_parts")}
        fmt.write_dump(path, header, (record["input_ids"], record["hidden_state"], record["aux_parts"]))

    def _write(self, name: str, record: dict[str, Any]) -> None:
        self._place(name, functools.partial(self._save, record))
        self.dumped += 1

    def _failed(self, piece: _Piece, exc: BaseException) -> None:
        """Log a piece not written; leave its marker (the reason) where the directory takes it."""
        self.failed += 1
        name = fmt.dump_name(piece.rid, piece.offset)
        log.warning("hsx dump hook: dump %s not written: %s: %s", name, type(exc).__name__, exc)
        _log_once(f"write:{type(exc).__name__}", "first write failure of this kind", exc_info=True)

        def save(tmp: str) -> None:  # created as a dump is: exclusively, never through a link
            with os.fdopen(os.open(tmp, fmt.NEW_FILE_FLAGS, MARKER_MODE), "w", encoding="utf-8") as f:
                f.write(f"{type(exc).__name__}: {exc}\n")

        try:
            self._place(fmt.failed_name(piece.rid, piece.offset), save)
        except OSError:
            pass  # no marker either: the client times out and asks again

    def _place(self, name: str, save: Any) -> None:
        """save(a temp name), then rename it to `name`: the file appears whole or not at all.
        `save` creates the temp exclusively without following a link (fmt.NEW_FILE_FLAGS): an entry planted
        at the temp's name fails it (FileExistsError) and is left alone. rename(2) follows no link
        either: a link at `name` is replaced, never written through."""
        tmp = os.path.join(self.directory, f".{name}.{os.getpid()}.tmp")
        try:
            save(tmp)
            os.replace(tmp, os.path.join(self.directory, name))
        except FileExistsError:
            raise  # not our temp: nothing of ours to remove
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise


def _tensors_of(record: dict[str, Any]) -> list[Any]:
    return [record["input_ids"], record["hidden_state"], *record["aux_parts"]]


def _shares_storage(a: Any, b: Any) -> bool:
    try:
        return b is not None and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except Exception:
        return False
