"""Shard verification benchmarks, measured side by side in one run (the machine is shared and noisy).

1. quick vs the resume check users write by hand (torch.load every file), on N small shards.
2. quick over 37,312 shards, warm cache.
3. full vs a raw sequential read of the same bytes (cat > /dev/null), warm cache.
4. storage: shard size vs tensor bytes.

    .venv/bin/python tests/bench/bench_verify.py            # full sizes
    .venv/bin/python tests/bench/bench_verify.py --small    # quick smoke run
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from extraction.shards import RunManifest, ShardWriter
from extraction.shards import format as fmt
from extraction.shards.verify import verify_output


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
        rel = fmt.shard_relpath(sid)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        records.append(
            fmt.index_record(fmt.IndexEntry(sid, rel, first.size, first.checksum, first.num_tokens))
        )
    fmt.append_index(str(root), records, fsync=True)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="smoke sizes (1,000 / 3,000 shards, 256 MiB)")
    ap.add_argument("--n-quick", type=int, default=10_000)
    ap.add_argument("--n-large", type=int, default=37_312)
    ap.add_argument("--full-mib", type=int, default=2048, help="bytes for full vs cat")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--distinct",
        type=int,
        default=512,
        help="distinct sample lengths among the small shards (real runs: ~2k)",
    )
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir, removed after)")
    args = ap.parse_args()
    if args.small:
        args.n_quick, args.n_large, args.full_mib = 1000, 3000, 256
    base = Path(tempfile.mkdtemp(prefix="hsx-bench-", dir=args.dir))
    print(
        f"# bench_verify  {time.strftime('%Y-%m-%d %H:%M')}  cpus={os.cpu_count()} workers={args.workers} "
        f"loadavg={os.getloadavg()[0]:.1f} distinct_lengths={args.distinct}"
    )
    try:
        # 1. quick vs torch.load of every file
        small = base / "small"
        size = make_copies(small, args.n_quick, tokens=16, hidden=8, distinct=args.distinct)
        verified(small, "quick", args.workers)  # warms the cache too
        t_load = timed(lambda: torch_load_all(small))
        t_q1 = timed(lambda: verify_output(str(small), "quick", workers=1), 2)
        t_qn = timed(lambda: verify_output(str(small), "quick", workers=args.workers), 2)
        print(
            f"1. {args.n_quick} shards of {size} B: torch.load all {t_load:.2f}s | quick 1 worker {t_q1:.2f}s "
            f"({t_load / t_q1:.0f}x) | quick {args.workers} workers {t_qn:.2f}s ({t_load / t_qn:.0f}x)  target >= 50x"
        )

        # 2. quick over the incident's 37,312 shards, warm
        shutil.rmtree(small)
        large = base / "large"
        make_copies(large, args.n_large, tokens=16, hidden=8, distinct=args.distinct)
        verified(large, "quick", args.workers)
        t_l1 = timed(lambda: verify_output(str(large), "quick", workers=1), 2)
        t_ln = timed(lambda: verify_output(str(large), "quick", workers=args.workers), 2)
        print(
            f"2. quick over {args.n_large} shards, warm: 1 worker {t_l1:.2f}s | {args.workers} workers {t_ln:.2f}s"
            "  target < 10 s"
        )
        shutil.rmtree(large)

        # 3. full vs cat > /dev/null of the same bytes, warm
        big = base / "big"
        tokens, hidden = 2048, 1024  # ~16 MiB per shard, the real format's shape at a smaller H
        shard = make_copies(big, 1, tokens, hidden)
        n_big = max(2, args.full_mib * (1 << 20) // shard)
        shutil.rmtree(big)
        shard = make_copies(big, n_big, tokens, hidden)
        total = shard * n_big
        verified(big, "full", args.workers)
        cat_all(big)
        t_cat = timed(lambda: cat_all(big), 3)
        t_f1 = timed(lambda: verify_output(str(big), "full", workers=1), 3)
        t_fn = timed(lambda: verify_output(str(big), "full", workers=args.workers), 3)
        gib = total / (1 << 30)
        print(
            f"3. full over {n_big} x {shard / (1 << 20):.1f} MiB = {gib:.2f} GiB, warm: cat {gib / t_cat:.2f} GiB/s | "
            f"full 1 worker {gib / t_f1:.2f} GiB/s ({t_cat / t_f1:.2f}x) | full {args.workers} workers "
            f"{gib / t_fn:.2f} GiB/s ({t_cat / t_fn:.2f}x)  target >= 0.8x"
        )
        # Cold: evict our own files from the page cache (no global drop_caches) and read from disk.
        t_cat_c = timed(lambda: (evict(big), cat_all(big)))
        t_f_c = timed(lambda: (evict(big), verify_output(str(big), "full", workers=args.workers)))
        print(
            f"3. same, cold (POSIX_FADV_DONTNEED first): cat {gib / t_cat_c:.2f} GiB/s | full {args.workers} workers "
            f"{gib / t_f_c:.2f} GiB/s ({t_cat_c / t_f_c:.2f}x)  target >= 0.8x"
        )
        shutil.rmtree(big)

        # 4. storage overhead
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
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
