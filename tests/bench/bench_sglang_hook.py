"""Dump hook cost, measured side by side in one run (the machine is shared and noisy).

A prefill batch of K2.5-shaped states (hidden 7168, 3 aux layers, bf16) split into requests:
1. hook.after_forward + flush (hand-off, then the writer thread's split, write_dump, rename: the
   whole write, waited for) vs the floor: one torch.save per request of tensors already split and
   owned (what any dump must at least do). The forward's critical path alone (after_forward
   without the wait) is measured by bench_sglang_path.py;
2. reading a request back (dumps.read_request, chunked into pieces, format 2: mapped) vs torch.load
   of the floor's files (the same bytes in format 1, a torch.save'd dict);
3. the patched forward line when the hook is inactive (HSX_DUMP_DIR unset): its cost per call.

    python tests/bench/bench_sglang_hook.py [--requests 4] [--tokens 512] [--hidden 7168] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from extraction.sglang import dumps, hook  # noqa: E402
from hsx import sglang_patch  # noqa: E402


def _batch(requests: int, tokens: int, chunks: int):
    rids, seq, pre = [], [], []
    piece = tokens // chunks
    for r in range(requests):
        for c in range(chunks):
            rids.append(f"r{r}")
            seq.append(piece)
            pre.append(c * piece)
    return rids, seq, pre


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--chunks", type=int, default=2, help="pieces per request (chunked prefill)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n = args.requests * args.tokens
    h = args.hidden
    final = torch.randn(n, h).to(torch.bfloat16)
    aux = [torch.randn(n, h).to(torch.bfloat16) for _ in range(3)]
    ids = torch.randint(0, 100000, (n,))
    mb = (final.numel() + sum(a.numel() for a in aux)) * 2 / 2**20
    print(
        f"batch: {args.requests} requests x {args.tokens} tokens, hidden {h}, 3 aux layers: {mb:.0f} MiB bf16"
    )

    t_hook, t_floor, t_read, t_load = [], [], [], []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
            model = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=61), layers_to_capture=[])
            hk = hook.attach(model, {hook.ENV_DIR: d1, hook.ENV_LAYERS: "2,30,58"})
            rids, seq, pre = _batch(args.requests, args.tokens, args.chunks)
            fb = SimpleNamespace(
                forward_mode=SimpleNamespace(name="EXTEND"),
                rids=rids,
                extend_seq_lens_cpu=seq,
                extend_prefix_lens_cpu=pre,
                input_ids=ids,
            )
            t0 = time.perf_counter()
            hk.after_forward(fb, final, aux)
            hk.flush()
            t_hook.append(time.perf_counter() - t0)

            packed = torch.cat(aux, dim=-1)
            parts, start = [], 0
            for s in seq:  # pre-split, owned tensors: not timed
                parts.append(
                    {
                        "input_ids": ids[start : start + s].clone(),
                        "hidden_state": final[start : start + s].clone(),
                        "aux_hidden_state": packed[start : start + s].clone(),
                    }
                )
                start += s
            t0 = time.perf_counter()
            for i, p in enumerate(parts):
                torch.save(p, os.path.join(d2, f"{i}.pt"))
            t_floor.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            for r in range(args.requests):
                dumps.read_request(d1, f"r{r}", expected_len=args.tokens)
            t_read.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for f in sorted(os.listdir(d2)):
                torch.load(os.path.join(d2, f), weights_only=True)
            t_load.append(time.perf_counter() - t0)

    med = statistics.median
    print(
        f"1. after_forward+flush {med(t_hook) * 1e3:8.1f} ms   floor torch.save {med(t_floor) * 1e3:8.1f} ms   ratio {med(t_hook) / med(t_floor):.2f}"
    )
    print(
        f"2. read_request       {med(t_read) * 1e3:8.1f} ms   torch.load       {med(t_load) * 1e3:8.1f} ms   ratio {med(t_read) / med(t_load):.2f}"
    )

    # 3. inactive hook: the forward line as patched, with _hsx_dump None
    (line,) = next(b["code"] for b in sglang_patch.SGLANG_DUMP_PATCH["blocks"] if b["name"] == "forward")
    code = compile(line, "<patched-forward>", "exec")
    ns = {
        "self": SimpleNamespace(_hsx_dump=None),
        "forward_batch": None,
        "hidden_states": None,
        "aux_hidden_states": [],
    }
    calls = 200_000
    t0 = time.perf_counter()
    for _ in range(calls):
        exec(code, ns)
    per_call = (time.perf_counter() - t0) / calls
    print(f"3. inactive patched line: {per_call * 1e9:.0f} ns per forward (includes exec overhead)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
