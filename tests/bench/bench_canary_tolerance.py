#!/usr/bin/env python3
"""How much the hf backend's states vary where nothing changed: the canary's default tolerance.

The canary (extraction/canary/) re-extracts a few finished samples one at a time and compares them
with their shards, which were extracted in batches. This measures, on one device, with the tiny
target (extraction/testbed: built here unless --model is given) and the canary's own measure
(extraction.canary.compare.relative_error: max |a-b| / max |a| per tensor), for each dtype:

  same batch      the runner's batches of --batch (sorted by length, as runner/plan.py cuts them)
                  run twice: the same command twice
  rebuilt batch   those batches rebuilt as the canary rebuilds a sample's original batch (its
                  members in their order, the same padding) in a NEW process (a fresh model load and
                  device context, as `hsx canary` after a recovery), each batch alone and in reverse
                  order: what the canary expects to be bit-equal (--no-rebuild: skip)
  batch B vs 1    those batches against each sample alone (the canary's fallback for shards
                  written before batch membership was recorded)
  threads         (cpu) the batches on 1 torch thread against torch's default (a canary on a node
                  whose job ran with another thread count)
  perturbed       the batches with every weight multiplied by (1 + --perturb x N(0,1)): what the
                  canary must catch, to show the tolerance sits between the two

and prints, per comparison, the distribution over samples x {hidden_state, aux_hidden_state}: max,
p99, median, how many bit-equal; then one line of JSON. Standalone: torch + transformers + this
repository (no install, no ansible):

  python tests/bench/bench_canary_tolerance.py [--device cpu|cuda] [--samples 48] [--batch 8]
      [--dtypes float32,bfloat16] [--hidden 64] [--layers 8] [--model DIR] [--perturb 0.01]
      [--no-rebuild]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "module_utils")]  # the repository's packages, uninstalled
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from extraction.backends.base import Sample  # noqa: E402
from extraction.backends.hf import HFBackend  # noqa: E402
from extraction.canary.compare import STATES, relative_error  # noqa: E402
from extraction.inputs.chat_tokenizer import ChatTokenizer, load_tokenizer  # noqa: E402
from extraction.inputs.dataset import read_conversations, scan_dataset  # noqa: E402
from extraction.inputs.layers import default_layer_ids  # noqa: E402
from extraction.testbed.tiny import build_tiny_model, write_tiny_dataset  # noqa: E402

DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def plan_batches(samples: list[Sample], batch: int) -> list[list[Sample]]:
    """The runner's cut of one window (runner/plan.py batches_of_window: by length, then id; it is
    not imported here because extraction.runner needs the job's own packages)."""
    ordered = sorted(samples, key=lambda s: (int(s.input_ids.numel()), s.sample_id))
    return [ordered[i : i + batch] for i in range(0, len(ordered), batch)]


