"""The dump hook against a real forward: a DeepSeek-V3-architecture model, hook active vs inactive.

Issue #27, run 1. A random-weight DeepseekV3Model (transformers) at DeepSeek-V3's own widths
(hidden 7168, MLA with 128 heads, q/kv LoRA ranks 1536/512, dense intermediate 18432, experts of
2048, 8 routed experts a token + 1 shared), cut to `--layers` decoder layers and `--experts` routed
experts a layer so it fits one GPU (8 layers on one GPU ~ one rank's share of the 61 layers under
tensor parallelism 8), bf16, runs prefill passes of realistic shape: a stream of requests of ragged
lengths (`--min-tokens`..`--max-tokens`), packed into passes of at most `--pass-tokens` tokens
(SGLang's chunked prefill: a request longer than what a pass has left is split, its next piece
leading the next pass). The model sees each pass as one flat sequence of tokens, as SGLang's
model does ([tokens, hidden]; its attention is per request, here causal over the pass: a little
more attention work, not less).

The hook is used as deployed: hook.py copied into a bare `sglang` package as hsx_dump_hook.py,
attached by the patch's init line and called by the patch's forward line, both exec'd from
hsx.sglang_patch exactly where the patched DeepseekV2Model runs them (the forward line right after
the final norm, with the captured layers' states in the list form). The captured states are each
captured layer's input (the residual stream entering it), as SGLang's layers_to_capture are.

Each round runs every pass twice, hook active and inactive (the patched line with no hook
attached: the same line, the same aux list), in alternating order. A pass is timed from its start
to the end of its work on the forward's own stream (`current_stream().synchronize()`, what the
scheduler's sampling waits on; the hook's side-stream copy is not waited for, as in the server).
Printed: per round and over rounds, the forward time with the hook / without (target <= 1.02x), the
time inside the patched line per token (the critical path, including any back-pressure wait), and
the hook's writer's sustained GB/s into the dump directory (tmpfs by default: /dev/shm). Dumps are
read back and compared with the source for the first round's first requests, then deleted each
round (a client would consume them).

    python3 tests/bench/bench_hook_forward.py [--rounds 5] [--layers 8] [--experts 32]
        [--pass-tokens 16384] [--requests 16] [--dir /dev/shm] [--budget-mb 8192]
    python3 tests/bench/bench_hook_forward.py --smoke     # CPU, tiny widths: the script itself works
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "module_utils"))
from extraction.sglang import dumps, hook, install  # noqa: E402
from hsx import sglang_patch  # noqa: E402


def patch_line(name: str):
    """The patch's block `name`, compiled as the patched DeepseekV2Model runs it."""
    (code,) = next(b["code"] for b in sglang_patch.SGLANG_DUMP_PATCH["blocks"] if b["name"] == name)
    return compile(code, f"<patched {name}>", "exec")


def deploy_hook(site: Path, dump_dir: str, budget_mb: float, num_layers: int, layer_ids: list[int]):
    """(a model-like object whose _hsx_dump is the hook deployed into a bare sglang package, the
    compiled forward line). The init line runs as in DeepseekV2Model.__init__."""
    pkg = site / "sglang"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    install.deploy_files(pkg)  # the hook and the dump format it imports
    sys.path.insert(0, str(site))
    os.environ.update(
        {hook.ENV_DIR: dump_dir, hook.ENV_LAYERS: ",".join(map(str, layer_ids)), hook.ENV_BUDGET: str(budget_mb)}
    )
    holder = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=num_layers), layers_to_capture=[])
    exec(patch_line("init"), {"self": holder})
    assert type(holder._hsx_dump).__module__ == sglang_patch.HOOK_MODULE, "hook not deployed"
    holder._hsx_dump.version = "bench"
    return holder, patch_line("forward")


def deepseek_v3_config(args):
    from transformers import DeepseekV3Config

    smoke = args.smoke
    kwargs = dict(
        vocab_size=1024 if smoke else 129280,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden if smoke else 18432,
        moe_intermediate_size=args.hidden // 2 if smoke else 2048,
        num_hidden_layers=args.layers,
        num_attention_heads=4 if smoke else 128,
        num_key_value_heads=4 if smoke else 128,
        n_shared_experts=1,
        n_routed_experts=args.experts,
        num_experts_per_tok=min(8, args.experts),
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=48 if smoke else 1536,
        kv_lora_rank=32 if smoke else 512,
        qk_rope_head_dim=8 if smoke else 64,
        qk_nope_head_dim=16 if smoke else 128,
        v_head_dim=16 if smoke else 128,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    )
    if args.experts_impl:
        kwargs["experts_implementation"] = args.experts_impl
    config = DeepseekV3Config(**kwargs)
    config._attn_implementation = "sdpa"
    return config


def random_model(cls, config, device: str):
    """cls(config) with seeded random bf16 weights, built on `device` (no host round trip)."""
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return cls(config)
    finally:
        torch.set_default_dtype(previous)


