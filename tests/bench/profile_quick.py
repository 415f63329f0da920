"""Where a first `quick` verification spends its time, phase by phase (a profile, not a target).

Builds bench_verify's run of N small shards, then verifies it in fresh torch-free processes (as
`hsx verify` runs: every process verifies once, no layout known), each with its phases timed by
wrappers around the verifier's own functions (hsx.verify); the forked workers' shares are timed
inside the children (CLOCK_MONOTONIC, comparable across processes). Prints the median of each
phase in ms.

    python tests/bench/profile_quick.py --workers 1,2,8 --runs 7
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_PROFILED = r"""
import json, os, sys, time
root, workers, log, layout = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
t = {}

def timed(name, fn):
    def wrapper(*a, **k):
        s = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            t[name] = t.get(name, 0.0) + (time.perf_counter() - s) * 1e3
    return wrapper

# A worker's share (older code: _check_share) or its whole take of chunks (Chunks.check), timed
# inside whichever process runs it and appended to the log.
def timed_check(fn):
    def wrapper(*a):
        s = time.perf_counter()
        out = fn(*a)
        e = time.perf_counter()
        line = json.dumps({"pid": os.getpid(), "start": s, "end": e}) + "\n"
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(fd, line.encode())
        os.close(fd)
        return out
    return wrapper

if layout == "hsx":  # the core package: each phase wrapped where verify_output's modules call it
    from hsx.verify import output, quick, quick_split, quick_worker
    verify_output = output.verify_output
    for mod, name in ((output, "read_index_lines"), (quick, "index_rows"), (quick, "list_buckets"),
                      (quick_split, "split_by_size"), (quick_split, "fork_map"), (quick, "merge_quick"),
                      (quick, "reap"), (output, "finish"), (output, "read_manifest_dict")):
        setattr(mod, name, timed(name, getattr(mod, name)))
    quick_worker.QuickWorker.list = timed("list", quick_worker.QuickWorker.list)
    quick_split.Chunks.check = timed_check(quick_split.Chunks.check)
else:  # an older checkout: one format module (extraction/shards/format.py)
    from extraction.shards import format as fmt
    verify_output = fmt.verify_output
    for name in ("_read_index_lines", "_index_rows", "_scan_top", "_split_by_size", "_fork_map",
                 "_merge_quick", "_reap", "_finish", "read_manifest_dict"):
        setattr(fmt, name, timed(name, getattr(fmt, name)))
    fmt._QuickWorker.list = timed("list", fmt._QuickWorker.list)
    if hasattr(fmt, "_Chunks"):
        fmt._Chunks.check = timed_check(fmt._Chunks.check)
    else:
        fmt._check_share = timed_check(fmt._check_share)
assert "torch" not in sys.modules
s = time.perf_counter()
r = verify_output(root, "quick", workers=workers)
t["total"] = (time.perf_counter() - s) * 1e3
t["t0"] = s
assert r.exit_code == 0 and r.ok == r.checked, r.to_dict()
print(json.dumps(t))
"""


def one_run(root: Path, workers: int, code_dir: str) -> dict[str, float]:
    core = os.path.join(code_dir, "module_utils")  # the core package hsx, where there is one
    layout = "hsx" if os.path.isdir(os.path.join(core, "hsx")) else "format"
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as log:
        got = subprocess.run(
            [sys.executable, "-c", _PROFILED, str(root), str(workers), log.name, layout],
            check=True, capture_output=True, text=True, cwd="/",
            env={**os.environ, "PYTHONPATH": os.pathsep.join([core, code_dir])},
        )  # fmt: skip
        t = json.loads(got.stdout)
        shares = [json.loads(line) for line in log.read().splitlines() if line.strip()]
    t0 = t.pop("t0")
    if shares:
        t["share_min"] = min(s["end"] - s["start"] for s in shares) * 1e3
        t["share_max"] = max(s["end"] - s["start"] for s in shares) * 1e3
        t["first_share_start"] = (min(s["start"] for s in shares) - t0) * 1e3
        t["last_share_end"] = (max(s["end"] for s in shares) - t0) * 1e3
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--distinct", type=int, default=512)
    ap.add_argument("--workers", default="1,2,8")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument(
        "--code",
        default=None,
        help="checkout to profile (extraction/ and module_utils/hsx, or an older format.py; default: this one)",
    )
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    here = Path(__file__).resolve()
    sys.path[:0] = [str(here.parent), str(here.parents[2])]
    from bench_verify import make_copies  # noqa: PLC0415 (torch: only to build the run)

    code_dir = args.code or str(Path(__file__).resolve().parents[2])
    base = Path(tempfile.mkdtemp(prefix="hsx-prof-", dir=args.dir))
    try:
        root = base / "run"
        make_copies(root, args.n, tokens=16, hidden=8, distinct=args.distinct)
        one_run(root, 1, code_dir)  # warm the page cache
        print(f"# profile_quick n={args.n} distinct={args.distinct} cpus={os.cpu_count()} code={code_dir}")
        for w in (int(x) for x in args.workers.split(",")):
            runs = [one_run(root, w, code_dir) for _ in range(args.runs)]
            keys = sorted({k for r in runs for k in r}, key=lambda k: (k != "total", k))
            med = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys}
            best = min(r["total"] for r in runs)
            print(f"workers={w} best total {best:.1f} ms; medians (ms): "
                  + " ".join(f"{k}={v:.1f}" for k, v in med.items()), flush=True)  # fmt: skip
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
