"""Where the runner's CPU forward loses time against a bare forward loop: per batch, not per run.

Sides, interleaved in each round, over the runner's own batch plan (tiny model, CPU):
  A   forward-only: `HFBackend.forward_states` per batch, the outputs dropped at once
  K   the same, keeping the last 5 batches' outputs alive (what the runner's queues hold)
  KC  K plus a thread copying each output into a NumPy ring (the courier's work on a CPU until
      the forward wrote its states into the writer's buffer itself)
  B   the runner (`hsx extract` in-process, writer process): each `Forward.forward` call timed
For each: the time a round, the per-batch p5/p50/p95, and the process's minor page faults a round.

  python tests/bench/bench_forward_probe.py --rounds 8
"""

from __future__ import annotations

import argparse
import collections
import os
import queue
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runner_sides  # noqa: E402

from extraction.runner import iter_batches_for_bench  # noqa: E402
from extraction.runner.forward import Forward  # noqa: E402


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class Probe:
    def __init__(self, args: argparse.Namespace, work: Path):
        setup = runner_sides.bench_setup(work, args)
        self.backend, self.cfg_kw = setup.backend, setup.cfg_kw
        self.batches = list(iter_batches_for_bench(setup.cfg, setup.entries, setup.tokenizer))
        self.threads = args.threads
        self.work = work
        self.ring = np.empty(64 << 20, dtype=np.uint8)
        self._runner_batches: list[float] = []
        forward = Forward.forward
        probe = self

        def timed_forward(stage, batch):
            t = time.perf_counter()
            try:
                return forward(stage, batch)
            finally:
                probe._runner_batches.append(time.perf_counter() - t)

        Forward.forward = timed_forward

    def forward(self, side: str) -> tuple[list[float], int]:
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        kept: collections.deque = collections.deque(maxlen=5)
        copies: queue.Queue = queue.Queue(4)
        copier = None
        if side == "KC":
            copier = threading.Thread(target=self._copy, args=(copies,), daemon=True)
            copier.start()
        times: list[float] = []
        f0 = minor_faults()
        for b in self.batches:
            t = time.perf_counter()
            out = self.backend.forward_states(b)
            times.append(time.perf_counter() - t)
            if side in ("K", "KC"):
                kept.append(out)
            if copier is not None:
                copies.put(out)
            del out
        if copier is not None:
            copies.put(None)
            copier.join()
        faults = minor_faults() - f0
        torch.set_num_threads(before)
        return times, faults

    def _copy(self, copies: queue.Queue) -> None:
        at = 0
        while (out := copies.get()) is not None:
            for t in out[:2]:
                a = t.numpy().reshape(-1).view(np.uint8)
                if at + a.size > self.ring.size:
                    at = 0
                self.ring[at : at + a.size] = a
                at += a.size

    def runner(self) -> tuple[list[float], int]:
        self._runner_batches.clear()
        f0 = minor_faults()
        runner_sides.runner_run(self.cfg_kw, self.work / "run")
        shutil.rmtree(self.work / "run")
        return list(self._runner_batches), minor_faults() - f0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    runner_sides.add_setup_arguments(ap, samples=384)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument(
        "--threads", type=int, default=13, help="torch threads of the bare loops (the runner picks its own)"
    )
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hsx-probe-"))
    try:
        p = Probe(args, work)
        sides = {
            "A": lambda: p.forward("A"),
            "K": lambda: p.forward("K"),
            "KC": lambda: p.forward("KC"),
            "B": p.runner,
        }
        for run in (sides["A"], sides["B"], sides["A"]):  # warm-up (the runner sets its malloc thresholds)
            run()
        times: dict[str, list[float]] = {k: [] for k in sides}
        faults: dict[str, list[int]] = {k: [] for k in sides}
        for _ in range(args.rounds):
            for k, run in sides.items():
                t, f = run()
                times[k] += t
                faults[k].append(f)
        print(
            f"{args.samples} samples, {len(p.batches)} batches, {args.rounds} rounds; bare loops on {args.threads} threads"
        )
        for k, v in times.items():
            q = statistics.quantiles(v, n=20)
            print(
                f"{k:>2}: {sum(v) / args.rounds:.3f} s a round; per batch p5 {q[0] * 1e3:.1f}, p50 {q[9] * 1e3:.1f}, "
                f"p95 {q[18] * 1e3:.1f} ms; minor faults a round {statistics.median(faults[k]):.0f}"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
