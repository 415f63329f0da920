"""Shard verification benchmarks, measured side by side in one run (the machine is shared and noisy).

1. quick vs the resume check users write by hand (torch.load every file), on N small shards.
2. quick over 37,312 shards, warm cache.
3. full vs a raw sequential read of the same bytes (cat > /dev/null), warm cache.
4. storage: shard size vs tensor bytes.

    .venv/bin/python tests/bench/bench_verify.py            # full sizes
    .venv/bin/python tests/bench/bench_verify.py --small    # quick smoke run
    .venv/bin/python tests/bench/bench_verify.py --only 13  # parts 1 and 3 only

`full` uses the fastest CRC32 the host has (ISA-L via `pip install isal`, or zlib-ng, else the
stdlib's zlib); part 3 measures it and the stdlib fallback side by side.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import hsx.crc
from extraction.shards import ShardWriter
from extraction.shards.verify import verify_output
from hsx.cores import default_workers
from hsx.crc import use_crc_backend
from hsx.index import IndexEntry, append_index, index_record
from hsx.layout import shard_relpath
from hsx.manifest import RunManifest


def manifest(hidden: int) -> RunManifest:
    return RunManifest(
        model="bench", hidden_size=hidden, num_layers=8, layer_ids=[1, 3, 5],
        layer_convention="hf_hidden_states_index", dtype="bfloat16", vocab_size=1024,
    )  # fmt: skip


def payload(tokens: int, hidden: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 1024, (tokens,), generator=g),
        "loss_mask": torch.ones(tokens, dtype=torch.int64),
        "hidden_state": torch.randn(tokens, hidden, generator=g),
        "aux_hidden_state": torch.randn(tokens, 3 * hidden, generator=g),
    }


def make_copies(root: Path, n: int, tokens: int, hidden: int, distinct: int = 1) -> int:
    """A run of n shards: `distinct` real publishes (lengths tokens..tokens+distinct-1), then
    byte copies of them under new ids with real index lines. Distinct lengths keep the pickle
    parse honest: shards of one run repeat a pickle only when their length repeats.
    """
    w = ShardWriter(root, manifest(hidden), fsync_index=False)
    seeds = [w.publish(f"seed-{j}", **payload(tokens + j, hidden, seed=j)) for j in range(min(distinct, n))]
    blobs = [(e, (root / e.path).read_bytes()) for e in seeds]
    records = []
    for i in range(n - len(seeds)):
        first, data = blobs[i % len(blobs)]
        sid = f"sample-{i:06d}"
        rel = shard_relpath(sid)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        records.append(index_record(IndexEntry(sid, rel, first.size, first.checksum, first.num_tokens)))
    append_index(str(root), records, fsync=True)
    return seeds[0].size


def verified(root: Path, level: str, workers: int) -> None:
    """One verification whose result must be all good (a figure for a failing check means nothing)."""
    r = verify_output(str(root), level, workers=workers)
    if r.exit_code != 0 or r.ok != r.checked:
        raise SystemExit(f"bench data failed {level}: {r.to_dict()['bad'][:3]}")


def timed(fn, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def torch_load_all(root: Path) -> None:
    for p in sorted((root / "shards").rglob("*.pt")):
        torch.load(p, weights_only=True)


def evict(root: Path) -> None:
    for p in (root / "shards").rglob("*.pt"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cat_all(root: Path) -> None:
    files = sorted(str(p) for p in (root / "shards").rglob("*.pt"))
    subprocess.run(
        ["xargs", "-0", "cat"], input="\0".join(files).encode(), stdout=subprocess.DEVNULL, check=True
    )


def best_of(repeat: int, sides: dict[str, object]) -> dict[str, float]:
    """Best time of each side, the sides interleaved round by round (side by side on a noisy machine)."""
    best = {k: float("inf") for k in sides}
    for _ in range(repeat):
        for name, fn in sides.items():
            best[name] = min(best[name], timed(fn))
    return best


# `quick` in a process of its own without torch, as `hsx verify` runs (its forked workers then copy a
# small process, not one with torch loaded): the first verification in the process (no shard layout
# known yet, as for every `hsx verify`) and a second one; prints "first second" in seconds.
_QUICK_ALONE = """
import sys, time
from hsx.verify import verify_output
assert "torch" not in sys.modules
root, workers = sys.argv[1], int(sys.argv[2])
times = []
for _ in range(2):
    t = time.perf_counter()
    r = verify_output(root, "quick", workers=workers)
    times.append(time.perf_counter() - t)
    assert r.exit_code == 0 and r.ok == r.checked, r.to_dict()
