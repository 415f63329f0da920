"""What interrupts the CPU forward pass: forward-only against the runner, inside the forward calls.

The runner's forward thread needs 5-10% more CPU seconds than a bare forward loop for the same
batches without waiting for anything (docs/benchmarks.md, sessions 12-13). This counts, for each
side, the host's interrupts (every /proc/interrupts row, summed over the CPUs) only while
`HFBackend.forward_states` runs, so that the helpers' start and end are left out. With --trace
(root; tracefs, mounted if need be) it also records the inter-processor interrupts sent while the
runner's forward calls run, and prints who sent them (this process or another: the helper
processes, kernel threads, an idle CPU handling a disk completion) and the kernel stack that sent
them: a TLB shootdown from a copy-on-write fault (`do_wp_page`), from an munmap, a futex wake.
With --trace switches it records the scheduler's switches and wake-ups instead, and prints how
often this process's threads (the forward thread, its OpenMP workers) lost their CPU while runnable
inside the forward calls, to whom (a helper process, this process's own threads, a kernel thread),
and who woke that one (a thread, or an interrupt on that CPU).

  python tests/bench/probe_interrupts.py --samples 1536 --rounds 3 [--trace [ipi|switches]]

A diagnostic, not a benchmark: reading /proc/interrupts twice a call costs each side the same
~0.1-0.3 ms a batch.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runner_sides  # noqa: E402

from extraction.backends.hf import HFBackend  # noqa: E402
from extraction.process import heap  # noqa: E402
from extraction.runner import iter_batches_for_bench  # noqa: E402

TRACEFS = Path("/sys/kernel/tracing")
_IPI_EVENTS = ("ipi/ipi_send_cpu", "ipi/ipi_send_cpumask")
_SWITCH_EVENTS = ("sched/sched_switch", "sched/sched_wakeup")
# "comm-tid (tgid) [cpu] flags timestamp: event: body", as record-tgid writes it
_LINE = re.compile(
    r"^\s*(?P<comm>.+?)-(?P<tid>\d+)\s+\(\s*(?P<tgid>[\d-]+)\)\s+\[\d+\]\s+(?P<flags>\S+)\s+[\d.]+:\s+"
    r"(?P<event>\w+):\s+(?P<body>.*)$"
)
_FIELD = re.compile(r"(\w+)=(\S+)")


class Tracer:
    """Kernel events recorded only between on() and off(): the ipi_send events with their stacks
    (kind "ipi"), or the scheduler's switches and wake-ups with each task's process (kind
    "switches")."""

    def __init__(self, kind: str = "ipi") -> None:
        if not (TRACEFS / "events/ipi").is_dir():
            subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)], check=True)
        self.kind = kind
        self._events = _IPI_EVENTS if kind == "ipi" else _SWITCH_EVENTS
        self._option = "options/stacktrace" if kind == "ipi" else "options/record-tgid"
        self._set("tracing_on", "0")
        self._set("buffer_size_kb", "40000")
        for event in self._events:
            self._set(f"events/{event}/enable", "1")
        self._set(self._option, "1")
        self._switch = os.open(TRACEFS / "tracing_on", os.O_WRONLY)

    def _set(self, name: str, value: str) -> None:
        (TRACEFS / name).write_text(value)

    def clear(self) -> None:
        self._set("trace", "")

    def on(self) -> None:
        os.write(self._switch, b"1")

    def off(self) -> None:
        os.write(self._switch, b"0")

    def close(self) -> None:
        self.off()
        os.close(self._switch)
        self._set(self._option, "0")
        for event in self._events:
            self._set(f"events/{event}/enable", "0")

    def senders(self, tasks: set[int], frames: int = 7) -> collections.Counter:
        """(sender, call site; kernel stack) -> IPIs, from the trace: the sender is "this
        process" when it is one of `tasks`, else its command name."""
        counts: collections.Counter = collections.Counter()
        key, depth = None, 0
        for line in (TRACEFS / "trace").read_text().splitlines():
            if line.startswith("#"):
                continue
            if ": ipi_send" in line:
                if key:
                    counts[key] += 1
                comm, _, tid = line.split()[0].rpartition("-")
                who = "this process" if tid.isdigit() and int(tid) in tasks else comm
                key, depth = f"{who} {line.split('callsite=')[1].split()[0]}", 0
            elif "=>" in line and key:
                depth += 1
                if 3 <= depth < 3 + frames:  # past the tracing frames
                    key += ";" + line.split("=>")[1].strip()
        if key:
            counts[key] += 1
        return counts

    def preemptions(self, me: int, forward_tid: int | None, children: dict[int, str]) -> Preemptions:
        return preemptions((TRACEFS / "trace").read_text().splitlines(), me, forward_tid, children)