def build_model(args, device: str):
    from transformers import DeepseekV3Model

    config = deepseek_v3_config(args)
    t0 = time.perf_counter()
    model = random_model(DeepseekV3Model, config, device).eval()
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: DeepseekV3Model {args.layers} layers, hidden {args.hidden}, {args.experts} routed experts "
        f"(top {config.num_experts_per_tok}), {params / 1e9:.2f}B params bf16, attention "
        f"{config._attn_implementation}, experts {getattr(config, '_experts_implementation', None)}; "
        f"built in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    return model


def plan_passes(args) -> list[list[tuple[str, int, int]]]:
    """Passes of (rid, prefix, n): ragged requests, chunked at the pass boundary as SGLang does."""
    rng = random.Random(0)
    lengths = [rng.randint(args.min_tokens, args.max_tokens) for _ in range(args.requests)]
    passes, cur, room = [], [], args.pass_tokens
    for r, total in enumerate(lengths):
        done = 0
        while done < total:
            n = min(room, total - done)
            cur.append((f"hsx-req{r}", done, n))
            done += n
            room -= n
            if room == 0:
                passes.append(cur)
                cur, room = [], args.pass_tokens
    if cur:
        passes.append(cur)
    return passes


class Capture:
    """Forward pre-hooks on the captured layers: each one's input, the residual stream entering it."""

    def __init__(self, model, layer_ids: list[int]):
        self.states: list[torch.Tensor] = []
        self.handles = [
            model.layers[i].register_forward_pre_hook(self._take, with_kwargs=True) for i in layer_ids
        ]

    def _take(self, _module, args, kwargs):
        h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        self.states.append(h[0])


@torch.inference_mode()
def run_pass(model, capture, holder, line, batch, ids, pieces, keep) -> tuple[float, float]:
    """One pass: forward, the patched line. (seconds to the forward stream's end, seconds inside
    the line). With `keep` (untimed use only), a copy of each piece's states goes into it."""
    capture.states = []
    stream = torch.cuda.current_stream() if ids.is_cuda else None
    if stream is not None:
        stream.synchronize()
    t0 = time.perf_counter()
    out = model(input_ids=ids[None], use_cache=False)
    final = out.last_hidden_state[0]
    scope = {"self": holder, "forward_batch": batch, "hidden_states": final, "aux_hidden_states": capture.states}
    t1 = time.perf_counter()
    exec(line, scope)
    t2 = time.perf_counter()
    if stream is not None:
        stream.synchronize()
    elapsed = time.perf_counter() - t0
    if keep is not None:
        aux, start = torch.cat(capture.states, dim=-1), 0
        for rid, off, n in pieces:
            keep.setdefault(rid, []).append((off, final[start : start + n].cpu(), aux[start : start + n].cpu()))
            start += n
    return elapsed, t2 - t1


