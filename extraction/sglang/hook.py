"""Hidden-state dump hook that runs INSIDE the SGLang server (deployed as `sglang/hsx_dump_hook.py`).

The patched DeepseekV2Model calls `attach(model)` at the end of its __init__ and
`hook.after_forward(forward_batch, hidden_states, aux_hidden_states)` just before forward returns,
where `hidden_states` is the final state after `self.norm` (= HF hidden_states[-1]).

How the per-layer states are obtained: the model itself collects `hidden_states + residual` (the
residual-stream input of layer i = HF hidden_states[i]) for every id in `model.layers_to_capture`,
in whichever form the release uses: a list appended in the model loop (0.5.10-0.5.13), a list
appended inside the layer (0.5.14-0.5.16), or an AuxHiddenStatePacker whose `.finalize()` gives
[tokens, k*H] (0.5.17+). The hook claims capture by setting `layers_to_capture` to its own list at
attach time; when EAGLE-3 (or DFlash) later sets its own list, the hook sees the list is no longer
its own and passes the aux states through untouched (dumping what EAGLE-3 captured). When the hook
owns capture it returns `[]`, so the model returns exactly what an unpatched model would.

Only prefill passes (EXTEND/MIXED) are dumped, split per request by `forward_batch.rids` and
`extend_seq_lens_cpu` / `extend_prefix_lens_cpu` (tokens are contiguous per request in rids order).
A chunked prefill gives one file per piece, named by the piece's offset; the reader joins them and
checks for gaps. Only attention-TP rank 0 writes (other ranks hold the same tokens). Files appear
atomically (temp name + rename); no fsync: a dump is consumed seconds later, and after a crash the
client simply asks again.

Configuration (environment of the server process):
  HSX_DUMP_DIR     directory for dump files; unset or empty -> the hook stays inactive.
  HSX_DUMP_LAYERS  comma-separated layer ids in the HF hidden_states index convention (= SGLang's
                   capture index); default SGLang's EAGLE-3 default [2, N//2, N-3].

This file must import nothing but the standard library at module level (torch lazily), and must
never raise into SGLang: anything unexpected is logged once per kind and the batch is skipped.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import Any

FORMAT = "hsx-sglang-dump/1"
ENV_DIR = "HSX_DUMP_DIR"
ENV_LAYERS = "HSX_DUMP_LAYERS"
PREFILL_MODES = ("EXTEND", "MIXED")
OWNER_HOOK = "hook"
OWNER_SGLANG = "sglang"  # EAGLE-3/DFlash set layers_to_capture; we pass through

log = logging.getLogger("hsx_dump_hook")
_logged: set[str] = set()
_lock = threading.Lock()
_SAFE_RID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def _log_once(key: str, msg: str, *args: Any, exc_info: bool = False) -> None:
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    log.warning("hsx dump hook: " + msg + " (logged once)", *args, exc_info=exc_info)


def rid_stem(rid: str) -> str:
    """File-name-safe form of a request id (the reader uses the same function)."""
    if _SAFE_RID.match(rid) and not rid.startswith("."):
        return rid
    import hashlib

    return "rid-" + hashlib.sha256(rid.encode("utf-8")).hexdigest()[:32]


def dump_name(rid: str, offset: int) -> str:
    return f"{rid_stem(rid)}.{offset:09d}.pt"


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


def sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        pass
    try:
        from sglang.version import __version__  # type: ignore[import-not-found]

        return str(__version__)
    except Exception:
        return "unknown"


def attention_tp_rank() -> int:
    """Rank within the attention-TP group (which holds the same tokens); 0 when not distributed."""
    try:
        from sglang.srt.layers.dp_attention import get_attention_tp_rank  # type: ignore[import-not-found]

        return int(get_attention_tp_rank())
    except Exception:
        pass
    try:
        from sglang.srt.distributed.parallel_state import get_attn_tp_group  # type: ignore[import-not-found]

        return int(get_attn_tp_group().rank_in_group)
    except Exception:
        pass
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:
        pass
    return 0


def _num_layers(model: Any) -> int:
    config = getattr(model, "config", None)
    n = getattr(config, "num_hidden_layers", None)
    return int(n) if n is not None else len(model.layers)


def attach(model: Any, environ: dict[str, str] | None = None) -> DumpHook | None:
    """Called from DeepseekV2Model.__init__; returns None (inactive) unless HSX_DUMP_DIR is set."""
    env = os.environ if environ is None else environ
    try:
        directory = env.get(ENV_DIR, "")
        if not directory:
            return None
        num_layers = _num_layers(model)
        text = env.get(ENV_LAYERS, "")
        layer_ids = parse_layer_ids(text, num_layers) if text else default_layer_ids(num_layers)
        os.makedirs(directory, exist_ok=True)
        hook = DumpHook(model, directory, layer_ids)
        log.info("hsx dump hook: dumping prefill states of layers %s to %s", layer_ids, directory)
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


class DumpHook:
    def __init__(self, model: Any, directory: str, layer_ids: list[int]):
        self.model = model
        self.directory = directory
        self.layer_ids = list(layer_ids)
        self.owned: list[int] = list(layer_ids)
        model.layers_to_capture = self.owned
        self.version = sglang_version()
        self.rank: int | None = None
        self.dumped = 0  # files written (for tests and logs)

    def owns_capture(self) -> bool:
        return self.model.layers_to_capture is self.owned

    def after_forward(self, forward_batch: Any, hidden_states: Any, aux_hidden_states: Any) -> Any:
        """Dump a prefill batch; return the aux states the model should return."""
        owned = True
        try:
            owned = self.owns_capture()
            result = [] if owned else aux_hidden_states
            if self._should_dump(forward_batch):
                self._dump(forward_batch, hidden_states, aux_hidden_states, owned)
            return result
        except Exception as exc:
            _log_once(f"dump:{type(exc).__name__}", "batch skipped: %s", exc, exc_info=True)
            return [] if owned else aux_hidden_states

    def _should_dump(self, forward_batch: Any) -> bool:
        mode = getattr(forward_batch.forward_mode, "name", str(forward_batch.forward_mode))
        if mode not in PREFILL_MODES:
            return False
        try:
            import torch

            if torch.compiler.is_compiling():
                _log_once("compiling", "forward is being compiled (prefill CUDA graphs on?); not dumping")
                return False
        except AttributeError:
            pass
        if self.rank is None:
            self.rank = attention_tp_rank()
        return self.rank == 0

    def _dump(self, forward_batch: Any, hidden_states: Any, aux: Any, owned: bool) -> None:
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
        total = sum(seq_lens)
        input_ids = forward_batch.input_ids
        layer_ids = list(self.owned if owned else self.model.layers_to_capture)
        if len(aux) != len(layer_ids) and not hasattr(aux, "finalize"):
            raise ValueError(f"{len(aux)} aux states for layers {layer_ids}")
        # The packer form is already [tokens, k*H]; the list form is cut per request and
        # concatenated per request, never for the whole batch (no batch-sized temporary).
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
        start = 0
        for rid, n, prefix in zip(rids, seq_lens, prefix_lens, strict=True):
            end = start + n
            if packed is not None:
                aux_rows = _owned_cpu(packed[start:end])
            else:
                aux_rows = _owned_cpu(torch.cat([t[start:end] for t in parts], dim=-1))
            record = {
                "format": FORMAT,
                "rid": str(rid),
                "offset": prefix,
                "seq_len": prefix + n,
                "input_ids": _owned_cpu(input_ids[start:end]).long(),
                "hidden_state": _owned_cpu(hidden_states[start:end]),
                "aux_hidden_state": aux_rows,
                "layer_ids": layer_ids,
                "capture_owner": OWNER_HOOK if owned else OWNER_SGLANG,
                "sglang_version": self.version,
            }
            self._write(dump_name(str(rid), prefix), record)
            start = end

    def _write(self, name: str, record: dict[str, Any]) -> None:
        import torch

        final = os.path.join(self.directory, name)
        tmp = os.path.join(self.directory, f".{name}.{os.getpid()}.tmp")
        try:
            torch.save(record, tmp)
            os.replace(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self.dumped += 1


def _owned_cpu(t: Any) -> Any:
    """A contiguous CPU tensor owning exactly its bytes (torch.save writes a view's whole storage)."""
    import torch

    if t.device.type != "cpu":
        return t.detach().to("cpu").contiguous()
    t = t.detach()
    if (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    ):
        return t
    return t.clone(memory_format=torch.contiguous_format)
