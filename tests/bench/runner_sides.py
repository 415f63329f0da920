"""The sides and probes of tests/bench/bench_runner.py, also used by bench_forward_into.py,
bench_forward_probe.py and probe_interrupts.py: the tiny setup, forward only, forward + host copy,
the runner, the peers' save loop, the forward probe, the host counters (faults, CPU seconds,
interrupts), the null writer, the disk line and the resume start-up. What each side times:
bench_runner.py's docstring."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from extraction.backends.hf import HFBackend  # noqa: E402
from extraction.inputs.chat_tokenizer import ChatTokenizer, load_tokenizer  # noqa: E402
from extraction.inputs.config import ExtractConfig, build_config  # noqa: E402
from extraction.inputs.dataset import DatasetEntry, scan_dataset  # noqa: E402
from extraction.runner import Runner  # noqa: E402
from extraction.runner.timing import thread_usage  # noqa: E402
from extraction.shards import ShardWriter  # noqa: E402
from extraction.testbed.tiny import build_tiny_model, write_tiny_dataset  # noqa: E402
from hsx.index import IndexEntry, encode_index_line, index_record  # noqa: E402
from hsx.layout import INDEX_NAME, shard_relpath  # noqa: E402


@dataclass
class BenchSetup:
    """What every side of a CPU/GPU runner bench shares (bench_setup)."""

    model_dir: Path
    backend: HFBackend  # the bench's own, with the runner's capture layers
    cfg_kw: dict  # the runner's settings, less its output
    cfg: ExtractConfig
    entries: list[DatasetEntry]
    tokenizer: ChatTokenizer


def add_setup_arguments(ap: argparse.ArgumentParser, samples: int) -> None:
    """bench_setup's arguments for a CPU fp32 bench script (the tiny model, its dataset, the
    runner's batch plan)."""
    ap.add_argument("--samples", type=int, default=samples)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--capture", default="1,3,4")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=256)
    ap.set_defaults(dtype="fp32", device="cpu")


def bench_setup(work: Path, args: argparse.Namespace) -> BenchSetup:
    """The tiny model and dataset under `work`, a backend of the bench's own and the runner's
    config for them, from args' hidden, layers, samples, capture, dtype, device, max_length,
    batch_size (a Runner's prepare() resolves the capture layers, as a run does)."""
    model_dir = build_tiny_model(work / "model", seed=0, hidden=args.hidden, layers=args.layers)
    ds = write_tiny_dataset(work / "d.jsonl", args.samples, seed=0)
    backend = HFBackend(model_dir, None, dtype=args.dtype, device=args.device)
    cfg_kw = dict(
        model=str(model_dir),
        dataset=str(ds),
        layers=args.capture,
        dtype=args.dtype,
        device=args.device,
        max_length=args.max_length,
        batch_size=args.batch_size,
        progress="off",
    )
    cfg = build_config({**cfg_kw, "output": str(work / "unused")})
    r0 = Runner(cfg, log=lambda _m: None)
    r0.prepare()
    r0.close()
    backend.set_layers(r0.layer_ids)
    shutil.rmtree(work / "unused")
    tokenizer = ChatTokenizer(load_tokenizer(model_dir), args.max_length)
    return BenchSetup(model_dir, backend, cfg_kw, cfg, scan_dataset(ds).entries, tokenizer)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def forward_only(backend: HFBackend, batches, device: str) -> float:
    t = time.perf_counter()
    for b in batches:
        backend.forward_states(b)
    sync(device)
    return time.perf_counter() - t


def forward_copy(backend: HFBackend, batches, device: str) -> float:
    t = time.perf_counter()
    for b in batches:
        backend.extract(b)
    sync(device)
    return time.perf_counter() - t


def sync_save_loop(backend: HFBackend, batches, out: Path, device: str) -> float:
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    i = 0
    for b in batches:
        for s, r in zip(b, backend.extract(b), strict=True):
            torch.save(
                {
                    "input_ids": s.input_ids,
                    "loss_mask": s.loss_mask,
                    "hidden_state": r.hidden_state.unsqueeze(0),
                    "aux_hidden_state": r.aux_hidden_state.unsqueeze(0),
                },
                out / f"data_{i}.ckpt",
            )
            i += 1
    return time.perf_counter() - t


