"""The `deep` level (needs torch) and the package-side entry point to verification.

`quick` and `full` live in the stdlib-only core (hsx.verify) so the Ansible module runs them on
hosts without torch; `deep` loads the tensors, so it lives here. It only ever runs on a file
that already passed `full`, so torch's loader never sees a pickle our restricted reader refused.
"""

from __future__ import annotations

from collections.abc import Callable

import hsx.verify
from hsx.layout import KEY_AUX, KEY_HIDDEN, KEY_INPUT_IDS, KEY_LOSS_MASK, SHARD_KEYS
from hsx.verify import Expect, ShardInfo, VerifyReport

_CHUNK_ELEMS = 1 << 24  # check finiteness in slices so a 2 GB tensor needs no 2 GB mask


def deep_check(path: str, expect: Expect, info: ShardInfo) -> str | None:
    """Load with mmap + weights_only and check values; returns a reason or None."""
    import torch  # here, not at the top: `quick` and `full` start without torch's ~2 s import

    try:
        data = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception as e:  # torch raises many types for a bad file; any of them means bad
        return f"torch.load failed: {type(e).__name__}: {e}"
    if not isinstance(data, dict) or set(data) != set(SHARD_KEYS):
        return f"loaded object is not the four-key shard dict (keys {sorted(data) if isinstance(data, dict) else type(data).__name__})"
    want_dtype = getattr(torch, expect.dtype)
    for key in (KEY_HIDDEN, KEY_AUX):
        t = data[key]
        if t.dtype != want_dtype:
            return f"{key} loads as {t.dtype}, run.json says {expect.dtype}"
        flat = t.reshape(-1)
        for start in range(0, flat.numel(), _CHUNK_ELEMS):
            if not bool(torch.isfinite(flat[start : start + _CHUNK_ELEMS]).all()):
                return f"{key} has NaN or Inf values"
    ids = data[KEY_INPUT_IDS]
    if ids.dtype != torch.int64:
        return f"input_ids loads as {ids.dtype}, expected torch.int64"
    if ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0:
            return f"input_ids has a negative id ({lo})"
        if expect.vocab_size is not None and hi >= expect.vocab_size:
            return f"input_ids has id {hi}, outside the vocabulary ({expect.vocab_size})"
    mask = data[KEY_LOSS_MASK]
    if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        return "loss_mask has values other than 0 and 1"
    return None


def verify_output(
    output_dir: str,
    level: str = "quick",
    *,
    quarantine: bool = False,
    check_mode: bool = False,
    workers: int = 1,
    progress: Callable[[int, int, int], None] | None = None,
    orphan_min_age: float = 600.0,
) -> VerifyReport:
    """hsx.verify.verify_output with the torch-based deep level plugged in."""
    return hsx.verify.verify_output(
        output_dir,
        level,
        quarantine=quarantine,
        check_mode=check_mode,
        workers=workers,
        deep_check=deep_check if level == "deep" else None,
        progress=progress,
        orphan_min_age=orphan_min_age,
    )
