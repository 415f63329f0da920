"""The sglang path's samples/s beside the hf backend's, on one tiny model and this machine (one run).

The real SGLang 0.5.23 server on the CPU (tests/sglang_cpu/server.py, patched with `hsx patch apply
--model`, reverted at the end) and `hsx extract --backend sglang` against it; then `hsx extract`
(hf backend, in-process transformers) on the same model, dataset and layers. Printed as JSON: each
run's samples/s and tokens/s from its status.json (the runner's own rate, model load and server
start excluded), its command's wall time, and the ratio sglang / hf.

    .venv/bin/python tests/sglang_cpu/bench_path.py [--arch llama] [--samples 256] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from install import default_venv  # noqa: E402
from server import CPUServer  # noqa: E402

HSX = str(REPO / ".venv" / "bin" / "hsx")


def hsx(*args: str) -> float:
    """Run `hsx ARGS` (fails loudly); its wall time in seconds."""
    t0 = time.monotonic()
    subprocess.run([HSX, *args], check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True)
    return time.monotonic() - t0


def rates(out: Path, wall: float) -> dict[str, float]:
    status = json.loads((out / "status.json").read_text())
    assert status["done"] == status["total"], status
    return {
        "samples_per_s": round(status["samples_per_s"], 2),
        "tokens_per_s": round(status["tokens_per_s"], 1),
        "wall_s": round(wall, 1),
    }


def main(argv: list[str] | None = None) -> int:
    from extraction.testbed.tiny import write_tiny_dataset
    from extraction.testbed.tiny_dense import CAPTURE_LAYERS, build_tiny_dense

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="llama", choices=("llama", "qwen2"))
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--work", default=None, help="a directory to keep (default: a temporary one)")
    args = ap.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="hsx-bench-sglang-cpu-"))
    work.mkdir(parents=True, exist_ok=True)
    work.chmod(0o700)
    model = build_tiny_dense(args.arch, work / f"tiny-{args.arch}")
    dataset = write_tiny_dataset(work / "data.jsonl", args.samples, seed=11)
    layers = ",".join(map(str, CAPTURE_LAYERS))
    common = [
        "--model",
        str(model),
        "--dataset",
        str(dataset),
        "--layers",
        layers,
        "--progress",
        "off",
        "--reserve-bytes",
        "16M",
    ]
    venv = str(default_venv())
    dumps = work / "dumps"
    dumps.mkdir(mode=0o700, exist_ok=True)
    hsx("patch", "apply", "--sglang", venv, "--model", str(model), "--no-backup")
    try:
        srv = CPUServer(model, log_path=work / "server.log", dump_dir=str(dumps), dump_layers=layers)
        with srv:
            wall = hsx(
                "extract",
                *common,
                "--output",
                str(work / "sglang"),
                "--backend",
                "sglang",
                "--server-url",
                srv.url,
                "--dump-dir",
                str(dumps),
                "--concurrency",
                "8",
            )
        sglang = dict(rates(work / "sglang", wall), server_start_s=round(srv.start_seconds, 1))
    finally:
        hsx("patch", "revert", "--sglang", venv, "--model", str(model), "--no-backup")
    hf = rates(work / "hf", hsx("extract", *common, "--output", str(work / "hf")))
    ratio = round(sglang["samples_per_s"] / hf["samples_per_s"], 2)
    print(
        json.dumps(
            {
                "arch": args.arch,
                "samples": args.samples,
                "sglang": sglang,
                "hf": hf,
                "sglang_over_hf": ratio,
                "work": str(work),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