class _Kept:
    """The bench's own loaded backend handed to the runner (close() keeps it): a warm model, as
    forward-only has, instead of the one the runner loads itself."""

    def __init__(self, inner: HFBackend):
        self.inner, self.name = inner, "hf"

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def close(self) -> None:
        pass


def runner_run(
    cfg_kw: dict,
    out: Path,
    backend: HFBackend | None = None,
    *,
    writer_threads: int = 0,
    tokenizer_process: bool = True,
    **extra,
) -> tuple[float, float, dict]:
    """(model-ready -> last shard indexed, whole run() wall, the runner's timings). `extra` are
    `hsx extract` options (publisher, limit, cpu_threads, ...); writer_threads and
    tokenizer_process the Runner's variant arguments."""
    cfg = build_config({**cfg_kw, **extra, "output": str(out)})
    variant = dict(writer_threads=writer_threads, tokenizer_process=tokenizer_process, log=lambda _m: None)
    if backend is None:  # the real backend factory: loads the model itself
        r = Runner(cfg, **variant)
    else:
        r = Runner(cfg, backend_factory=lambda _c, _ids: _Kept(backend), **variant)
    t = time.perf_counter()
    code = r.run()
    wall = time.perf_counter() - t
    if code != 0:
        raise SystemExit(f"runner exited {code}")
    tm = dict(r.timings)
    tm["prepare_s"] = tm["ready_at"] - t - tm["model_load_s"]
    return tm["pipeline_end_at"] - tm["ready_at"], wall, tm


class ForwardProbe:
    """--probe: the time spent inside `HFBackend.forward_states` (wall, the calling thread's CPU and
    context switches), summed per side: whether the runner's forward passes themselves are slower
    than forward-only's, or the time goes between them (its bookkeeping, the GIL)."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self.vcsw = self.ivcsw = self.calls = self.faults = 0
        self._inner = HFBackend.forward_states
        self._irqs = interrupt_counts()
        self._cpu = host_cpu_seconds()

    def install(self) -> None:
        inner, probe = self._inner, self

        def forward_states(backend, samples, **kw):
            f0 = thread_faults()
            u0, t0 = thread_usage(), time.perf_counter()
            try:
                return inner(backend, samples, **kw)
            finally:
                u1 = thread_usage()
                probe.faults += thread_faults() - f0
                probe.wall += time.perf_counter() - t0
                probe.cpu += u1[0] - u0[0]
                probe.vcsw += u1[1] - u0[1]
                probe.ivcsw += u1[2] - u0[2]
                probe.calls += 1

        HFBackend.forward_states = forward_states

    def take(self) -> str:
        """What was summed since the last take, as a line; then zero."""
        irqs, cpu = interrupt_counts(), host_cpu_seconds()
        line = (
            f"inside forward_states: {self.calls} calls, wall {self.wall:.2f}s, cpu {self.cpu:.2f}s, "
            f"context switches {self.vcsw} voluntary, {self.ivcsw} involuntary, thread's minor faults "
            f"{self.faults}; host-wide since the last line: "
            + ", ".join(f"{k} {v - self._irqs.get(k, 0)}" for k, v in irqs.items())
            + "; host CPU seconds: "
            + ", ".join(f"{k} {v - self._cpu.get(k, 0.0):.1f}" for k, v in cpu.items())
        )
        self.wall = self.cpu = 0.0
        self.vcsw = self.ivcsw = self.calls = self.faults = 0
        self._irqs, self._cpu = irqs, cpu
        return line


def thread_faults() -> int:
    """This thread's minor page faults so far (0 where there is no per-thread usage)."""
    try:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return 0


