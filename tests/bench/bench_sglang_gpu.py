"""The sglang path end to end on a GPU vs the hf backend on the same model and GPU (issue #27, run 2).

A random-weight DeepSeek-V3-architecture model at DeepSeek-V3's widths (hidden 7168, MLA with 128
heads; bench_hook_forward.py's config, `--layers` layers of `--experts` routed experts, the tiny
tokenizer's vocabulary) is written to disk once. Then, in one call:

  sglang  the TEST-ONLY stand-in SGLang server (tests/standin_sglang/server.py: NOT SGLang; it
          stands in because a real SGLang server is not installed here) running that model on
          cuda with the deployed dump hook (the states reach the hook on the GPU: the side-stream
          copy path), and the real client `hsx extract --backend sglang`, dumps in tmpfs;
  hf      `hsx extract --backend hf --device cuda` on the same model, dataset and GPU.

Each side is a real `hsx extract` process, timed from its start to its exit (model load included
on the hf side; the server's load is outside, as a running server's is). Printed: samples/s and
tokens/s of each; then the shards of the two runs compared sample by sample: input_ids equal, and
the states bit for bit or, where not, the largest difference relative to the states' scale (the
two sides batch differently: the stand-in runs one unpadded forward a request, hf right-pads a
batch; bf16 GEMMs of other shapes may round differently).

    python3 tests/bench/bench_sglang_gpu.py [--samples 128] [--layers 8] [--experts 8] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "module_utils"))
from extraction.testbed.tiny import build_tokenizer, write_tiny_dataset  # noqa: E402
from hsx.index import load_index  # noqa: E402
from hsx.layout import KEY_AUX, KEY_HIDDEN, KEY_INPUT_IDS  # noqa: E402
from tests.bench.bench_hook_forward import deepseek_v3_config, random_model  # noqa: E402


def write_model(out: Path, layers: int, experts: int, device: str) -> None:
    from transformers import DeepseekV3ForCausalLM

    from extraction.backends.hf import _quiet_transformers

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    args = SimpleNamespace(smoke=device == "cpu", hidden=64 if device == "cpu" else 7168, layers=layers,
                           experts=experts, experts_impl="")
    config = deepseek_v3_config(args)
    config.vocab_size = 1024  # the tiny tokenizer's
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 0, 1, 2
    config.architectures = ["DeepseekV3ForCausalLM"]
    model = random_model(DeepseekV3ForCausalLM, config, device)
    with _quiet_transformers():
        model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"stand-in server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit("stand-in server not healthy in time")


def extract(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "extraction.cli", "extract", "--progress", "off", *argv],
                   check=True, env=env, cwd=REPO)
    return time.perf_counter() - t0


def compare(out_a: Path, out_b: Path) -> dict:
    a, b = load_index(str(out_a)), load_index(str(out_b))
    assert set(a) == set(b), f"different samples: {len(a)} vs {len(b)}"
    exact = 0
    worst_rel = 0.0
    for sid in sorted(a):
        sa = torch.load(out_a / a[sid].path, weights_only=True)
        sb = torch.load(out_b / b[sid].path, weights_only=True)
        assert torch.equal(sa[KEY_INPUT_IDS], sb[KEY_INPUT_IDS]), sid
        same = True
        for key in (KEY_HIDDEN, KEY_AUX):
            x, y = sa[key].float(), sb[key].float()
            assert x.shape == y.shape, (sid, key, x.shape, y.shape)
            if not torch.equal(x, y):
                same = False
                worst_rel = max(worst_rel, float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)))
        exact += same
    return {"samples": len(a), "bit_equal": exact, "worst_rel": worst_rel}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8, help="hf side")
    ap.add_argument("--concurrency", type=int, default=8, help="sglang side: requests in flight")
    ap.add_argument("--chunk", type=int, default=8192, help="the stand-in's --chunked-prefill-size")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--dump-parent", default="/dev/shm")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="hsx-sglang-gpu-"))
    model, dataset = work / "model", work / "data.jsonl"
    t0 = time.perf_counter()
    if not (model / "config.json").exists():
        write_model(model, args.layers, args.experts, args.device)
    write_tiny_dataset(dataset, args.samples)
    print(f"model + dataset written in {time.perf_counter() - t0:.1f} s ({work})", flush=True)
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{REPO / 'module_utils'}", HF_HUB_OFFLINE="1")
    dump_dir = Path(tempfile.mkdtemp(prefix="hsx-dumps-", dir=args.dump_parent))
    port = free_port()
    server_env = dict(env, HSX_DUMP_DIR=str(dump_dir))
    server = subprocess.Popen(
        [sys.executable, "tests/standin_sglang/server.py", "--model-path", str(model), "--port", str(port),
         "--chunked-prefill-size", str(args.chunk), "--device", args.device],
        cwd=REPO, env=server_env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.perf_counter()
        wait_health(url, server)
        print(f"stand-in server (TEST-ONLY, not SGLang) up in {time.perf_counter() - t0:.1f} s", flush=True)
        common = ["--model", str(model), "--dataset", str(dataset)]
        secs = {
            "sglang": extract(common + ["--output", str(work / "out-sglang"), "--backend", "sglang",
                                        "--server-url", url, "--dump-dir", str(dump_dir),
                                        "--concurrency", str(args.concurrency)], env),
        }
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    left = sorted(os.listdir(dump_dir))
    shutil.rmtree(dump_dir, ignore_errors=True)  # tmpfs: RAM until removed
    secs["hf"] = extract(common + ["--output", str(work / "out-hf"), "--backend", "hf", "--device", args.device,
                                   "--batch-size", str(args.batch_size)], env)
    tokens = sum(e.num_tokens for e in load_index(str(work / "out-hf")).values())
    for side, s in secs.items():
        print(f"{side}: {args.samples} samples, {tokens} tokens in {s:.1f} s = {args.samples / s:.2f} samples/s, "
              f"{tokens / s:.0f} tokens/s", flush=True)
    print(f"dumps left in the dump dir after the sglang run: {len(left)}", flush=True)
    result = compare(work / "out-sglang", work / "out-hf")
    print(f"shards compared: {json.dumps(result)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
