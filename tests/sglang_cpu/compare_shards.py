"""The sglang backend's shards against the hf backend's shards of the same model and dataset.

    python compare_shards.py SGLANG_OUT HF_OUT [--samples N] [--longer-than T]

One place for the comparison and its tolerance: tests/integration/test_sglang_cpu.py imports it,
the molecule scenario sglang_server (the real server in a lab host) runs it on the host with the
extraction venv's Python (torch and the hsx package, nothing else). Contract, for every sample of
HF_OUT (the same sample ids in both, N of them when --samples is given):
- input_ids and loss_mask (every non-float tensor) bit-equal;
- every float tensor (hidden_state and each captured layer of the concatenated aux state, one
  hidden size each) of the same shape and dtype, with max|a - b| <= BF16_TOL * max|b|;
- with --longer-than T, at least one sample longer than T tokens (the run really had a request the
  server prefilled in pieces of T: --chunked-prefill-size).
Prints one JSON line (how many tensors of each kind came out bit-equal, the worst relative
difference, the longest sample) and exits 0; a failed check raises AssertionError naming the
sample and tensor (exit 1); a missing or unreadable output is the index reader's error (exit 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from hsx.index import load_index

# The sglang and hf states of one sample: max |a - b| <= BF16_TOL * max |b| per tensor (hidden
# state and each captured layer). Both are bf16 forwards of one checkpoint by different kernels
# (SGLang's torch-native layers and attention vs transformers'); bf16 has 8 bits of mantissa, so
# one rounding step is 2**-8 (0.4%) of a value; the tiny models' differences stay within a few.
BF16_TOL = 3e-2


def compare(got: Path, want: Path, samples: int | None = None, longer_than: int | None = None) -> dict:
    """Every shard of `got` against `want`'s (the contract above); the figures."""
    mine, ref = load_index(str(got)), load_index(str(want))
    assert set(mine) == set(ref), f"sample ids differ: {sorted(set(mine) ^ set(ref))[:6]}"
    assert samples is None or len(ref) == samples, f"{len(ref)} samples in {want}, not {samples}"
    equal: dict[str, int] = {}
    worst, longest = 0.0, 0
    for sample_id, entry in ref.items():
        a = torch.load(Path(got) / mine[sample_id].path, weights_only=True)
        b = torch.load(Path(want) / entry.path, weights_only=True)
        assert a.keys() == b.keys(), (sample_id, sorted(a), sorted(b))
        longest = max(longest, b["input_ids"].shape[-1])
        for key in b:
            if not b[key].is_floating_point():
                assert torch.equal(a[key], b[key]), (sample_id, key)
                continue
            assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype, (
                sample_id, key, a[key].shape, b[key].shape, a[key].dtype, b[key].dtype)
            parts = b[key].shape[-1] // b["hidden_state"].shape[-1]
            for i, (x, y) in enumerate(
                zip(a[key].float().chunk(parts, -1), b[key].float().chunk(parts, -1), strict=True)
            ):
                name = f"{key}[{i}]" if parts > 1 else key
                rel = ((x - y).abs().max() / y.abs().max()).item()
                worst = max(worst, rel)
                assert rel <= BF16_TOL, f"{sample_id} {name}: max|a-b|/max|b| = {rel:.4f} > {BF16_TOL}"
                equal[name] = equal.get(name, 0) + int(torch.equal(x, y))
    assert longer_than is None or longest > longer_than, (
        f"no sample is longer than {longer_than} tokens (longest {longest}): nothing was prefilled in pieces")
    return {"samples": len(ref), "bit_equal": equal, "worst_rel": round(worst, 4), "longest": longest,
            "tolerance": BF16_TOL}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sglang_out", type=Path)
    ap.add_argument("hf_out", type=Path)
    ap.add_argument("--samples", type=int)
    ap.add_argument("--longer-than", type=int)
    args = ap.parse_args(argv)
    print("COMPARE " + json.dumps(compare(args.sglang_out, args.hf_out, args.samples, args.longer_than)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
