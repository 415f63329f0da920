"""The sglang path end to end (#29 item 6): null-model server -> deployed hook -> dumps -> the real
client (`hsx extract --backend sglang`'s Runner) -> shards, against dd of the same bytes.

The server is the TEST-ONLY stand-in (tests/standin_sglang/server.py) with --null-model: no model,
states of Kimi-K2.5 width (hidden 7168, 61 layers: the hook's default capture [2, 30, 58], 3 aux
layers + final, bf16), handed to the project's hook exactly where the patched DeepseekV2Model calls
it, in a process of its own; `--forward-us` sleeps that long a token before the hook (the GPU's
time). The client is the Runner in this process, as `hsx extract` runs it: `--samples` samples of
`--tokens` tokens each (a long conversation truncated by --max-length), `--concurrency` in flight.

Each round, on the output's file system: dd (zeros, 4 MiB blocks, conv=fsync) of the bytes the
shards will take, the client's run, dd again, then dd with oflag=direct (the disk's own rate: the
client writes its shards with O_DIRECT, extraction/shards/direct.py, so the buffered dd's page
cache is a cost it does not pay). Printed per round and as median [min - max]:
  client MiB/s       shard bytes / (backend ready -> every shard published and indexed), and its
                     ratio to the mean of the two dd's (target >= 0.8)
  disk bytes/byte    sectors the output's block device wrote during the client's run
                     (/proc/diskstats) per shard byte (target <= 1.05 with the default dump location,
                     hsx.layout.DEFAULT_DUMP_DIR; another writer on the same disk adds to it)
  server idle        the scheduler's time with no request to run / first request -> last done
                     (target <= 0.05 while requests remain). Meaningful where the server is the
                     slowest stage (--forward-us above the disk's time a token, ~180 us at 300
                     MiB/s): with a faster server the window's requests are done at once and the
                     server waits for the disk through the client's window, as it must (back-pressure)
  hook us/token      time inside the hook's after_forward a token (the forward's critical path;
                     its ratio to a synchronous save is tests/bench/bench_sglang_path.py's)
  CPU s/GiB          user + system seconds per GiB of shards: the client's (this process, during
                     its run), the server's (its hook's writer: the null model computes nothing)
                     and dd's (the one after): what the path costs where the CPUs are shared
  disk busy          the output's block device busy (/proc/diskstats io_ticks) / wall time, during
                     the client's run and during the dd's: below 1 the disk waited on its writer
  publish busy       the client's publisher writing shards (the runner's writer_publish_s) / the
                     client's time: near 1 the shard writer bounds the client (a copy and its
                     O_DIRECT writes, one after the other), well below it the server's dumps do

    .venv/bin/python tests/bench/bench_sglang_client.py [--rounds 3] [--samples 12] [--tokens 3700]
        [--concurrency 8] [--forward-us 0] [--chunk 8192] [--dump-dir DIR] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[2] / "module_utils")]
from extraction.inputs.config import build_config  # noqa: E402
from extraction.runner import Runner  # noqa: E402
from extraction.sglang import hook  # noqa: E402
from hsx import layout  # noqa: E402
from hsx.index import load_index  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HIDDEN, NUM_LAYERS = 7168, 61
# The default dump location (hsx.layout, a RAM path); a checkout from before it existed: /dev/shm.
DEFAULT_DUMP_DIR = getattr(layout, "DEFAULT_DUMP_DIR", None) or "/dev/shm/hsx-dumps"


def bench_model(work: Path, tokens: int) -> Path:
    """The tiny model's tokenizer with a K2.5-wide config.json (no weights: the server has none)."""
    from extraction.testbed.tiny import build_tiny_model

    model = work / "k25-null"
    if not (model / "config.json").exists():
        tiny = build_tiny_model(work / "tiny", seed=0)
        model.mkdir(parents=True, exist_ok=True)
        for f in Path(tiny).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors"):
                shutil.copy(f, model / f.name)
        cfg = json.loads((model / "config.json").read_text())
        cfg.update(hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS, max_position_embeddings=max(tokens, 8192))
        (model / "config.json").write_text(json.dumps(cfg))
    return model