def run(backend: HFBackend, batches: list[list[Sample]]) -> dict[str, dict[str, torch.Tensor]]:
    """sample id -> {state name: [L, X] on the host} for every batch, in order."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for b in batches:
        for r in backend.extract(b):
            out[r.sample_id] = {"hidden_state": r.hidden_state, "aux_hidden_state": r.aux_hidden_state}
    if backend.device.type == "cuda":
        torch.cuda.synchronize()
    return out


def distribution(a: dict, b: dict) -> dict[str, float | int]:
    """max, p99, median of relative_error(b, a) over every sample's states; bit-equal count."""
    errs, equal = [], 0
    for sid, states in a.items():
        for name in STATES:
            errs.append(relative_error(b[sid][name], states[name]))
            equal += bool(torch.equal(b[sid][name], states[name]))
    errs.sort()
    n = len(errs)
    return {
        "n": n,
        "bit_equal": equal,
        "max": errs[-1],
        "p99": errs[min(n - 1, max(0, -(-99 * n // 100) - 1))],  # nearest rank
        "median": errs[n // 2] if n % 2 else (errs[n // 2 - 1] + errs[n // 2]) / 2,
        "min": errs[0],
    }


def rebuild_in_new_process(
    args: argparse.Namespace, model: Path, dtype: str, batches: list[list[Sample]], work: Path
) -> dict[str, dict[str, torch.Tensor]]:
    """Every batch rebuilt (its members in their order: the same padding and shape) and run in a
    fresh process of this script (--child), each batch alone, the last first: sample id -> states."""
    job = work / f"rebuild-{dtype}.pt"
    out = work / f"rebuilt-{dtype}.pt"
    torch.save(
        {
            "model": str(model),
            "dtype": DTYPES[dtype],
            "device": args.device,
            "layers": default_layer_ids(args.layers) if args.model is None else None,
            "batches": [[(s.sample_id, s.input_ids, s.loss_mask) for s in b] for b in reversed(batches)],
        },
        job,
    )
    subprocess.run([sys.executable, __file__, "--child", str(job), str(out)], check=True)
    return torch.load(out, weights_only=True)


def child(job_path: str, out_path: str) -> int:
    """The rebuild's process: load the model, run each batch of the job file, save the states."""
    job = torch.load(job_path, weights_only=True)
    backend = HFBackend(job["model"], job["layers"], dtype=job["dtype"], device=job["device"])
    if job["layers"] is None:
        backend.set_layers(default_layer_ids(backend.num_layers))
    batches = [[Sample(sid, ids, mask) for sid, ids, mask in b] for b in job["batches"]]
    torch.save(run(backend, batches), out_path)
    backend.close()
    return 0


def perturb(backend: HFBackend, scale: float, seed: int = 1) -> None:
    """Every weight of the loaded model times (1 + scale x N(0,1)), seeded."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for p in backend.model.parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.device)
            p.mul_((1 + scale * noise).to(p.dtype))


def measure(
    args: argparse.Namespace, model: Path, samples: list[Sample], dtype: str, work: Path
) -> dict[str, dict]:
    layers = default_layer_ids(args.layers) if args.model is None else None
    backend = HFBackend(model, layers, dtype=DTYPES[dtype], device=args.device)
    if layers is None:
        backend.set_layers(default_layer_ids(backend.num_layers))
    batches = plan_batches(samples, args.batch)
    ref = run(backend, batches)
    found = {
        "same batch": distribution(ref, run(backend, batches)),
    }
    if args.rebuild:
        found["rebuilt batch"] = distribution(ref, rebuild_in_new_process(args, model, dtype, batches, work))
    found[f"batch {args.batch} vs 1"] = distribution(ref, run(backend, [[s] for s in samples]))
    if backend.device.type == "cpu" and torch.get_num_threads() > 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            found[f"threads 1 vs {threads}"] = distribution(ref, run(backend, batches))
        finally:
            torch.set_num_threads(threads)
    if args.perturb:
        perturb(backend, args.perturb)
        found[f"perturbed {args.perturb:g}"] = distribution(ref, run(backend, batches))
    backend.close()
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1")
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--batch", type=int, default=8, help="the job's batch size (compared with 1)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--hidden", type=int, default=64, help="hidden size of the built tiny target")
    p.add_argument("--layers", type=int, default=8, help="decoder layers of the built tiny target")
    p.add_argument("--model", help="a model directory instead of the built tiny target")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--perturb", type=float, default=0.01, help="relative weight noise to show (0: skip)")
    p.add_argument("--seed", type=int, default=7, help="the tiny dataset's seed")
    p.add_argument(
        "--no-rebuild", dest="rebuild", action="store_false", help="skip the rebuilt batches (a process per dtype)"
    )
    p.add_argument("--child", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(*args.child)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPES:
            p.error(f"--dtypes: {d!r} is not one of {', '.join(DTYPES)}")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hsx-canary-bench-") as tmp:
        model = Path(args.model) if args.model else build_tiny_model(
            Path(tmp) / "model", seed=0, hidden=args.hidden, layers=args.layers
        )
        data = write_tiny_dataset(Path(tmp) / "d.jsonl", args.samples, seed=args.seed)
        tok = ChatTokenizer(load_tokenizer(model), args.max_length)
        samples = [tok.encode(c) for c in read_conversations(data, scan_dataset(data).entries)]
        results = {d: measure(args, model, samples, d, Path(tmp)) for d in dtypes}
    lengths = sorted(int(s.input_ids.numel()) for s in samples)
    device = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else (
        platform.processor() or platform.machine()
    )
    print(f"{len(samples)} samples ({lengths[0]}-{lengths[-1]} tokens), {args.device} ({device}), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; relative error max|a-b|/max|a| per tensor")
    for dtype, found in results.items():
        for name, d in found.items():
            print(f"  {dtype:9} {name:18} max {d['max']:.3g}  p99 {d['p99']:.3g}  median {d['median']:.3g}  "
                  f"min {d['min']:.3g}  bit-equal {d['bit_equal']}/{d['n']}")
    summary = {
        "bench": "canary_tolerance",
        "device": args.device,
        "device_name": device,
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "samples": len(samples),
        "batch": args.batch,
        "model": "tiny" if not args.model else os.path.basename(os.path.abspath(args.model)),
        "hidden": args.hidden if not args.model else None,
        "seconds": round(time.monotonic() - t0, 1),
        "results": results,
    }
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