def check_dumps(dump_dir: str, sources: dict[str, list], limit: int) -> int:
    """The dumps of the first `limit` finished requests equal their rows on the device."""
    checked = 0
    for rid, parts in list(sources.items())[:limit]:
        parts.sort(key=lambda p: p[0])
        length = sum(int(p[1].shape[0]) for p in parts)
        got = dumps.read_request(dump_dir, rid, expected_len=length)
        assert torch.equal(got.hidden_state, torch.cat([p[1] for p in parts])), rid
        assert torch.equal(got.aux_hidden_state, torch.cat([p[2] for p in parts])), rid
        checked += 1
    return checked


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--experts-impl", default="grouped_mm", help="transformers experts_implementation ('' = its default)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--min-tokens", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=9000)
    ap.add_argument("--pass-tokens", type=int, default=16384, help="SGLang's --chunked-prefill-size")
    ap.add_argument("--budget-mb", type=float, default=hook.DEFAULT_BUDGET_MB)
    ap.add_argument("--dir", default="/dev/shm", help="the dump directory's parent (tmpfs by default)")
    ap.add_argument("--check", type=int, default=4, help="requests whose dumps are compared with the source")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny widths: check the script, not the figure")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.hidden, args.layers, args.experts, args.rounds, args.warmup = 64, 8, 8, 2, 0
        args.requests, args.min_tokens, args.max_tokens, args.pass_tokens = 6, 20, 90, 128
        args.experts_impl = ""
    model = build_model(args, device)
    layer_ids = hook.default_layer_ids(args.layers)
    parent = args.dir if os.path.isdir(args.dir) else None
    workdir = tempfile.mkdtemp(prefix="hsx-hookfwd-", dir=parent)
    dump_dir = os.path.join(workdir, "dumps")
    os.makedirs(dump_dir)
    with open("/proc/mounts", encoding="utf-8") as f:
        fstype = next((ln.split()[2] for ln in f if ln.split()[1] == (parent or "/tmp")), "?")
    site = Path(workdir) / "site"
    active, line = deploy_hook(site, dump_dir, args.budget_mb, args.layers, layer_ids)
    inactive = SimpleNamespace(config=active.config, layers_to_capture=list(layer_ids))
    capture = Capture(model, layer_ids)
    passes = plan_passes(args)
    gen = torch.Generator().manual_seed(1)
    inputs = []
    for p in passes:
        total = sum(n for _, _, n in p)
        ids = torch.randint(0, model.config.vocab_size, (total,), generator=gen).to(device)
        batch = SimpleNamespace(
            forward_mode=SimpleNamespace(name="EXTEND"),
            rids=[rid for rid, _, _ in p],
            extend_seq_lens_cpu=[n for _, _, n in p],
            extend_prefix_lens_cpu=[off for _, off, _ in p],
            input_ids=ids,
        )
        inputs.append((batch, ids))
    tokens = sum(int(ids.shape[0]) for _, ids in inputs)
    try:  # the experts implementation asked for may not run here: fall back to transformers' loop
        run_pass(model, capture, inactive, line, *inputs[0], passes[0], None)
    except Exception as exc:  # noqa: BLE001 - reported, then the default is used
        print(f"experts implementation {args.experts_impl!r} failed ({type(exc).__name__}: {exc}); using eager")
        model.config._experts_implementation = "eager"
    print(
        f"passes: {len(passes)} of <= {args.pass_tokens} tokens, {args.requests} requests "
        f"{args.min_tokens}-{args.max_tokens} tokens, {tokens} tokens a round; captured layers {layer_ids}; "
        f"dumps in {dump_dir} ({fstype}), budget {args.budget_mb:.0f} MiB",
        flush=True,
    )
    hk = active._hsx_dump
    rows = []
    kept: dict[str, list] = {}  # the first round's first requests: their states, kept to check the dumps
    for rnd in range(args.warmup + args.rounds):
        order = ["hook", "off"] if rnd % 2 == 0 else ["off", "hook"]
        got = {}
        for side in order:
            holder = active if side == "hook" else inactive
            before = hk.stats()
            fwd = inside = 0.0
            for (batch, ids), p in zip(inputs, passes, strict=True):
                keep = kept if (rnd == 0 and side == "hook" and len(kept) <= args.check) else None
                t, i = run_pass(model, capture, holder, line, batch, ids, p, keep)
                fwd += t
                inside += i
            drain_t0 = time.perf_counter()
            if side == "hook":
                assert hk.flush(600), "writer did not drain"
            drain = time.perf_counter() - drain_t0
            after = hk.stats()
            got[side] = {
                "fwd": fwd,
                "inside": inside,
                "drain": drain,
                "bytes": after["bytes_written"] - before["bytes_written"],
                "busy": after["write_s"] - before["write_s"],
                "waited": after["waited_s"] - before["waited_s"],
                "failed": after["failed"] - before["failed"],
            }
        if rnd == 0 and args.check:
            complete = {rid: parts for rid, parts in kept.items() if rid != passes[-1][-1][0]}
            ok = check_dumps(dump_dir, dict(list(complete.items())[:-1]), args.check)
            print(f"dumps checked against the pass's own states: {ok} requests, equal", flush=True)
        shutil.rmtree(dump_dir)
        os.makedirs(dump_dir)
        h, o = got["hook"], got["off"]
        row = {
            "ratio": h["fwd"] / o["fwd"],
            "us_tok": h["inside"] / tokens * 1e6,
            "gbs": h["bytes"] / h["busy"] / 1e9 if h["busy"] else float("nan"),
            "fwd_us_tok": o["fwd"] / tokens * 1e6,
        }
        tag = "warmup" if rnd < args.warmup else f"round {rnd - args.warmup + 1}"
        print(
            f"{tag}: forward {o['fwd']:.3f} s off, {h['fwd']:.3f} s hook = {row['ratio']:.4f}x; "
            f"inside the line {row['us_tok']:.3f} us/token (back-pressure {h['waited'] * 1e3:.1f} ms); "
            f"writer {h['bytes'] / 1e9:.2f} GB in {h['busy']:.2f} s busy = {row['gbs']:.2f} GB/s, drain "
            f"{h['drain']:.2f} s, failed {h['failed']}; forward {row['fwd_us_tok']:.1f} us/token",
            flush=True,
        )
        if rnd >= args.warmup:
            rows.append(row)
    for key, label in (
        ("ratio", "hook/off forward time (target <= 1.02x)"),
        ("us_tok", "us/token inside the patched line"),
        ("gbs", "writer GB/s into the dump dir"),
        ("fwd_us_tok", "forward us/token, hook off"),
    ):
        vals = [r[key] for r in rows]
        print(f"{label}: median {statistics.median(vals):.4f}, min {min(vals):.4f}, max {max(vals):.4f} ({len(vals)} rounds)")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
