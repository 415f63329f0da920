"""Shared parts of the dump hook's tests (test_sglang_hook*.py): synthetic SGLang batches built
from the tiny model's real hidden states, the hook attached to a model object, a gate that holds
the writer, and a fake torch.cuda for the CUDA path (no GPU here; FakeCuda says what it stands in
for). Fixtures are imported by name into the test modules that use them.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from extraction.sglang import hook
from hsx.sglang_versions import SUPPORTED_VERSIONS, release_key

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sglang_wheels  # noqa: E402

LAYERS = [1, 3, 4]
LENGTHS = {"hsx-req-a": 5, "hsx-req-b": 17, "hsx-req-c": 9}


class ForwardMode(enum.IntEnum):  # the names SGLang's ForwardMode uses
    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4
    TARGET_VERIFY = 5


@pytest.fixture(scope="module")
def states() -> dict[str, tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
    """rid -> (input_ids [L], HF hidden_states of that request alone)."""
    from transformers import DeepseekV3Config, DeepseekV3Model

    from extraction.testbed.tiny import model_config_kwargs

    torch.manual_seed(0)
    model = DeepseekV3Model(DeepseekV3Config(**model_config_kwargs())).to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1)
    out = {}
    with torch.inference_mode():
        for rid, n in LENGTHS.items():
            ids = torch.randint(3, 1024, (n,), generator=gen)
            hs = model(input_ids=ids[None], output_hidden_states=True, use_cache=False).hidden_states
            out[rid] = (ids, tuple(h[0].clone() for h in hs))
    return out


def _packer_class(version: str):
    src = sglang_wheels.require(version) / "aux_hidden_states.py"
    spec = importlib.util.spec_from_file_location(f"sglang_aux_{version.replace('.', '_')}", src)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.AuxHiddenStatePacker


def _model(num_layers: int = 6):
    """The two attributes of DeepseekV2Model the hook touches."""
    return SimpleNamespace(config=SimpleNamespace(num_hidden_layers=num_layers), layers_to_capture=[])


def forward(model, pieces, states, form, mode=ForwardMode.EXTEND, flush=True):
    """Mimic DeepseekV2Model.forward's tail for a batch of (rid, start, end) pieces; with `flush`,
    wait until the hook's writer has written what it took (the client's wait, in one process)."""
    rows = lambda i: torch.cat([states[rid][1][i][s:e] for rid, s, e in pieces])  # noqa: E731
    final = rows(-1)
    captured = [i for i in range(model.config.num_hidden_layers) if i in model.layers_to_capture]
    if form == "list":
        aux = [rows(i) for i in captured]
    else:
        aux = form(len(model.layers_to_capture))
        for i in captured:
            aux.append(rows(i))
    batch = SimpleNamespace(
        forward_mode=mode,
        rids=[rid for rid, _, _ in pieces],
        extend_seq_lens_cpu=[e - s for _, s, e in pieces],
        extend_prefix_lens_cpu=[s for _, s, _ in pieces],
        input_ids=torch.cat([states[rid][0][s:e] for rid, s, e in pieces]),
    )
    returned = model._hsx_dump.after_forward(batch, final, aux)
    if flush:
        assert model._hsx_dump.flush(30)
    return returned, aux


# Releases whose DeepseekV2Model collects into an AuxHiddenStatePacker (0.5.17 on); earlier ones a list.
PACKER_RELEASES = [v for v in SUPPORTED_VERSIONS if release_key(v) >= (0, 5, 17, 0)]


@pytest.fixture(params=["list"] + [f"packer-{v}" for v in PACKER_RELEASES])
def form(request):
    if request.param == "list":
        return "list"
    return _packer_class(request.param.split("-")[1])


@pytest.fixture
def attached(tmp_path):
    model = _model()
    model._hsx_dump = hook.attach(
        model, {hook.ENV_DIR: str(tmp_path), hook.ENV_LAYERS: ",".join(map(str, LAYERS))}
    )
    assert model._hsx_dump is not None
    model._hsx_dump.version = "0.5.23"
    return model, tmp_path



# ---------------------------------------------------------------- off the critical path (#29)


def _batch(pieces, states):
    """A ForwardBatch-like object and the tail of the forward for (rid, start, end) pieces."""
    rows = lambda i: torch.cat([states[rid][1][i][s:e] for rid, s, e in pieces])  # noqa: E731
    batch = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        rids=[rid for rid, _, _ in pieces],
        extend_seq_lens_cpu=[e - s for _, s, e in pieces],
        extend_prefix_lens_cpu=[s for _, s, _ in pieces],
        input_ids=torch.cat([states[rid][0][s:e] for rid, s, e in pieces]),
    )
    return batch, rows(-1), [rows(i) for i in LAYERS]


class Gate:
    """Holds the hook's writer inside its save until opened (the disk made slow at will)."""

    def __init__(self, hk, monkeypatch):
        self.open, self.entered = threading.Event(), threading.Event()
        self.records = []
        real = hk._save

        def save(record, path):
            self.records.append(record)
            self.entered.set()
            assert self.open.wait(30)
            real(record, path)

        monkeypatch.setattr(hk, "_save", save)


