"""Runner overhead, side by side in one process (the machine is shared and noisy).

  A  forward only: the hf backend's forward pass over the runner's own batch plan (pre-tokenized,
     untimed), states left on the device, one synchronize at the end. No host copy, no disk.
  A2 forward + host copy: `HFBackend.extract` (the same, plus a blocking copy of each batch's
     states to the host and a per-sample copy): the baseline earlier figures used.
  B  the runner: `hsx extract` in-process, loading the model itself as the CLI does. Timed from the
     moment its model is loaded on the device to the moment its last shard is fsynced and indexed
     (tokenizing, queueing, forward, copy to host, checks, torch.save, fsync, rename, index, status).
     Its start-up (dataset scan, tokenizer, run.json, resume scan) and the model load are reported
     apart: A excludes both as well (A gets its batches tokenized for free).
  C  the peers' loop: forward, then torch.save each sample synchronously (no fsync, no index).
  R  resume start-up over --resume-shards existing shards (dataset scan + index + quick each)

Rounds interleave A/A2/B/C in a rotating order; best and median of each are reported, with the
ratios A/B (the target), A2/B and C/B, and the load average.

  python tests/bench/bench_runner.py                          # CPU, tiny model
  python tests/bench/bench_runner.py --tokenizer thread,process --sides A,B   # both tokenizers, interleaved
  python tests/bench/bench_runner.py --samples 1536 --dtype fp32 --sides A,B --marginal   # the steady state:
      # each side also over the first quarter; the ratio of the differences leaves out what a run pays
      # once (the first window's tokenizing, the working set's first page faults, the drain)
  python tests/bench/bench_runner.py --device cuda --dtype bf16 --hidden 2048 --layers 16 \\
      --capture auto --samples 1024 --batch-size 16 --max-length 1024   # GPU, ~1.2B params
"""

from __future__ import annotations

import argparse
import itertools
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
from runner_sides import (  # noqa: E402  (this folder: on sys.path when run as a script)
    ForwardProbe,
    bench_setup,
    disk_info,
    forward_copy,
    forward_only,
    null_writer,
    resume_startup,
    runner_run,
    sync_save_loop,
)

