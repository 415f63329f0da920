"""In-process transformers backend: the real forward pass of a (small) target on CPU or CUDA.

For the lab, tests and benchmarks. A batch is right-padded to its longest sample with an attention
mask; each sample's states are sliced back to its own length. `extract` hands back host copies
that own exactly their bytes (torch.save writes a view's whole storage); `extract_async`, which
the runner uses, hands back views of one host buffer per batch (the runner's shared buffer where it
gives one): on a GPU pinned memory that fills while the next batch is queued, on a CPU the forward's
own output.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from extraction.backends.base import ModelInfo, Sample, SampleStates

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


def torch_dtype(name: str) -> torch.dtype:
    """'bf16' / 'bfloat16' / ... -> torch dtype; ValueError names the accepted spellings."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of bf16, fp16, fp32") from None


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (run.json's spelling)."""
    return str(dtype).removeprefix("torch.")


def model_revision(model_dir: str | os.PathLike) -> str:
    """A cheap identity for a model directory that survives moving it: a hub snapshot's commit
    when the path has one, else a hash of config.json plus the weight file names and sizes."""
    path = Path(model_dir).resolve()
    if path.parent.name == "snapshots" and len(path.name) == 40:
        return path.name
    h = hashlib.sha256()
    config = path / "config.json"
    if config.exists():
        h.update(json.dumps(json.loads(config.read_text()), sort_keys=True).encode())
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        h.update(f"{f.name}:{f.stat().st_size}\n".encode())
    return "cfg-" + h.hexdigest()[:16]


@contextlib.contextmanager
def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


class PendingStates:
    """A batch's results whose tensors may still be on their way to the host (see extract_async)."""

    def __init__(
        self,
        results: list[SampleStates],
        event: torch.cuda.Event | None,
        finite: torch.Tensor | None = None,
        lengths: list[int] | None = None,
        batch: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        self.results = results
        # (final [B, W, H], aux [B, W, k*H]) on the host: each result's states are the first n
        # rows of one row of these, so whoever moves them can move the batch in two copies
        self.batch = batch
        self._event = event
        self._finite = finite  # [B, W] bool on the host: every state of that token is finite
        self._lengths = lengths

    def wait(self) -> list[SampleStates]:
        """Block until the tensors are on the host (releases the GIL while waiting)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        if self._finite is not None and self._lengths is not None:
            for row, (r, n) in enumerate(zip(self.results, self._lengths, strict=True)):
                r.finite = bool(self._finite[row, :n].all())
            self._finite = None
        return self.results


class HFBackend:
    """Batched forward with output_hidden_states; states are canonical-layer HF hidden_states."""

    name = "hf"

    def __init__(
        self,
        model_dir: str | os.PathLike,
        layer_ids: list[int] | None = None,
        dtype: str = "bf16",
        device: str = "cpu",
        attn_implementation: str | None = "eager",
    ):
        from transformers import AutoConfig, AutoModel

        self.model_dir = str(model_dir)
        self.dtype = torch_dtype(dtype)
        self.device = torch.device(device)
        config = AutoConfig.from_pretrained(self.model_dir)
        kwargs = {"dtype": self.dtype}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        # AutoModel = the decoder without lm_head: no [B, L, vocab] logits we would throw away
        # (transformers reports the unused lm_head weight as "UNEXPECTED": expected here, so quiet).
        with _quiet_transformers():
            self.model = AutoModel.from_pretrained(self.model_dir, config=config, **kwargs)
        self.model.to(self.device).eval()
        self.config = config
        text = getattr(config, "text_config", None) or config
        self.num_layers = int(text.num_hidden_layers)
        self.hidden_size = int(text.hidden_size)
        self.vocab_size = int(text.vocab_size)
        self.pad_id = int(getattr(text, "pad_token_id", None) or 0)
        self.layer_ids = list(layer_ids) if layer_ids is not None else None

    def set_layers(self, layer_ids: list[int]) -> None:
        self.layer_ids = list(layer_ids)

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            model=Path(self.model_dir).resolve().name,
            revision=model_revision(self.model_dir),
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            vocab_size=self.vocab_size,
            dtype=dtype_name(self.dtype),
        )

    @torch.inference_mode()
    def forward_states(
        self,
        samples: list[Sample],
        into: Callable[[list[tuple[tuple[int, ...], torch.dtype]]], list[torch.Tensor] | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The forward pass alone: (final [B, W, H], aux [B, W, k*H], lengths), on the device.

        Right-padded to the longest sample. On CUDA the inputs go up through pinned memory without
        blocking, so the host can queue this batch while the GPU still runs the previous one.
        `into([(shape, dtype), ...])` may give two tensors on the device for final and aux, which
        are then written there (on a CPU: the runner's shared buffer, so no copy follows); None
        there, or no `into`: tensors of torch's own.
        """
        if self.layer_ids is None:
            raise RuntimeError("HFBackend: capture layers not set")
        lengths = [int(s.input_ids.numel()) for s in samples]
        width = max(lengths)
        cuda = self.device.type == "cuda"
        ids = torch.full((len(samples), width), self.pad_id, dtype=torch.long, pin_memory=cuda)
        mask = torch.zeros((len(samples), width), dtype=torch.long, pin_memory=cuda)
        for row, (s, n) in enumerate(zip(samples, lengths, strict=True)):
            ids[row, :n] = s.input_ids
            mask[row, :n] = 1
        ids, mask = ids.to(self.device, non_blocking=cuda), mask.to(self.device, non_blocking=cuda)
        out = self.model(
            input_ids=ids,
            attention_mask=mask if min(lengths) < width else None,
            output_hidden_states=True,
            use_cache=False,
        )
        hs = out.hidden_states
        captured = [hs[i] for i in self.layer_ids]
        final = hs[-1]
        bufs = None
        if into is not None:
            aux_shape = (*final.shape[:-1], sum(t.shape[-1] for t in captured))
            aux_dtype = functools.reduce(torch.promote_types, (t.dtype for t in captured))  # cat's own
            bufs = into([(tuple(final.shape), final.dtype), (aux_shape, aux_dtype)])
        if bufs is None:
            return final, torch.cat(captured, dim=-1), lengths
        final_buf, aux_buf = bufs
        final_buf.copy_(final)
        torch.cat(captured, dim=-1, out=aux_buf)
        return final_buf, aux_buf, lengths

    @torch.inference_mode()
    def extract_async(
        self,
        samples: list[Sample],
        host_empty: Callable[[list[tuple[tuple[int, ...], torch.dtype]]], list[torch.Tensor] | None]
        | None = None,
    ) -> PendingStates:
        """Queue the forward and the copy to the host; the states are valid after `.wait()`.

        On CUDA the batch's states land in pinned host memory by non-blocking copies on a copy
        stream of their own, followed by an event: this thread returns at once and queues the next
        batch, whose kernels run while the copy engine moves this one (on the compute stream the
        copy held the next forward back ~5 ms per batch of 268 MB). Whoever writes the shards
        waits on the event. Each sample's states are views of the batch buffer. `host_empty([(shape,
        dtype), ...])` gives those buffers when the caller has host memory of its own (the runner's
        writer process reads the states from a shared mapping), or None; torch's pinned memory otherwise.
        On a CPU the forward writes its states into `host_empty`'s buffers itself (forward_states'
        `into`): nothing is left to copy or wait for.
        """
        if not samples:
            return PendingStates([], None)
        on_host = self.device.type == "cpu"  # the states are host tensors as the forward writes them
        final, aux, lengths = self.forward_states(samples, into=host_empty if on_host else None)
        event = finite = None
        if self.device.type == "cuda":
            # The NaN/Inf check costs nothing here and ~10 ms a sample on the host in bf16.
            dev_finite = torch.isfinite(final).all(-1) & torch.isfinite(aux).all(-1)
            bufs = (
                host_empty([(tuple(final.shape), final.dtype), (tuple(aux.shape), aux.dtype)])
                if host_empty
                else None
            )
            if bufs is not None:
                host_final, host_aux = bufs
            else:
                host_final = torch.empty(final.shape, dtype=final.dtype, pin_memory=True)
                host_aux = torch.empty(aux.shape, dtype=aux.dtype, pin_memory=True)
            finite = torch.empty(dev_finite.shape, dtype=torch.bool, pin_memory=True)
            copy_stream = self._copy_stream()
            copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(copy_stream):
                host_final.copy_(final, non_blocking=True)
                host_aux.copy_(aux, non_blocking=True)
                finite.copy_(dev_finite, non_blocking=True)
                event = torch.cuda.Event()
                event.record(copy_stream)
            for t in (final, aux, dev_finite):  # not reused by the allocator before the copy ends
                t.record_stream(copy_stream)
            final, aux = host_final, host_aux
        elif self.device.type != "cpu":
            final, aux = final.to("cpu"), aux.to("cpu")
        results = [
            SampleStates(
                sample_id=s.sample_id,
                input_ids=s.input_ids,
                hidden_state=final[row, :n],
                aux_hidden_state=aux[row, :n],
            )
            for row, (s, n) in enumerate(zip(samples, lengths, strict=True))
        ]
        return PendingStates(results, event, finite, lengths, (final, aux))

    def _copy_stream(self) -> torch.cuda.Stream:
        stream = getattr(self, "_d2h_stream", None)
        if stream is None:
            stream = self._d2h_stream = torch.cuda.Stream(self.device)
        return stream

    def extract(self, samples: list[Sample]) -> list[SampleStates]:
        """Synchronous: each sample's states on the host, contiguous, owning exactly their bytes."""
        results = self.extract_async(samples).wait()
        for r in results:
            r.hidden_state = r.hidden_state.clone()
            r.aux_hidden_state = r.aux_hidden_state.clone()
        return results

    def close(self) -> None:
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