def _in_thread(fn, *args):
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("value", fn(*args)), daemon=True)
    t.start()
    return t, result



def _packer(packed):
    """What AuxHiddenStatePacker hands the hook: .finalize() -> [tokens, k*H]."""
    return SimpleNamespace(finalize=lambda: packed)



# ---------------------------------------------------------------- the CUDA path, torch.cuda faked


class DeviceTensor(torch.Tensor):
    """A CPU tensor the hook takes for a CUDA one: is_cuda, and record_stream logged."""

    calls: list = []

    @property
    def is_cuda(self):
        return True

    def record_stream(self, stream):
        DeviceTensor.calls.append(("record_stream", self.data_ptr(), stream))


class _Queued(TorchFunctionMode):
    """Inside the side stream: a non-blocking copy is queued for the 'GPU', not run."""

    def __init__(self, cuda):
        super().__init__()
        self.cuda = cuda

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and kwargs.get("non_blocking"):
            self.cuda.calls.append(("copy", args[1].data_ptr()))
            self.cuda.queued.append((args[0], args[1]))
            return args[0]
        return func(*args, **kwargs)


class FakeCuda:
    """torch.cuda's stream and event API on a CPU-only machine, and host memory that is not pinned.
    A non-blocking copy on the side stream runs only when an event recorded after it is
    synchronized (the GPU finishing the stream's work): a writer that did not wait writes zeros."""

    def __init__(self, monkeypatch):
        self.calls = []
        self.queued = []  # (host, source), in stream order
        self.ran = 0  # how many of them have run
        self.lock = threading.Lock()
        self.capturing = False
        self.pinned = []  # shapes of the pinned tensors handed out
        self.fail_pinned_at = None  # this pinned allocation (0-based) raises, once
        cuda = self

        class Stream:
            def __init__(self, device):
                self.device = device

            def wait_stream(self, other):
                cuda.calls.append(("wait_stream", other))

        class Event:
            def __init__(self, blocking=False):
                cuda.calls.append(("event", blocking))
                self.upto = 0

            def record(self, stream):
                cuda.calls.append(("record", stream))
                self.upto = len(cuda.queued)

            def synchronize(self):
                cuda.calls.append(("synchronize", threading.current_thread().name))
                cuda.run(self.upto)

        @contextlib.contextmanager
        def stream(s):
            with _Queued(cuda):
                yield

        def pinned(hk, shape, dtype):
            if len(cuda.pinned) == cuda.fail_pinned_at:
                cuda.fail_pinned_at = None
                raise RuntimeError("cudaHostAlloc failed")
            cuda.pinned.append(tuple(shape))
            return torch.zeros(shape, dtype=dtype)

        def set_device(device):
            cuda.calls.append(("set_device", device, threading.current_thread().name))

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device: "forward-stream")
        monkeypatch.setattr(torch.cuda, "set_device", set_device)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: cuda.capturing)
        monkeypatch.setattr(hook.DumpHook, "_pinned", pinned)
        monkeypatch.setattr(DeviceTensor, "calls", self.calls)

    def run(self, upto):
        with self.lock:
            for host, source in self.queued[self.ran : upto]:
                host.copy_(source)
            self.ran = max(self.ran, upto)


@pytest.fixture(params=["cpu", "cuda-faked"])
def device(request, monkeypatch):
    """Where the forward's states live: CPU tensors, or 'CUDA' ones (FakeCuda)."""
    if request.param == "cpu":
        return lambda t: t
    FakeCuda(monkeypatch)
    return lambda t: t.as_subclass(DeviceTensor)


def _on_device(pieces, states, rids=None):
    """_batch's pass with its states 'on the GPU' (and its requests renamed, given `rids`)."""
    batch, final, aux = _batch(pieces, states)
    batch.input_ids = batch.input_ids.as_subclass(DeviceTensor)
    batch.rids = rids or batch.rids
    return batch, final.as_subclass(DeviceTensor), [t.as_subclass(DeviceTensor) for t in aux]


class Turnstile:
    """Lets the hook's writer through its saves only as many times as told."""

    def __init__(self, hk, monkeypatch):
        self.entered, self.go = threading.Semaphore(0), threading.Semaphore(0)
        real = hk._save

        def save(record, path):
            self.entered.release()
            assert self.go.acquire(timeout=30)
            real(record, path)

        monkeypatch.setattr(hk, "_save", save)

    def let(self, n):
        for _ in range(n):
            self.go.release()