from extraction.backends.hf import torch_dtype  # noqa: E402
from extraction.process import heap  # noqa: E402
from extraction.runner import iter_batches_for_bench  # noqa: E402
from extraction.runner import plan as plan_mod  # noqa: E402
from extraction.runner.timing import thread_usage  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument(
        "--capture", default="1,3,4", help="capture layers (default suits 6 layers; 'auto' for >= 7)"
    )
    ap.add_argument("--samples", type=int, default=160)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--resume-shards", type=int, default=37312, help="0 to skip the resume start-up test")
    ap.add_argument("--workdir", default=None, help="where to write (default: a temp dir, removed)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument(
        "--writer-threads", default="0", help="runner writer threads, comma list of variants (0: auto)"
    )
    ap.add_argument(
        "--switch-interval",
        default="",
        help="comma list of Python GIL switch intervals (s) for the runner variants (0: Python's)",
    )
    ap.add_argument(
        "--null-writer",
        action="store_true",
        help="also time each runner variant with a writer that writes nothing",
    )
    ap.add_argument(
        "--cpu-threads",
        default="0",
        help="the runner's --cpu-threads, comma list of variants (0: its default)",
    )
    ap.add_argument(
        "--tokenizer",
        default="",
        help="tokenizer variants of the runner, comma list of process (a forked tokenizer process), "
        "thread (Runner(tokenizer_process=False)); default: the runner's (process)",
    )
    ap.add_argument(
        "--writer",
        default="",
        help="writer variants of the runner, comma list of --publisher values (process, thread, auto); "
        "default: the runner's (auto: process for this hf backend)",
    )
    ap.add_argument(
        "--env",
        default="",
        help="NAME=v1,v2: variants of the runner with each value of an environment variable "
        "(e.g. HSX_MALLOC_TRIM=0,1)",
    )
    ap.add_argument(
        "--model",
        default="own",
        help="comma list: own (the runner loads its model, as the CLI does), kept (the bench's "
        "loaded model, warm like forward-only's)",
    )
    ap.add_argument(
        "--marginal",
        action="store_true",
        help="also time forward-only and each runner variant over the first quarter of the samples "
        "(whole planning windows) and report the ratio of the differences: the steady state, "
        "without what a run pays once (the first window's tokenizing, the working set's first faults, "
        "the drain)",
    )
    ap.add_argument(
        "--probe",
        action="store_true",
        help="also report the time inside each side's forward passes (HFBackend.forward_states)",
    )
    ap.add_argument(
        "--sides", default="A,A2,B,C", help="which sides to time, e.g. A,B (B: the runner variants)"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="hsx-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        setup = bench_setup(work, args)
        model_dir, backend, cfg_kw, cfg = setup.model_dir, setup.backend, setup.cfg_kw, setup.cfg
        params = sum(p.numel() for p in backend.model.parameters())
        entries, tok = setup.entries, setup.tokenizer
        batches = list(iter_batches_for_bench(cfg, entries, tok))
        window = args.batch_size * plan_mod.WINDOW_BATCHES
        part = max(window, args.samples // 4 // window * window)  # whole windows: the same batches
        part_batches = list(iter_batches_for_bench(cfg, entries[:part], tok)) if args.marginal else []
        tokens = sum(int(s.input_ids.numel()) for b in batches for s in b)
        print(
            f"model: hidden {args.hidden}, {args.layers} layers, {params / 1e6:.1f}M params, {args.dtype} on {args.device}, "
            f"torch threads {torch.get_num_threads()}"
        )
        print(
            f"work: {args.samples} samples, {tokens} tokens, {len(batches)} batches of <= {args.batch_size}"
        )
        print(f"disk under {work}: {disk_info(work)}; load average {os.getloadavg()[0]:.1f}")
        try:  # the code under test may predate torchzip (an older checkout on PYTHONPATH)
            from extraction.shards import torchzip

            layout, how = torchzip.layout_for(torch_dtype(args.dtype))
            print(f"shard writer: {'direct layout' if layout else 'torch.save'}: {how}")
        except ImportError:
            print("shard writer: torch.save (this code has no torchzip)")
        forward_only(backend, batches[:2], args.device)  # warm-up
        forward_copy(backend, batches[:2], args.device)
        # On a CPU the runner keeps what malloc frees (extraction/process/heap.py), for its whole process,
        # this one included: forward-only under glibc's own thresholds first, for the record.
        untuned = (
            [forward_only(backend, batches, args.device) for _ in range(2)] if args.device == "cpu" else []
        )
        # Warm the runner path too (pinned host memory, page cache, the writer pool): a quarter run.
        runner_run(cfg_kw, work / "warm", limit=max(2 * args.batch_size, args.samples // 4))
        shutil.rmtree(work / "warm")
        if untuned:
            tuned = [forward_only(backend, batches, args.device) for _ in range(2)]
            print(
                f"forward-only under glibc's default malloc {min(untuned):.2f}s (best of 2); after the "
                f"runner kept freed memory (extraction/process/heap.py: {heap.keep_freed_memory()}) "
                f"{min(tuned):.2f}s: every side below runs with the runner's setting"
            )
        env_name, _, env_values = args.env.partition("=")
        # Each runner variant is one value of every dimension; a dimension given one value (or
        # none: the default) adds nothing to the side's name.
        dims = {
            "writer_threads": [int(w) for w in args.writer_threads.split(",")],
            "tokenizer": [m for m in args.tokenizer.split(",") if m] or [None],
            "switch": [float(x) for x in args.switch_interval.split(",")] if args.switch_interval else [0.0],
            "null": [False, True] if args.null_writer else [False],
            "writer": [x for x in args.writer.split(",") if x] or [None],
            "model": args.model.split(","),
            "env": [x for x in env_values.split(",") if x] or [None],
            "cpu_threads": [int(x) for x in args.cpu_threads.split(",")],
        }
        names = {  # dimension -> (key suffix, label) of a value
            "writer_threads": lambda w: (f"{w}", f"{w}w"),
            "tokenizer": lambda m: (f"-{m}", f" {m}") if m else ("", ""),
            "switch": lambda si: (f"-si{si:g}", f" switch {si * 1e3:g}ms") if si else ("", ""),
            "null": lambda null: ("-null", " null writer") if null else ("", ""),
            "writer": lambda wm: (f"-w{wm}", f" writer-{wm}") if wm else ("", ""),
            "model": lambda mo: ("-kept", " kept model") if mo == "kept" else ("", ""),
            "env": lambda pin: (f"-env{pin}", f" {env_name}={pin}") if pin else ("", ""),
            "cpu_threads": lambda t: (f"-t{t}", f" {t} forward threads") if t else ("", ""),
        }
        variants: dict[str, dict] = {}
        label: dict[str, str] = {}
        for values in itertools.product(*dims.values()):
            v = dict(zip(dims, values, strict=True))
            named = [names[d](x) for d, x in v.items()]
            key = "B" + "".join(k for k, _ in named)
            variants[key], label[key] = v, "".join(lab for _, lab in named)
        bkeys = list(variants)
        default_switch = sys.getswitchinterval()
        probe = ForwardProbe() if args.probe else None
        if probe:
            probe.install()
        sides: dict[str, list[float]] = {k: [] for k in ["A", "A2", *bkeys, "C"]}
        skip = {"A2", "C"} - set(args.sides.split(","))  # not timed: reported as nan
        walls: dict[str, list[float]] = {k: [] for k in bkeys}
        parts: dict[str, list[float]] = {k: [] for k in ["A", *bkeys]}  # --marginal: the first `part` samples
        cpu: dict[str, list[float]] = {k: [] for k in sides}  # process CPU seconds, all threads
        order = list(sides)
        for rnd in range(args.rounds):
            load = os.getloadavg()[0]
            got: dict[str, float] = {}
            line = []
            for side in order[rnd % len(order) :] + order[: rnd % len(order)]:
                c0 = time.process_time()
                if side in skip:
                    got[side] = float("nan")
                    cpu[side].append(float("nan"))
                    continue
                if probe:
                    probe.take()  # what came between the sides: not this side's
                if side == "A":
                    u0 = thread_usage()
                    got[side] = forward_only(backend, batches, args.device)
                    u1 = thread_usage()
                    line.append(
                        f"  forward-only's thread: cpu {u1[0] - u0[0]:.2f}s, context switches "
                        f"{u1[1] - u0[1]} voluntary, {u1[2] - u0[2]} involuntary"
                    )
                    if probe:
                        line.append(f"  forward-only {probe.take()}")
                    if args.marginal:
                        parts["A"].append(forward_only(backend, part_batches, args.device))
                        if probe:
                            probe.take()
                elif side == "A2":
                    got[side] = forward_copy(backend, batches, args.device)
                elif side == "C":
                    got[side] = sync_save_loop(backend, batches, work / f"sync{rnd}", args.device)
                    shutil.rmtree(work / f"sync{rnd}")
                if not side.startswith("B"):
                    cpu[side].append(time.process_time() - c0)
                else:
                    var = variants[side]
                    if var["env"]:
                        os.environ[env_name] = var["env"]
                    run_kw = dict(cfg_kw, cpu_threads=var["cpu_threads"]) if var["cpu_threads"] else cfg_kw
                    if var["writer"]:
                        run_kw = dict(run_kw, publisher=var["writer"])
                    variant = dict(
                        writer_threads=var["writer_threads"], tokenizer_process=var["tokenizer"] != "thread"
                    )
                    kept = backend if var["model"] == "kept" else None
                    sys.setswitchinterval(var["switch"] or default_switch)
                    try:
                        with null_writer(var["null"]):
                            got[side], wall, tm = runner_run(run_kw, work / f"run{rnd}", kept, **variant)
                    finally:
                        sys.setswitchinterval(default_switch)
                    walls[side].append(wall)
                    if probe:
                        line.append(f"  runner, {label[side]}: {probe.take()}")
                    if args.marginal:
                        with null_writer(var["null"]):
                            t_part = runner_run(run_kw, work / f"part{rnd}", kept, limit=part, **variant)[0]
                        parts[side].append(t_part)
                        shutil.rmtree(work / f"part{rnd}")
                        if probe:
                            probe.take()  # the part's: not reported
                    cpu[side].append(tm["pipeline_end_cpu_at"] - tm["ready_cpu_at"])
                    shutil.rmtree(work / f"run{rnd}")
                    line.append(
                        f"  runner, {label[side]}: {got[side]:.2f}s; whole run() {wall:.2f}s; "
                        + ", ".join(f"{k} {v:.2f}" for k, v in tm.items() if k.endswith("_s"))
                        + (f", forward threads {tm['forward_threads']}" if "forward_threads" in tm else "")
                        + f", minor faults {tm['pipeline_end_faults_at'] - tm['ready_faults_at']:.0f}"
                        + "".join(f", {k} {v}" for k, v in tm.items() if k.endswith("csw"))
                    )
            for k, v in got.items():
                sides[k].append(v)
            print(
                f"round {rnd} (load {load:.1f}): forward-only {got['A']:.2f}s  forward+copy {got['A2']:.2f}s  "
                + "  ".join(f"runner/{label[k]} {got[k]:.2f}s" for k in bkeys)
                + f"  sync-save loop {got['C']:.2f}s"
            )
            print("\n".join(line))
            print(
                "  CPU seconds (process, all threads): "
                + ", ".join(f"{k} {v[-1]:.2f}" for k, v in cpu.items())
            )
        for name, agg in (("best", min), ("median", statistics.median)):
            d = {k: agg(v) for k, v in sides.items()}
            print(
                f"{name}: forward-only {d['A']:.2f}s, forward+copy {d['A2']:.2f}s, sync-save {d['C']:.2f}s, "
                + ", ".join(
                    f"runner/{label[k]} {d[k]:.2f}s (whole run() {agg(walls[k]):.2f}s)" for k in bkeys
                )
            )
            for k in bkeys:
                print(
                    f"  runner/{label[k]} vs forward-only {d['A'] / d[k]:.3f}x (target >= 0.95x), "
                    f"vs forward+copy {d['A2'] / d[k]:.3f}x, vs sync forward-then-torch.save {d['C'] / d[k]:.3f}x"
                )
        for k in bkeys:
            per_round = [a / b for a, b in zip(sides["A"], sides[k], strict=True)]
            print(
                f"runner/{label[k]} vs forward-only, per round: "
                + ", ".join(f"{x:.3f}" for x in per_round)
                + f"; median {statistics.median(per_round):.3f}x; CPU-time ratio (median) "
                f"{statistics.median(cpu['A']) / statistics.median(cpu[k]):.3f}x"
            )
        if args.marginal:
            extra = [a - p for a, p in zip(sides["A"], parts["A"], strict=True)]
            print(
                f"marginal ({args.samples} - {part} samples): forward-only "
                + ", ".join(f"{x:.2f}" for x in extra)
                + "s"
            )
            for k in bkeys:
                mine = [b - p for b, p in zip(sides[k], parts[k], strict=True)]
                per_round = [a / b for a, b in zip(extra, mine, strict=True)]
                print(
                    f"runner/{label[k]} marginal vs forward-only, per round: "
                    + ", ".join(f"{x:.3f}" for x in per_round)
                    + f"; median {statistics.median(per_round):.3f}x; ratio of median differences "
                    f"{statistics.median(extra) / statistics.median(mine):.3f}x (runner at {part} samples: "
                    f"{statistics.median(parts[k]):.2f}s, forward-only {statistics.median(parts['A']):.2f}s)"
                )
        b = min(min(sides[k]) for k in bkeys)
        print(f"runner samples/s {args.samples / b:.1f}, tokens/s {tokens / b:.0f} (best round)")
        if args.resume_shards:
            res = resume_startup(model_dir, work, args.resume_shards, args.capture)
            print(
                f"resume start-up over {res['shards']} shards: prepare {res['prepare_s']}s "
                f"(quick checks {res['quick_s']}s; target < 15 s); building them took {res['build_s']}s"
            )
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
