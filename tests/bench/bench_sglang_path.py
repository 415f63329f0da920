"""The dump hook on the forward's critical path vs a synchronous torch.save, and its writer's rate.

The hook is used as deployed: hook.py copied into a bare `sglang` package as hsx_dump_hook.py,
attached by the patch's init line and called by the patch's forward line (both exec'd as the
patched DeepseekV2Model runs them, from hsx.sglang_patch). Passes are Kimi-K2.5 wide (hidden
7168, 3 captured layers packed [tokens, 3H] as AuxHiddenStatePacker hands them, bf16 final state,
int64 ids), `--requests` requests of `--tokens` tokens cut into `--chunks` prefill pieces each,
spread over passes of `--pass-tokens` tokens (a request's pieces in consecutive passes).

Each round runs the same passes twice, in alternating order (the machine is shared and noisy):
  hook   a stand-in forward (`--forward-us` a token, sleeping as a thread waiting for the GPU does),
         then the patched line; timed: the time inside it (the critical path, which includes any
         back-pressure wait) and, after the last pass, the writer's drain.
  sync   the same stand-in forward, then a synchronous torch.save + rename of each piece's record;
         timed on CPU: the saves only, from rows already cut and owned (the floor of any
         synchronous dump; the hook before #29 also cut and copied); on CUDA: the blocking copy
         to the host too (what a synchronous dump must do there).
Printed: per round and median/min/max over rounds, critical path us/token, its ratio to sync,
back-pressure wait, and the writer's sustained MiB/s (bytes / its busy seconds) next to the
synchronous save's MiB/s into the same directory. With --device cuda the states live on the GPU
(sync then includes the blocking copy to the host) and every dump is checked against the source.

    .venv/bin/python tests/bench/bench_sglang_path.py [--rounds 5] [--warmup 1] [--requests 4] [--tokens 3700]
        [--chunks 2] [--pass-tokens 8192] [--forward-us 0] [--budget-mb 4096] [--dir DIR]
        [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from extraction.sglang import dumps, hook, hsx_dump_format, install  # noqa: E402
from hsx import sglang_patch  # noqa: E402

HIDDEN = 7168
LAYERS = "2,30,58"  # K2.5: 61 layers, SGLang's EAGLE-3 default [2, N//2, N-3]
NUM_LAYERS = 61


def _block(name: str):
    (code,) = next(b["code"] for b in sglang_patch.SGLANG_DUMP_PATCH["blocks"] if b["name"] == name)
    return compile(code, f"<patched {name}>", "exec")


def deployed_model(site: Path, dump_dir: str, budget_mb: float):
    """A model object whose _hsx_dump comes from the hook deployed into a bare sglang package."""
    pkg = site / "sglang"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    install.deploy_files(pkg)  # the hook and the dump format it imports
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]
    importlib.invalidate_caches()
    os.environ.update({hook.ENV_DIR: dump_dir, hook.ENV_LAYERS: LAYERS, hook.ENV_BUDGET: str(budget_mb)})
    model = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=NUM_LAYERS), layers_to_capture=[])
    exec(_block("init"), {"self": model})
    assert type(model._hsx_dump).__module__ == sglang_patch.HOOK_MODULE, "hook not deployed"
    model._hsx_dump.version = "bench"
    return model


def make_passes(args, device: str):
    """[(batch, final, packed aux, pieces)] where pieces = [(rid, start row, n, offset)]."""
    gen = torch.Generator().manual_seed(0)
    todo = []  # (rid, offset, n) in the order a chunked prefill runs them
    piece = -(-args.tokens // args.chunks)
    for r in range(args.requests):
        for off in range(0, args.tokens, piece):
            todo.append((f"hsx-req{r}", off, min(piece, args.tokens - off)))
    passes, cur = [], []
    for item in todo:
        if cur and sum(n for _, _, n in cur) + item[2] > args.pass_tokens:
            passes.append(cur)
            cur = []
        cur.append(item)
    passes.append(cur)
    out = []
    for p in passes:
        total = sum(n for _, _, n in p)
        final = torch.randn(total, HIDDEN, generator=gen).to(torch.bfloat16).to(device)
        packed = torch.randn(total, 3 * HIDDEN, generator=gen).to(torch.bfloat16).to(device)
        ids = torch.randint(0, 160000, (total,), generator=gen).to(device)
        batch = SimpleNamespace(
            forward_mode=SimpleNamespace(name="EXTEND"),
            rids=[rid for rid, _, _ in p],
            extend_seq_lens_cpu=[n for _, _, n in p],
            extend_prefix_lens_cpu=[off for _, off, _ in p],
            input_ids=ids,
        )
        pieces, start = [], 0
        for rid, off, n in p:
            pieces.append((rid, start, n, off))
            start += n
        out.append((batch, final, packed, pieces))
    return out


def forward_wait(seconds: float, device: str) -> None:
    if seconds > 0:
        if device == "cuda":
            torch.cuda.synchronize()
        time.sleep(seconds)


def run_hook(model, passes, args, device) -> dict:
    hk = model._hsx_dump
    before = hk.stats()
    line = _block("forward")
    inside = 0.0
    tokens = 0
    t_start = time.perf_counter()
    for batch, final, packed, _pieces in passes:
        n = int(final.shape[0])
        forward_wait(args.forward_us * 1e-6 * n, device)
        scope = {
            "self": model,
            "forward_batch": batch,
            "hidden_states": final,
            "aux_hidden_states": SimpleNamespace(finalize=lambda packed=packed: packed),
        }
        t0 = time.perf_counter()
        exec(line, scope)
        inside += time.perf_counter() - t0
        tokens += n
    t_last = time.perf_counter()
    assert hk.flush(600), "writer did not drain"
    t_end = time.perf_counter()
    after = hk.stats()
    return {
        "inside": inside,
        "tokens": tokens,
        "waited": after["waited_s"] - before["waited_s"],
        "drain": t_end - t_last,
        "wall": t_end - t_start,
        "bytes": after["bytes_written"] - before["bytes_written"],
        "busy": after["write_s"] - before["write_s"],
        "failed": after["failed"] - before["failed"],
    }


def run_sync(passes, directory: str, args, device) -> dict:
    saving = 0.0
    nbytes = 0
    for batch, final, packed, pieces in passes:
        forward_wait(args.forward_us * 1e-6 * int(final.shape[0]), device)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        records = []
        for rid, s, n, off in pieces:
            records.append(
                {
                    "format": hsx_dump_format.FORMAT,
                    "rid": rid,
                    "offset": off,
                    "seq_len": off + n,
                    "input_ids": batch.input_ids[s : s + n].to("cpu", torch.long, copy=True),
                    "hidden_state": final[s : s + n].to("cpu", copy=True),
                    "aux_hidden_state": packed[s : s + n].to("cpu", copy=True),
                    "layer_ids": [2, 30, 58],
                    "capture_owner": hook.OWNER_HOOK,
                    "sglang_version": "bench",
                }
            )
        if device == "cpu":  # the floor: rows already cut and owned (on CUDA the copy is part of it)
            t0 = time.perf_counter()
        for record in records:
            rid, off, n = record["rid"], record["offset"], int(record["input_ids"].shape[0])
            name = hsx_dump_format.dump_name(rid, off)
            tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
            torch.save(record, tmp)
            os.replace(tmp, os.path.join(directory, name))
            nbytes += n * (2 * HIDDEN * 4 + 8)
        saving += time.perf_counter() - t0
    return {"saving": saving, "bytes": nbytes}


def check(passes, dump_dir: str, args) -> None:
    """Every request's joined dump equals its source rows (on the GPU run: the copies are right)."""
    rows: dict[str, list] = {}
    for _batch, final, packed, pieces in passes:
        for rid, s, n, off in pieces:
            rows.setdefault(rid, []).append((off, final[s : s + n].cpu(), packed[s : s + n].cpu()))
    for rid, parts in rows.items():
        got = dumps.read_request(dump_dir, rid, expected_len=args.tokens)
        parts.sort(key=lambda p: p[0])
        assert torch.equal(got.hidden_state, torch.cat([p[1] for p in parts])), rid
        assert torch.equal(got.aux_hidden_state, torch.cat([p[2] for p in parts])), rid


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=3700, help="tokens a request (K2.5 sample ~3,700)")
    ap.add_argument("--chunks", type=int, default=2, help="prefill pieces a request")
    ap.add_argument("--pass-tokens", type=int, default=8192, help="tokens a forward pass at most")
    ap.add_argument("--forward-us", type=float, default=0.0, help="stand-in forward, us a token")
    ap.add_argument("--budget-mb", type=float, default=hook.DEFAULT_BUDGET_MB)
    ap.add_argument("--dir", default=None, help="dump directory's parent (default: a temp dir)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="hsx-bench-path-", dir=args.dir))
    try:
        passes = make_passes(args, args.device)
        total_tokens = sum(int(f.shape[0]) for _, f, _, _ in passes)
        mib = total_tokens * (4 * HIDDEN * 2 + 8) / 2**20
        print(
            f"{len(passes)} passes, {args.requests} requests x {args.tokens} tokens in {args.chunks} pieces, "
            f"{total_tokens} tokens, {mib:.0f} MiB a round; hidden {HIDDEN}, 3 aux layers, bf16; "
            f"forward stand-in {args.forward_us:g} us/token; budget {args.budget_mb:g} MiB; device {args.device}; "
            f"dir {root}; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
        )
        hook_dir, sync_dir = root / "hook", root / "sync"
        model = deployed_model(root / "site", str(hook_dir), args.budget_mb)
        rows = []
        for r in range(-args.warmup, args.rounds):
            for d in (hook_dir, sync_dir):
                shutil.rmtree(d, ignore_errors=True)
                d.mkdir()
            order = ("hook", "sync") if r % 2 == 0 else ("sync", "hook")
            got = {}
            for which in order:
                if which == "hook":
                    got["hook"] = run_hook(model, passes, args, args.device)
                else:
                    got["sync"] = run_sync(passes, str(sync_dir), args, args.device)
            h, s = got["hook"], got["sync"]
            if r == -args.warmup or args.device == "cuda":  # on CUDA every round (pinned blocks are reused)
                check(passes, str(hook_dir), args)
            assert h["failed"] == 0, "dumps failed"
            if r < 0:
                continue
            row = {
                "crit_us": h["inside"] / h["tokens"] * 1e6,
                "sync_us": s["saving"] / h["tokens"] * 1e6,
                "waited_ms": h["waited"] * 1e3,
                "writer_mibs": h["bytes"] / 2**20 / h["busy"],
                "wall_mibs": h["bytes"] / 2**20 / h["wall"],
                "sync_mibs": s["bytes"] / 2**20 / s["saving"],
                "drain_ms": h["drain"] * 1e3,
            }
            row["ratio"] = row["crit_us"] / row["sync_us"]
            rows.append(row)
            print(
                f"round {r + 1} ({order[0]} first): critical path {row['crit_us']:8.3f} us/token "
                f"(back-pressure {row['waited_ms']:.0f} ms) | sync torch.save {row['sync_us']:6.1f} us/token | "
                f"ratio {row['ratio']:.4f} | writer {row['writer_mibs']:6.0f} MiB/s busy, "
                f"{row['wall_mibs']:6.0f} MiB/s wall (drain {row['drain_ms']:.0f} ms) | sync {row['sync_mibs']:6.0f} MiB/s"
            )
        print(f"over {len(rows)} rounds: median [min - max]")
        for key, label, fmt in (
            ("crit_us", "critical path us/token", "{:.3f}"),
            ("sync_us", "sync torch.save us/token", "{:.1f}"),
            ("ratio", "ratio critical / sync (target <= 0.1)", "{:.4f}"),
            ("waited_ms", "back-pressure wait ms a round", "{:.0f}"),
            ("writer_mibs", "writer MiB/s (busy)", "{:.0f}"),
            ("wall_mibs", "writer MiB/s (first pass -> drained)", "{:.0f}"),
            ("sync_mibs", "sync torch.save MiB/s", "{:.0f}"),
        ):
            vals = [row[key] for row in rows]
            print(
                f"  {label:40s} {fmt.format(statistics.median(vals))} "
                f"[{fmt.format(min(vals))} - {fmt.format(max(vals))}]"
            )
        print(f"load after: {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