print(*times)
"""


def quick_alone(root: Path, workers: int, out: dict[str, float]) -> None:
    """One run of _QUICK_ALONE; keeps the best first and second times in `out`."""
    # The code under test is the one this process imported (`python -c` would put the working
    # directory first on sys.path, which may hold another checkout): hsx's folder, run from /.
    code_dir = str(Path(hsx.crc.__file__).resolve().parents[1])
    got = subprocess.run(
        [sys.executable, "-c", _QUICK_ALONE, str(root), str(workers)],
        check=True,
        capture_output=True,
        text=True,
        cwd="/",
        env={**os.environ, "PYTHONPATH": os.pathsep.join([code_dir, os.environ.get("PYTHONPATH", "")])},
    )
    first, second = map(float, got.stdout.split())
    out["first"] = min(out.get("first", first), first)
    out["second"] = min(out.get("second", second), second)


def read_all_bare(root: Path) -> None:
    """open + pread + close of every shard, nothing else (no index, no listing, no checks): the
    floor of any verifier that reads each file once, in one process."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    for p in _shard_paths(root):
        fd = os.open(p, flags)
        os.pread(fd, 1 << 20, 0)
        os.close(fd)


_PATHS: dict[Path, list[str]] = {}


def _shard_paths(root: Path) -> list[str]:
    if root not in _PATHS:
        _PATHS[root] = sorted(str(p) for p in (root / "shards").rglob("*.pt"))
    return _PATHS[root]


def part_quick_vs_torch_load(args, base: Path) -> None:
    """1. quick vs torch.load of every file."""
    small = base / "small"
    size = make_copies(small, args.n_quick, tokens=16, hidden=8, distinct=args.distinct)
    verified(small, "quick", args.workers)  # warms the cache too
    torch_load_all(small)
    alone: dict[str, float] = {}
    t = best_of(
        args.repeat,
        {
            "load": lambda: torch_load_all(small),
            "bare": lambda: read_all_bare(small),
            "q1": lambda: verify_output(str(small), "quick", workers=1),
            "qn": lambda: verify_output(str(small), "quick", workers=args.workers),
            "alone": lambda: quick_alone(small, args.workers, alone),
        },
    )
    print(
        f"1. {args.n_quick} shards of {size} B (load {os.getloadavg()[0]:.1f}): torch.load all {t['load']:.2f}s | "
        f"quick 1 worker {t['q1']:.3f}s ({t['load'] / t['q1']:.0f}x) | quick {args.workers} workers "
        f"{t['qn']:.3f}s ({t['load'] / t['qn']:.0f}x)  target >= 50x"
    )
    print(
        f"1. same, quick with {args.workers} workers in a process without torch (as `hsx verify` runs): "
        f"first in the process {alone['first']:.3f}s ({t['load'] / alone['first']:.0f}x) | "
        f"second {alone['second']:.3f}s ({t['load'] / alone['second']:.0f}x)"
    )
    print(
        f"1. floor: open + pread + close of every file, nothing else, one process {t['bare']:.3f}s "
        f"({t['load'] / t['bare']:.0f}x torch.load)"
    )
    _PATHS.pop(small, None)
    shutil.rmtree(small)


def part_quick_large(args, base: Path) -> None:
    """2. quick over the incident's 37,312 shards, warm."""
    large = base / "large"
    make_copies(large, args.n_large, tokens=16, hidden=8, distinct=args.distinct)
    verified(large, "quick", args.workers)
    t = best_of(
        args.repeat,
        {
            "l1": lambda: verify_output(str(large), "quick", workers=1),
            "ln": lambda: verify_output(str(large), "quick", workers=args.workers),
        },
    )
    print(
        f"2. quick over {args.n_large} shards, warm (load {os.getloadavg()[0]:.1f}): 1 worker {t['l1']:.2f}s | "
        f"{args.workers} workers {t['ln']:.2f}s  target < 10 s"
    )
    shutil.rmtree(large)