class Preemptions:
    """This process's threads switched out while runnable, by victim and by who ran instead
    (with who had woken that one)."""

    def __init__(self) -> None:
        self.victims: collections.Counter = collections.Counter()
        self.instead: collections.Counter = collections.Counter()
        self.woken_by: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


def preemptions(lines: list[str], me: int, forward_tid: int | None, children: dict[int, str]) -> Preemptions:
    """Read a record-tgid trace of sched_switch and sched_wakeup events. A switch away from a
    thread of process `me` whose state is R (runnable: preempted, not sleeping) counts against
    the thread that ran instead, named by its process: this one, a child (`children`: pid ->
    name), a kernel thread, another process. Its waker is the task current on the CPU that woke
    it, or "an interrupt" where the wake-up ran in interrupt context (flags h/s)."""
    tgid_of: dict[int, int] = {}
    switches: list[tuple[int, int, str]] = []  # (victim tid, next tid, next comm)
    waker_of: dict[int, tuple[int, str]] = {}
    waker_at_switch: list[tuple[int, str] | None] = []
    for line in lines:
        m = _LINE.match(line)
        if not m:
            continue
        tid, tgid = int(m["tid"]), m["tgid"]
        if tgid.isdigit():
            tgid_of[tid] = int(tgid)
        body = dict(_FIELD.findall(m["body"]))
        if m["event"] == "sched_wakeup" and "pid" in body:
            irq = any(c in m["flags"] for c in "hsH")
            waker_of[int(body["pid"])] = (-1, "an interrupt") if irq else (tid, m["comm"])
        elif m["event"] == "sched_switch" and tgid == str(me) and body.get("prev_state", "").startswith("R"):
            nxt = int(body["next_pid"])
            switches.append((tid, nxt, body.get("next_comm", "?")))
            waker_at_switch.append(waker_of.get(nxt))

    def name(tid: int, comm: str) -> str:
        tgid = tgid_of.get(tid)
        if tgid == me:
            return "this process's other threads"
        if tgid in children:
            return f"{children[tgid]} (pid {tgid})"
        if tid == -1:
            return comm
        if tgid == tid and re.match(
            r"(kworker|ksoftirqd|rcu_|migration|kcompactd|kswapd|jbd2|kthreadd)", comm
        ):
            return re.sub(r"[/:].*", "", comm) + " (kernel thread)"
        return f"other: {comm}"

    out = Preemptions()
    for (victim, nxt, comm), waker in zip(switches, waker_at_switch, strict=True):
        out.victims["forward thread" if victim == forward_tid else "its other threads"] += 1
        who = name(nxt, comm)
        out.instead[who] += 1
        out.woken_by[who][name(*waker) if waker else "(woken before the trace)"] += 1
    return out


def child_processes() -> dict[int, str]:
    """This process's children, pid -> their command name (the writer process, the tokenizer)."""
    kids: dict[int, str] = {}
    for task in os.listdir("/proc/self/task"):
        try:
            pids = Path(f"/proc/self/task/{task}/children").read_text().split()
        except OSError:
            continue
        for pid in pids:
            try:
                kids[int(pid)] = "helper " + Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                kids[int(pid)] = "helper process"
    return kids