def bench_dataset(work: Path, n: int, tokens: int) -> Path:
    """n conversations of well over `tokens` tokens (--max-length cuts them to exactly that)."""
    from extraction.testbed.tiny import tiny_conversations

    path = work / f"long-{n}.jsonl"
    words = " ".join(m["content"] for r in tiny_conversations(64, seed=1) for m in r.get("messages", []))
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            text = (words + " ") * max(1, (tokens * 6) // max(1, len(words)) + 1)
            f.write(json.dumps({"id": f"k25-{i:05d}", "messages": [
                {"role": "user", "content": f"{i} {text}"}, {"role": "assistant", "content": text}]}) + "\n")
    return path


def cpu_seconds(who: int = resource.RUSAGE_SELF) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def proc_cpu_seconds(pid: int) -> float:
    """User + system seconds of a live process (/proc/<pid>/stat, fields 14 and 15)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def disk_sectors(path: str) -> tuple[str, int]:
    """(device name, sectors written so far) of the block device holding `path`."""
    name, sectors, _busy = disk_stats(path)
    return name, sectors


def disk_stats(path: str) -> tuple[str, int, float]:
    """(device name, sectors written so far, seconds it was busy so far: io_ticks) of the block
    device holding `path`."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    with open("/proc/diskstats", encoding="ascii") as f:
        for line in f:
            fields = line.split()
            if int(fields[0]) == major and int(fields[1]) == minor:
                return fields[2], int(fields[9]), int(fields[12]) / 1000
    raise SystemExit(f"{path}: device {major}:{minor} not in /proc/diskstats (not a block device?)")


def fs_type(path: str) -> str:
    best, kind = "", "?"
    with open("/proc/mounts", encoding="utf-8") as f:
        for line in f:
            _src, mnt, typ = line.split()[:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, typ
    return kind


DD_BUSY: list[float] = []  # the disk's busy fraction during each dd


def dd(directory: Path, nbytes: int, direct: bool = False) -> float:
    """MiB/s of dd writing nbytes of zeros into `directory` with fsync (its disk's busy fraction
    appended to DD_BUSY), or with oflag=direct (the disk's own rate, page cache left out)."""
    target = directory / "dd.bin"
    count = max(1, -(-nbytes // (4 << 20)))
    busy0 = disk_stats(str(directory))[2]
    t0 = time.perf_counter()
    mode = ["oflag=direct", "conv=fsync"] if direct else ["conv=fsync"]
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=4M", f"count={count}", *mode],
                   check=True, capture_output=True)
    seconds = time.perf_counter() - t0
    DD_BUSY.append((disk_stats(str(directory))[2] - busy0) / seconds)
    target.unlink()
    return count * 4 / seconds


def start_server(model: Path, dump_dir: str, args) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, hook.ENV_DIR: dump_dir, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop(hook.ENV_LAYERS, None)  # the hook's default for 61 layers: [2, 30, 58]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests/standin_sglang/server.py"), "--model-path", str(model),
         "--port", str(port), "--null-model", str(HIDDEN), "--num-layers", str(NUM_LAYERS),
         "--forward-us", str(args.forward_us), "--chunked-prefill-size", str(args.chunk)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)
        if proc.poll() is not None:
            raise SystemExit(f"the stand-in server died: {proc.stderr.read().decode()[-2000:]}")
    raise SystemExit("the stand-in server did not come up in 120 s")


def one_round(model: Path, dataset: Path, work: Path, dump_dir: str, shard_bytes_guess: int, args) -> dict:
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(dump_dir, ignore_errors=True)
    os.makedirs(dump_dir)
    proc, url = start_server(model, dump_dir, args)
    try:
        dd_before = dd(work, shard_bytes_guess)
        cfg = build_config(dict(
            model=str(model), dataset=str(dataset), output=str(out), backend="sglang", server_url=url,
            dump_dir=dump_dir, dtype="bf16", max_length=args.tokens, concurrency=args.concurrency,
            batch_size=args.concurrency, progress="off", status_interval=1.0,
        ))
        runner = Runner(cfg, log=lambda m: None)
        dev, s0, b0 = disk_stats(str(work))
        c0, srv0 = cpu_seconds(), proc_cpu_seconds(proc.pid)
        t_run = time.perf_counter()
        code = runner.run()
        c1, srv1 = cpu_seconds(), proc_cpu_seconds(proc.pid)
        _dev, s1, b1 = disk_stats(str(work))
        disk_busy = (b1 - b0) / (time.perf_counter() - t_run)
        assert code == 0, f"the client exited {code}"
        with urllib.request.urlopen(url + "/hsx_stats", timeout=10) as r:
            stats = json.loads(r.read())
        d0 = cpu_seconds(resource.RUSAGE_CHILDREN)
        dd_after = dd(work, shard_bytes_guess)
        dd_cpu = cpu_seconds(resource.RUSAGE_CHILDREN) - d0
        dd_direct = dd(work, shard_bytes_guess, direct=True)
    finally:
        proc.terminate()
        proc.wait(30)
    tm = runner.timings
    index = load_index(str(out))
    nbytes = sum(e.size for e in index.values())
    assert len(index) == args.samples, f"{len(index)} of {args.samples} published"
    assert not os.listdir(dump_dir), f"dumps left: {os.listdir(dump_dir)[:5]}"
    seconds = tm["pipeline_end_at"] - tm["ready_at"]
    span = stats["last_done"] - stats["first_arrival"]
    shutil.rmtree(out, ignore_errors=True)
    dd_mean = (dd_before + dd_after) / 2
    return {
        "client_mibs": nbytes / 2**20 / seconds,
        "dd_before": dd_before,
        "dd_after": dd_after,
        "dd_direct": dd_direct,
        "ratio": nbytes / 2**20 / seconds / dd_mean,
        "disk_per_byte": (s1 - s0) * 512 / nbytes,
        "disk_busy": disk_busy,
        "publish_busy": tm.get("writer_publish_s", 0.0) / seconds,
        "dd_busy": sum(DD_BUSY[-2:]) / 2,
        "idle": stats["idle_s"] / span,
        "hook_us": stats["hook_s"] / max(1, stats["tokens"]) * 1e6,
        "bytes": nbytes,
        "seconds": seconds,
        "client_cpu": (c1 - c0) / (nbytes / 2**30),
        "server_cpu": (srv1 - srv0) / (nbytes / 2**30),
        "dd_cpu": dd_cpu / (shard_bytes_guess / 2**30),
        "device": dev,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=3700)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight (hsx extract --concurrency)")
    ap.add_argument("--forward-us", type=float, default=0.0, help="the server's time a token, before the hook")
    ap.add_argument("--chunk", type=int, default=8192, help="the server's --chunked-prefill-size")
    ap.add_argument("--dump-dir", default=DEFAULT_DUMP_DIR, help=f"default {DEFAULT_DUMP_DIR} (hsx.layout)")
    ap.add_argument("--dir", default="/var/tmp", help="parent of the output (the disk measured)")
    args = ap.parse_args()
    if not hasattr(layout, "DEFAULT_DUMP_DIR"):
        print(f"note: hsx.layout has no DEFAULT_DUMP_DIR in this checkout; dumps in {DEFAULT_DUMP_DIR}")
    work = Path(tempfile.mkdtemp(prefix="hsx-bench-client-", dir=args.dir))
    # a sibling of the dump location, on its file system: a server's own dump directory is never touched
    dump_dir = f"{args.dump_dir.rstrip('/')}-bench-{os.getpid()}"
    try:
        model = bench_model(work, args.tokens)
        dataset = bench_dataset(work, args.samples, args.tokens)
        guess = args.samples * args.tokens * (HIDDEN * 4 * 2 + 16)
        print(
            f"{args.samples} samples x {args.tokens} tokens, hidden {HIDDEN}, 3 aux + final bf16 "
            f"(~{guess / 2**20:.0f} MiB of shards a round); concurrency {args.concurrency}; server forward "
            f"{args.forward_us:g} us/token, chunk {args.chunk}; dumps in {dump_dir} ({fs_type(dump_dir)}), "
            f"output in {work} ({fs_type(str(work))}); load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
        )
        rows = []
        for r in range(args.rounds):
            row = one_round(model, dataset, work, dump_dir, guess, args)
            rows.append(row)
            print(
                f"round {r + 1}: client {row['client_mibs']:5.0f} MiB/s ({row['seconds']:.1f} s) | dd "
                f"{row['dd_before']:.0f}/{row['dd_after']:.0f} MiB/s (oflag=direct {row['dd_direct']:.0f}) | "
                f"ratio {row['ratio']:.3f} | "
                f"{row['device']} wrote {row['disk_per_byte']:.3f} B/shard B | server idle {row['idle']:.3f} | "
                f"hook {row['hook_us']:.3f} us/token | CPU s/GiB client {row['client_cpu']:.2f} server "
                f"{row['server_cpu']:.2f} dd {row['dd_cpu']:.2f} | disk busy client {row['disk_busy']:.2f} dd "
                f"{row['dd_busy']:.2f} | publish busy {row['publish_busy']:.2f} | load {os.getloadavg()[0]:.1f}", flush=True
            )
        print(f"over {len(rows)} rounds: median [min - max]")
        for key, label, fmt in (
            ("client_mibs", "client MiB/s", "{:.0f}"),
            ("ratio", "client / mean of dd before+after (target >= 0.8)", "{:.3f}"),
            ("dd_direct", "dd oflag=direct MiB/s (the disk without the page cache)", "{:.0f}"),
            ("disk_per_byte", "output disk bytes per shard byte (target <= 1.05)", "{:.3f}"),
            ("idle", "server idle fraction (target <= 0.05)", "{:.3f}"),
            ("hook_us", "hook critical path us/token", "{:.3f}"),
            ("client_cpu", "client CPU s/GiB of shards (user + system)", "{:.2f}"),
            ("server_cpu", "server CPU s/GiB (its hook's writer; no model)", "{:.2f}"),
            ("dd_cpu", "dd CPU s/GiB", "{:.2f}"),
            ("disk_busy", "output disk busy (io_ticks) during the client's run", "{:.2f}"),
            ("dd_busy", "output disk busy during the dd's", "{:.2f}"),
            ("publish_busy", "client publishing shards / client time", "{:.2f}"),
        ):
            vals = [row[key] for row in rows]
            print(f"  {label:52s} {fmt.format(statistics.median(vals))} [{fmt.format(min(vals))} - {fmt.format(max(vals))}]")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(dump_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
