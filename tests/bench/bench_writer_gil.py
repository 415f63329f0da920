"""How much shard writing slows a Python-bound forward thread (the GIL), per commit style.

On the GPU, the hf backend's forward is bounded by its own Python (the MoE layers' dispatch);
torch's bindings release the GIL around every op they dispatch, so the forward thread gives the
GIL away thousands of times a batch and must take it back each time. Each system call a writer thread makes
releases the GIL too, and coming back it waits for the forward thread: so the forward slows
with the number of calls the writers make, not with the bytes. This measures that on any
machine, without a GPU: a stand-in forward loop (Python work, then a short GIL-free pause, as an
op's dispatch) runs alone and beside writer threads publishing real shards, side by side in one
process, rounds interleaved:

  per-shard   ShardWriter.publish for each shard (index line + fsync and folder fsync each)
  per-batch   ShardWriter.write for each, one commit() a batch (what the runner does)

    .venv/bin/python tests/bench/bench_writer_gil.py --rounds 7
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from extraction.shards import ShardWriter  # noqa: E402
from hsx.manifest import RunManifest  # noqa: E402


def forward_stand_in(
    batches: int, work_us: int, wait_us: int, steps: int, handed: queue.Queue | None
) -> float:
    """`batches` x `steps` of Python work (GIL held ~work_us) then a GIL-free pause (~wait_us);
    each batch done is handed to the writer (as the runner's forward thread does)."""
    t = time.perf_counter()
    for b in range(batches):
        for _ in range(steps):
            end = time.perf_counter() + work_us / 1e6
            while time.perf_counter() < end:
                pass
            time.sleep(wait_us / 1e6)
        if handed is not None:
            handed.put(b)
    elapsed = time.perf_counter() - t
    if handed is not None:
        handed.put(None)
    return elapsed


def writer_loop(out: Path, style: str, batch: int, threads: int, payload: dict, handed: queue.Queue) -> int:
    """Publish a batch of shards for each batch the forward hands over; returns how many."""
    manifest = RunManifest(
        model="bench", hidden_size=payload["hidden_state"].shape[-1], num_layers=8, layer_ids=[1, 3, 5],
        layer_convention="hf_hidden_states_index", dtype="bfloat16", vocab_size=1024,
    )  # fmt: skip
    w = ShardWriter(out, manifest, check_finite=False)
    n = 0
    with ThreadPoolExecutor(threads) as pool:
        while handed.get() is not None:
            ids = [f"b{n + i}" for i in range(batch)]
            if style == "per-shard":
                list(pool.map(lambda sid: w.publish(sid, **payload), ids))
            else:
                w.commit(list(pool.map(lambda sid: w.write(sid, **payload), ids)))
            n += batch
    w.close()
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", type=int, default=20, help="forward batches a round")
    ap.add_argument("--steps", type=int, default=2500, help="work + GIL-free pause steps a batch")
    ap.add_argument("--work-us", type=int, default=40)
    ap.add_argument("--wait-us", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=330)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16, help="shards a batch")
    ap.add_argument("--threads", type=int, default=2, help="writer threads")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    payload = {
        "input_ids": torch.randint(0, 1000, (args.tokens,), generator=g),
        "loss_mask": torch.ones(args.tokens, dtype=torch.int64),
        "hidden_state": torch.randn(args.tokens, args.hidden, generator=g).bfloat16(),
        "aux_hidden_state": torch.randn(args.tokens, 3 * args.hidden, generator=g).bfloat16(),
    }
    base = Path(tempfile.mkdtemp(prefix="hsx-gil-", dir=args.dir))
    print(
        f"# bench_writer_gil {time.strftime('%Y-%m-%d %H:%M')} cpus={os.cpu_count()} load={os.getloadavg()[0]:.1f} "
        f"shard {args.tokens}x{args.hidden}x4 bf16, {args.batch} a batch, {args.threads} writer threads; forward "
        f"{args.batches} batches x {args.steps} x ({args.work_us} us Python + {args.wait_us} us GIL-free)"
    )
    styles = ["alone", "per-shard", "per-batch"]
    times: dict[str, list[float]] = {s: [] for s in styles}
    try:
        for rnd in range(args.rounds):
            order = styles[rnd % 3 :] + styles[: rnd % 3]
            line = []
            for style in order:
                out = base / f"{style}-{rnd}"
                handed: queue.Queue | None = None if style == "alone" else queue.Queue(maxsize=4)
                result: list[int] = []
                th = None
                if handed is not None:
                    th = threading.Thread(
                        target=lambda o=out, s=style, h=handed, r=result: r.append(
                            writer_loop(o, s, args.batch, args.threads, payload, h)
                        )
                    )
                    th.start()
                t = forward_stand_in(args.batches, args.work_us, args.wait_us, args.steps, handed)
                if th is not None:
                    th.join()  # the last batch is written outside the timed forward, as in a drain
                times[style].append(t)
                shutil.rmtree(out, ignore_errors=True)
                line.append(f"{style} {t:.3f}s")
            print(f"round {rnd}: " + "  ".join(line), flush=True)
        alone = times["alone"]
        for style in styles[1:]:
            ratios = [a / b for a, b in zip(alone, times[style], strict=True)]
            print(
                f"forward alone / beside {style} writers: per round "
                + ", ".join(f"{r:.3f}" for r in ratios)
                + f"; median {statistics.median(ratios):.3f}x"
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
