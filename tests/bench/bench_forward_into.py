"""What writing the states into the writer's shared buffer costs a CPU forward pass.

The runner's CPU forward writes each batch's states into the writer process's shared buffer
(`HFBackend.forward_states(into=...)`: the aux concatenation lands in a block of the ring, the
final state is copied beside it); a bare forward loop leaves them in torch's own memory, which
malloc hands back hot for the next batch. Sides, interleaved in each round in alternating order,
over the runner's own batch plan (tiny model), with nothing else running:
  plain  forward_states per batch, the outputs dropped
  into   the same, each batch's states written into a ring of WRITER_BUFFER_BATCHES blocks of an
         Arena (the runner's buffer), the oldest block freed as the ring turns

  python tests/bench/bench_forward_into.py --samples 1536 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runner_sides  # noqa: E402

from extraction.process import heap  # noqa: E402
from extraction.publish.writerproc import Arena, ArenaFull  # noqa: E402
from extraction.runner import iter_batches_for_bench  # noqa: E402
from extraction.runner.publish_process import WRITER_BUFFER_BATCHES, writer_buffer_bytes  # noqa: E402


class Ring:
    """Blocks of an Arena taken in turn, the oldest freed once WRITER_BUFFER_BATCHES are held
    (or when the next does not fit)."""

    def __init__(self, arena: Arena):
        self.arena, self.held = arena, []

    def __call__(self, specs):
        if len(self.held) >= WRITER_BUFFER_BATCHES:
            self.arena.free(self.held.pop(0))
        while True:
            try:
                tensors, block = self.arena.empty(specs)
            except ArenaFull:  # the ring's end wasted on a wrap: as the runner would, wait for the oldest
                self.arena.free(self.held.pop(0))
                continue
            self.held.append(block)
            return tensors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    runner_sides.add_setup_arguments(ap, samples=768)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="hsx-into-"))
    try:
        setup = runner_sides.bench_setup(work, args)
        batches = list(iter_batches_for_bench(setup.cfg, setup.entries, setup.tokenizer))
        heap.keep_freed_memory()  # as in the runner's process
        token_bytes = (1 + len(args.capture.split(","))) * args.hidden * 4
        size = writer_buffer_bytes(args.batch_size, args.max_length, token_bytes)
        ring = Ring(Arena(size))
        backend = setup.backend

        def side(into) -> float:
            t = time.perf_counter()
            for b in batches:
                backend.forward_states(b, into=into)
            return time.perf_counter() - t

        side(None), side(ring)  # warm-up: the ring's pages faulted in once
        times: dict[str, list[float]] = {"plain": [], "into": []}
        for rnd in range(args.rounds):
            order = [("plain", None), ("into", ring)]
            for name, into in order if rnd % 2 == 0 else order[::-1]:
                times[name].append(side(into))
        print(
            f"{args.samples} samples, {len(batches)} batches, torch threads {torch.get_num_threads()}, "
            f"buffer {size / 2**20:.1f} MiB"
        )
        for name, v in times.items():
            print(
                f"{name:>5}: " + ", ".join(f"{x:.2f}" for x in v) + f" s; median {statistics.median(v):.2f} s"
            )
        ratios = [p / i for p, i in zip(times["plain"], times["into"], strict=True)]
        print(
            "plain / into per round: "
            + ", ".join(f"{x:.3f}" for x in ratios)
            + f"; median {statistics.median(ratios):.3f}x"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
