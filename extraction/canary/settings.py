"""The canary's defaults, in one place (stdlib only: `hsx --help` reads them without torch).

DEFAULT_BATCH_TOLERANCE bounds a sample re-run in its original batch (0: bit-equal). DEFAULT_TOLERANCE
bounds compare.relative_error (max |a-b| / max |a| per state) by the run's dtype for a sample re-run
ALONE (no batch recorded: outputs written before OUTPUT/batches.jsonl, the sglang backend). From
measurement (docs/benchmarks.md, "Canary"; tests/bench/bench_canary_tolerance.py): the hf backend on
this project's CPU gave bit-equal states for the same batch twice in both dtypes, and a sample alone
vs in its batch of 8 differed by at most 3.7e-7 in float32 and not at all in bfloat16; on an H100
(../shared/DESIGN.md section 13) batch 8 vs 1 differed by up to 1.8e-2 in bfloat16. Every weight
perturbed by 1% moved every state by 6.3e-2 or more. The bounds sit between: float32 1e-4 (270x the
CPU's worst), bfloat16 and float16 3e-2 (1.7x the H100's worst, half the 1% perturbation's least).
"""

from __future__ import annotations

DEFAULT_SAMPLES = 2
# A sample re-run in its original batch (rebuilt from OUTPUT/batches.jsonl: the same rows, padding and
# shape) is held to this: bit-equal. The same batch twice gave bit-equal states on this project's CPU
# and on an H100 in float32 and bfloat16 (docs/benchmarks.md "Canary"); DEFAULT_TOLERANCE is for the
# samples that cannot be rebuilt (shards written before batch recording, the sglang backend).
DEFAULT_BATCH_TOLERANCE = 0.0
DEFAULT_TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 3e-2}


def tolerance_for(dtype: str) -> float:
    """The default bound for states of `dtype` (run.json's spelling: bfloat16, float16, float32)."""
    try:
        return DEFAULT_TOLERANCE[dtype]
    except KeyError:
        raise ValueError(f"no default canary tolerance for dtype {dtype!r}; give one (--tolerance)") from None


def describe_defaults() -> str:
    """'float32 0.0001, bfloat16 0.03, float16 0.03' (for help texts)."""
    return ", ".join(f"{k} {v:g}" for k, v in DEFAULT_TOLERANCE.items())
