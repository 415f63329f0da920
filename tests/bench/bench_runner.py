"""Runner overhead, side by side in one process (the machine is shared and noisy).

  A  forward only: the hf backend over the runner's own batch plan (pre-tokenized), no disk
  B  the runner: `hsx extract` in-process (tokenize thread + forward + background writer)
  C  the peers' loop: forward, then torch.save each sample synchronously (no fsync, no index)
  R  resume start-up over --resume-shards existing shards (dataset scan + index + quick each)

Rounds interleave A/B/C; the best round of each is reported with the ratios A/B and C/B.

  python tests/bench/bench_runner.py                          # CPU, tiny model
  python tests/bench/bench_runner.py --device cuda --dtype bf16 --hidden 2048 --layers 16 \\
      --samples 512 --batch-size 16 --max-length 1024          # GPU, a few hundred M params
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from extraction.backends.hf import HFBackend  # noqa: E402
from extraction.config import build_config  # noqa: E402
from extraction.dataset import ChatTokenizer, load_tokenizer, scan_dataset  # noqa: E402
from extraction.runner import Runner, iter_batches_for_bench  # noqa: E402
from extraction.shards import ShardWriter  # noqa: E402
from extraction.shards import format as fmt  # noqa: E402
from extraction.tiny import build_tiny_model, write_tiny_dataset  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def forward_only(backend: HFBackend, batches, device: str) -> float:
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


def runner_run(cfg_kw: dict, backend: HFBackend, out: Path) -> tuple[float, float]:
    """(wall of run(), seconds spent in the pipeline after start-up)."""
    cfg = build_config({**cfg_kw, "output": str(out)})
    r = Runner(cfg, backend_factory=lambda _c, _l: _Keep(backend), log=lambda _m: None)
    t = time.perf_counter()
    code = r.run()
    wall = time.perf_counter() - t
    if code != 0:
        raise SystemExit(f"runner exited {code}")
    return wall, wall - r.resume_seconds


class _Keep:
    """Reuse one loaded backend; the runner's close() must not unload it."""

    def __init__(self, inner: HFBackend):
        self.inner, self.name = inner, "hf"

    def model_info(self):
        return self.inner.model_info()

    def extract(self, samples):
        return self.inner.extract(samples)

    def close(self) -> None:
        pass


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
        rel = fmt.shard_relpath(sid)
        d = os.path.dirname(rel)
        if d not in made:
            os.makedirs(out / d, exist_ok=True)
            made.add(d)
        (out / rel).write_bytes(data)
        lines.append(
            fmt.encode_index_line(
                fmt.index_record(fmt.IndexEntry(sid, rel, first.size, first.checksum, first.num_tokens))
            )
        )
    with open(out / fmt.INDEX_NAME, "ab") as f:
        f.write(b"".join(lines))
    build_s = time.perf_counter() - t0
    os.sync()
    t = time.perf_counter()
    r2 = Runner(build_config(kw), log=lambda _m: None)
    r2.prepare()
    prep = time.perf_counter() - t
    assert len(r2.done) == n, (len(r2.done), n)
    return {
        "shards": n,
        "build_s": round(build_s, 1),
        "prepare_s": round(prep, 2),
        "quick_s": round(r2.resume_seconds, 2),
    }


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
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="hsx-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
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
        backend.set_layers(r0.layer_ids)
        shutil.rmtree(work / "unused")
        params = sum(p.numel() for p in backend.model.parameters())
        batches = list(
            iter_batches_for_bench(
                cfg, scan_dataset(ds).entries, ChatTokenizer(load_tokenizer(model_dir), args.max_length)
            )
        )
        tokens = sum(int(s.input_ids.numel()) for b in batches for s in b)
        print(
            f"model: hidden {args.hidden}, {args.layers} layers, {params / 1e6:.1f}M params, {args.dtype} on {args.device}, "
            f"torch threads {torch.get_num_threads()}"
        )
        print(
            f"work: {args.samples} samples, {tokens} tokens, {len(batches)} batches of <= {args.batch_size}"
        )
        forward_only(backend, batches[:2], args.device)  # warm-up
        best = {"A": 1e9, "B": 1e9, "Bp": 1e9, "C": 1e9}
        for rnd in range(args.rounds):
            a = forward_only(backend, batches, args.device)
            b, bp = runner_run(cfg_kw, backend, work / f"run{rnd}")
            c = sync_save_loop(backend, batches, work / f"sync{rnd}", args.device)
            shutil.rmtree(work / f"run{rnd}")
            shutil.rmtree(work / f"sync{rnd}")
            print(f"round {rnd}: forward-only {a:.2f}s  runner {b:.2f}s  sync-save loop {c:.2f}s")
            best = {
                "A": min(best["A"], a),
                "B": min(best["B"], b),
                "Bp": min(best["Bp"], bp),
                "C": min(best["C"], c),
            }
        print(
            f"best: forward-only {best['A']:.2f}s, runner {best['B']:.2f}s (incl. start-up), sync-save {best['C']:.2f}s"
        )
        print(f"runner throughput vs forward-only: {best['A'] / best['B']:.3f}x  (target >= 0.95x)")
        print(f"runner throughput vs sync forward-then-torch.save: {best['C'] / best['B']:.3f}x")
        print(f"runner samples/s {args.samples / best['B']:.1f}, tokens/s {tokens / best['B']:.0f}")
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