IPI_ROWS = ("TLB", "CAL", "RES")
CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def host_cpu_seconds() -> dict[str, float]:
    """/proc/stat's first line in seconds, summed over the CPUs: what the host's cores did, and
    `steal`, the time a virtual machine's CPUs were ready but the hypervisor ran someone else (on
    a shared host, what the helper processes' extra CPU demand may cost the forward)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    return {name: int(v) / tick for name, v in zip(CPU_FIELDS, fields[1:], strict=False)}


def interrupt_counts(rows: tuple[str, ...] | None = IPI_ROWS) -> dict[str, int]:
    """/proc/interrupts summed over the CPUs, by row: by default Linux's TLB shootdowns,
    function-call (CAL) and rescheduling (RES) interrupts (what one thread's page-table changes
    or wake-ups cost the others' cores); rows=None: every row, a device's as "N:its name"."""
    counts: dict[str, int] = {}
    try:
        with open("/proc/interrupts") as f:
            ncpu = len(f.readline().split())
            for row in f:
                fields = row.split()
                if not fields:
                    continue
                name = fields[0].rstrip(":")
                if name.isdigit():
                    name = f"{name}:{fields[-1]}"
                if rows is None or name in rows:
                    counts[name] = sum(int(x) for x in fields[1 : 1 + ncpu] if x.isdigit())
    except OSError:
        pass
    return counts


@contextlib.contextmanager
def null_writer(on: bool):
    """With `on`, shards are neither written nor indexed (ShardWriter.write returns an entry at
    once, commit does nothing): the runner's pipeline without its disk work, to tell the
    writers' share of the gap (their GIL and CPU time) from the rest (tokenizer, queues)."""
    if not on:
        yield
        return
    write, commit = ShardWriter.write, ShardWriter.commit

    def fake_write(self, sample_id, input_ids, loss_mask, hidden_state, aux_hidden_state):
        size = hidden_state.nbytes + aux_hidden_state.nbytes
        return IndexEntry(sample_id, "null", size, "crc32:00000000", int(input_ids.numel()))

    ShardWriter.write, ShardWriter.commit = fake_write, lambda self, entries: None
    try:
        yield
    finally:
        ShardWriter.write, ShardWriter.commit = write, commit


def disk_info(path: Path, mib: int = 256) -> str:
    """Filesystem type and write+fsync bandwidth where the shards go: the writer's ceiling."""
    fstype = "?"
    try:
        best = ""
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if real.startswith(parts[1]) and len(parts[1]) >= len(best):
                    best, fstype = parts[1], parts[2]
    except OSError:
        pass
    f = path / "ddtest"
    block = os.urandom(1 << 20)
    t = time.perf_counter()
    with open(f, "wb") as fh:
        for _ in range(mib):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
    dt = time.perf_counter() - t
    f.unlink()
    return f"{fstype}, write+fsync {mib / dt:.0f} MiB/s"


def resume_startup(model_dir: Path, work: Path, n: int, layers: str) -> dict:
    """Build n indexed shards cheaply (one real shard, copied), then time the runner's prepare()."""
    out, ds = work / "resume-out", work / "resume.jsonl"
    if out.exists():
        shutil.rmtree(out)
    rows = [
        {
            "id": f"s{i:06d}",
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
        }
        for i in range(n)
    ]
    ds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kw = dict(
        model=str(model_dir), dataset=str(ds), output=str(out), layers=layers, dtype="bf16", progress="off"
    )
    cfg = build_config(kw)
    r = Runner(cfg, log=lambda _m: None)
    r.prepare()  # writes run.json
    r.close()
    hidden, k = r.manifest.hidden_size, r.manifest.num_aux
    w = ShardWriter(str(out), r.manifest)
    t = torch.zeros(8, dtype=torch.long)
    first = w.publish("s000000", t, t, torch.zeros(8, hidden), torch.zeros(8, k * hidden))
    data = (out / first.path).read_bytes()
    t0 = time.perf_counter()
    lines = []
    made = set()
    for i in range(1, n):
        sid = f"s{i:06d}"
        rel = shard_relpath(sid)
        d = os.path.dirname(rel)
        if d not in made:
            os.makedirs(out / d, exist_ok=True)
            made.add(d)
        (out / rel).write_bytes(data)
        lines.append(
            encode_index_line(
                index_record(IndexEntry(sid, rel, first.size, first.checksum, first.num_tokens))
            )
        )
    with open(out / INDEX_NAME, "ab") as f:
        f.write(b"".join(lines))
    build_s = time.perf_counter() - t0
    os.sync()
    t = time.perf_counter()
    r2 = Runner(build_config(kw), log=lambda _m: None)
    r2.prepare()
    r2.close()
    prep = time.perf_counter() - t
    assert len(r2.done) == n, (len(r2.done), n)
    return {
        "shards": n,
        "build_s": round(build_s, 1),
        "prepare_s": round(prep, 2),
        "quick_s": round(r2.resume_seconds, 2),
    }
