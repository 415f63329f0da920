"""The canary's measure: how far a state computed now is from the state a shard holds.

Contract:
- `relative_error(got, want)`: max |got - want| / max |want| over the whole tensor (one number per
  tensor: the worst element's difference, in units of the state's largest magnitude), computed in
  float32 (float64 for a float64 tensor): exact for bf16/fp16 values. 0.0 for equal tensors (also
  both all zero); inf when the shapes differ, `want` is all zero and `got` is not, or either holds
  a NaN or Inf (a shard never does: the runner refuses non-finite states).
- `compare_sample(sample_id, shard, got)`: one sample's verdict: input_ids and loss_mask must be
  equal (a sample tokenized differently is a mismatch whatever the states say), each state's
  relative error against `tolerance`, and whether each is bit-equal.

torch only (no runner, no hsx): tests/bench/bench_canary_tolerance.py imports it on a machine with
torch and transformers alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

STATES = ("hidden_state", "aux_hidden_state")

def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (see the module's contract)."""
    if tuple(got.shape) != tuple(want.shape):
        return float("inf")
    if want.numel() == 0:
        return 0.0
    wide = torch.float64 if torch.float64 in (got.dtype, want.dtype) else torch.float32
    a, b = got.to(wide), want.to(wide)
    diff = float((a - b).abs().max())
    scale = float(b.abs().max())
    if diff != diff or diff == float("inf"):  # NaN/Inf on either side (a shard never holds one)
        return float("inf")
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


@dataclass
class SampleCheck:
    """One canary sample's result."""

    sample_id: str
    num_tokens: int
    tokens_equal: bool  # input_ids and loss_mask equal to the shard's
    rel_error: dict[str, float] = field(default_factory=dict)  # per state
    bit_equal: dict[str, bool] = field(default_factory=dict)  # per state
    ok: bool = False
    why: str = ""  # what differs, for a sample that is not ok
    # how it was re-extracted (extraction/canary/rebuild.py): "batch" (its original batch rebuilt)
    # or "alone" (why_alone says why), and the bound its states were held to
    mode: str = "alone"
    why_alone: str = ""
    batch: str | None = None  # the batch's id (runner/batchlog.py)
    batch_line: int | None = None  # its line in batches.jsonl
    rows: int = 1  # samples in the forward it ran in
    width: int = 0  # the padded length of that forward
    tolerance: float | None = None

    @property
    def max_rel_error(self) -> float:
        return max(self.rel_error.values(), default=0.0 if self.tokens_equal else float("inf"))

    def to_dict(self) -> dict[str, object]:
        return {
            "id": self.sample_id,
            "num_tokens": self.num_tokens,
            "tokens_equal": self.tokens_equal,
            "rel_error": {k: _json_float(v) for k, v in self.rel_error.items()},
            "bit_equal": dict(self.bit_equal),
            "max_rel_error": _json_float(self.max_rel_error),
            "ok": self.ok,
            "why": self.why,
            "mode": self.mode,
            "why_alone": self.why_alone,
            "batch": self.batch,
            "batch_line": self.batch_line,
            "rows": self.rows,
            "width": self.width,
            "tolerance": self.tolerance,
        }


def _json_float(x: float) -> float | str:
    """A float JSON can hold: inf as the string "inf" (json.dumps would write Infinity)."""
    return x if x == x and x not in (float("inf"), float("-inf")) else str(x)


def compare_sample(
    sample_id: str,
    shard: dict[str, torch.Tensor],
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    states: dict[str, torch.Tensor],
    tolerance: float,
) -> SampleCheck:
    """`shard` (the four tensors as loaded) against what was computed now: `input_ids`/`loss_mask`
    from the tokenizer, `states` [L, X] per state name from the backend (see the module's contract)."""
    want_ids, want_mask = shard["input_ids"], shard["loss_mask"]
    tokens_equal = (
        tuple(input_ids.shape) == tuple(want_ids.shape)
        and bool(torch.equal(input_ids.cpu().to(want_ids.dtype), want_ids))
        and tuple(loss_mask.shape) == tuple(want_mask.shape)
        and bool(torch.equal(loss_mask.cpu().to(want_mask.dtype), want_mask))
    )
    check = SampleCheck(sample_id, int(want_ids.numel()), tokens_equal, tolerance=tolerance)
    if not tokens_equal:
        check.why = (
            f"input_ids/loss_mask differ from the shard's ({int(input_ids.numel())} tokens now, "
            f"{int(want_ids.numel())} in the shard): this node tokenizes the sample differently"
        )
        return check
    over = []
    for name in STATES:
        want = shard[name]
        want = want[0] if want.dim() == 3 else want  # the shard's [1, L, X]
        got = states[name]
        if got.dtype != want.dtype:
            check.rel_error[name] = float("inf")
            check.bit_equal[name] = False
            over.append(f"{name} is {got.dtype} now, {want.dtype} in the shard")
            continue
        err = relative_error(got, want)
        check.rel_error[name] = err
        check.bit_equal[name] = tuple(got.shape) == tuple(want.shape) and bool(torch.equal(got, want))
        if not err <= tolerance:
            over.append(f"{name} relative error {err:.3g} > tolerance {tolerance:g}")
    check.ok = not over
    check.why = "; ".join(over)
    return check