class InsideForward:
    """Sums every /proc/interrupts row over the calls of HFBackend.forward_states; turns the
    tracer on for the calls while `tracing` is set; notes this process's threads."""

    def __init__(self, tracer: Tracer | None):
        self.counts: collections.Counter = collections.Counter()
        self.tracer, self.tracing = tracer, False
        self.tasks: set[int] = set()
        self.calls, self.trace_from = 0, 0  # trace only from this call of the round on
        self.forward_tid: int | None = None
        self.children: dict[int, str] = {}
        inner, probe = HFBackend.forward_states, self

        def forward_states(backend, samples, **kw):
            probe.calls += 1
            traced = probe.tracing and probe.tracer is not None and probe.calls > probe.trace_from
            if traced:
                probe.tasks.update(int(t) for t in os.listdir("/proc/self/task"))
                if probe.forward_tid is None:
                    probe.forward_tid = threading.get_native_id()
                    probe.children = child_processes()
                probe.tracer.on()
            before = runner_sides.interrupt_counts(None)
            try:
                return inner(backend, samples, **kw)
            finally:
                after = runner_sides.interrupt_counts(None)
                if traced:
                    probe.tracer.off()
                for name, n in after.items():
                    probe.counts[name] += n - before.get(name, 0)

        HFBackend.forward_states = forward_states

    def take(self) -> str:
        line = ", ".join(f"{k} {v}" for k, v in self.counts.most_common() if v)
        self.counts.clear()
        self.calls = 0
        return line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    runner_sides.add_setup_arguments(ap, samples=1536)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--trace",
        nargs="?",
        const="ipi",
        choices=("ipi", "switches"),
        help="in the last round (root): record the IPIs' senders (ipi, the default), or who takes "
        "the CPU from this process's threads inside the forward calls (switches)",
    )
    ap.add_argument("--top", type=int, default=14, help="senders to print")
    ap.add_argument(
        "--trace-after",
        type=float,
        default=0.0,
        help="trace only the calls after this fraction of the round's batches (0.5: the steady "
        "state, past the run's first copy-on-write faults and first touches)",
    )
    args = ap.parse_args()
    tracer = Tracer(args.trace) if args.trace else None
    probe = InsideForward(tracer)
    work = Path(tempfile.mkdtemp(prefix="hsx-irq-"))
    try:
        setup = runner_sides.bench_setup(work, args)
        batches = list(iter_batches_for_bench(setup.cfg, setup.entries, setup.tokenizer))
        heap.keep_freed_memory()  # as in the runner's process
        runner_sides.forward_only(setup.backend, batches, "cpu")  # warm
        probe.take()
        probe.trace_from = int(args.trace_after * len(batches))
        print(
            f"{args.samples} samples, {len(batches)} batches, {os.cpu_count()} CPUs, {time.strftime('%F %T')}"
        )
        for rnd in range(args.rounds):
            t = runner_sides.forward_only(setup.backend, batches, "cpu")
            print(f"round {rnd} forward-only {t:.2f}s; inside its forward calls: {probe.take()}")
            last = rnd == args.rounds - 1 and tracer is not None
            if last:
                tracer.clear()
            probe.tracing = last
            t = runner_sides.runner_run(setup.cfg_kw, work / f"run{rnd}")[0]
            probe.tracing = False
            shutil.rmtree(work / f"run{rnd}")
            print(f"round {rnd} runner {t:.2f}s; inside its forward calls: {probe.take()}", flush=True)
        if tracer is not None and tracer.kind == "switches":
            found = tracer.preemptions(os.getpid(), probe.forward_tid, probe.children)
            print(
                "preempted (switched out while runnable) while the runner's forward calls ran (last round): "
                + ", ".join(f"{k} {v}" for k, v in found.victims.most_common())
            )
            for who, n in found.instead.most_common(args.top):
                wakers = ", ".join(f"{k} {v}" for k, v in found.woken_by[who].most_common(3))
                print(f"  {n:6d} ran instead: {who}; woken by: {wakers}")
        elif tracer is not None:
            senders = tracer.senders(probe.tasks)
            print(f"IPIs sent while the runner's forward calls ran (last round): {sum(senders.values())}")
            for key, n in senders.most_common(args.top):
                print(f"  {n:6d} {key[:300]}")
    finally:
        if tracer is not None:
            tracer.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