def part_full_vs_cat(args, base: Path, backends: list[str]) -> None:
    """3. full vs cat > /dev/null of the same bytes, warm, then cold; per CRC32 implementation."""
    big = base / "big"
    tokens, hidden = 2048, 1024  # ~16 MiB per shard, the real format's shape at a smaller H
    shard = make_copies(big, 1, tokens, hidden)
    n_big = max(2, args.full_mib * (1 << 20) // shard)
    shutil.rmtree(big)
    shard = make_copies(big, n_big, tokens, hidden)
    gib = shard * n_big / (1 << 30)
    verified(big, "full", args.workers)
    cat_all(big)

    def full(backend: str, workers: int):
        return lambda: (use_crc_backend(backend), verify_output(str(big), "full", workers=workers))

    sides: dict[str, object] = {"cat": lambda: cat_all(big)}
    for b in backends:
        sides[f"{b} 1"] = full(b, 1)
        sides[f"{b} {args.workers}"] = full(b, args.workers)
    t = best_of(args.repeat, sides)
    figures = " | ".join(
        f"full {k} worker(s) {gib / v:.2f} GiB/s ({t['cat'] / v:.2f}x)" for k, v in t.items() if k != "cat"
    )
    print(
        f"3. full over {n_big} x {shard / (1 << 20):.1f} MiB = {gib:.2f} GiB, warm (load {os.getloadavg()[0]:.1f}): "
        f"cat {gib / t['cat']:.2f} GiB/s | {figures}  target >= 0.8x"
    )
    # Cold: evict our own files from the page cache (no global drop_caches) and read from disk.
    use_crc_backend(backends[0])
    t_cat_c = timed(lambda: (evict(big), cat_all(big)))
    t_f_c = timed(lambda: (evict(big), verify_output(str(big), "full", workers=args.workers)))
    print(
        f"3. same, cold (POSIX_FADV_DONTNEED first): cat {gib / t_cat_c:.2f} GiB/s | full {backends[0]} "
        f"{args.workers} workers {gib / t_f_c:.2f} GiB/s ({t_cat_c / t_f_c:.2f}x)  target >= 0.8x"
    )
    shutil.rmtree(big)


def part_storage(base: Path) -> None:
    """4. storage overhead."""
    for tokens, hidden in ((16, 8), (512, 256), (2048, 1024)):
        root = base / f"st{tokens}"
        w = ShardWriter(root, manifest(hidden))
        e = w.publish("s", **payload(tokens, hidden))
        tensor_bytes = tokens * 8 * 2 + tokens * hidden * 4 * 2
        limit = 1.01 * tensor_bytes + 4096
        print(
            f"4. L={tokens} H={hidden}: shard {e.size} B, tensors {tensor_bytes} B, "
            f"overhead {e.size - tensor_bytes} B ({e.size / tensor_bytes:.4f}x), limit {limit:.0f} B "
            f"{'OK' if e.size <= limit else 'OVER'}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="smoke sizes (1,000 / 3,000 shards, 256 MiB)")
    ap.add_argument("--n-quick", type=int, default=10_000)
    ap.add_argument("--n-large", type=int, default=37_312)
    ap.add_argument("--full-mib", type=int, default=2048, help="bytes for full vs cat")
    ap.add_argument(
        "--workers",
        type=int,
        default=default_workers(),
        help="default: hsx verify's (cores - 1, at most 16)",
    )
    ap.add_argument(
        "--distinct",
        type=int,
        default=512,
        help="distinct sample lengths among the small shards (real runs: ~2k)",
    )
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir, removed after)")
    ap.add_argument("--only", default="1234", help="which parts to run, e.g. 13 (default: all)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of each side-by-side measurement (best)")
    args = ap.parse_args()
    if args.small:
        args.n_quick, args.n_large, args.full_mib = 1000, 3000, 256
    base = Path(tempfile.mkdtemp(prefix="hsx-bench-", dir=args.dir))
    print(
        f"# bench_verify  {time.strftime('%Y-%m-%d %H:%M')}  cpus={os.cpu_count()} workers={args.workers} "
        f"loadavg={os.getloadavg()[0]:.1f} distinct_lengths={args.distinct} crc32={hsx.crc.CRC32_BACKEND}"
    )
    backends = list(dict.fromkeys([hsx.crc.CRC32_BACKEND, "zlib"]))  # the fast one (if any), zlib
    try:
        if "1" in args.only:
            part_quick_vs_torch_load(args, base)
        if "2" in args.only:
            part_quick_large(args, base)
        if "3" in args.only:
            part_full_vs_cat(args, base, backends)
        if "4" in args.only:
            part_storage(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
