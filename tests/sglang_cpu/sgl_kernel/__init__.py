"""TEST-ONLY stand-in for the `sgl_kernel` KERNEL LIBRARY (pure torch). It is not SGLang, and it
does not stand in for the server: the server that runs beside it is the released sglang 0.5.23.

Why it exists: SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1, --device cpu) imports a few names
from `sgl_kernel` at start-up. The only wheel of that library (`sglang-kernel` 0.4.10) is a CUDA
build that fails to load without libcuda.so.1, and no source distribution is on the index, so its
AMX/AVX-512 CPU extension cannot be built here. Without AMX, SGLang would not use that extension
anyway: RMSNorm, RoPE, SiluAndMul and the linear layers take torch-native paths and attention the
`torch_native` backend (../shared/DESIGN.md section 12). This package sits first on PYTHONPATH of
the server (tests/sglang_cpu/server.py puts it there).

What it provides:
- `assign_req_to_token_pool_cpu`, the one name SGLang calls on the prefill path
  (sglang/srt/mem_cache/allocation.py `assign_req_to_token_pool_func`), with the meaning and the
  argument order of SGLang's Triton kernel `assign_req_to_token_pool` in the same file.
- every other name SGLang's CPU engine imports at start-up (NOT_IMPLEMENTED), each raising
  NotImplementedError naming itself when called: all of them belong to paths extraction does not
  take (speculative decoding, the hierarchical cache), so a call is a test's failure, not a
  silent wrong answer.
- no `torch.ops.sgl_kernel` operators: SGLang takes the AMX backend only when
  `torch.ops.sgl_kernel.convert_weight_packed` exists (sglang/srt/utils/common.py
  `_is_intel_amx_backend_available`), so it stays off.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+hsx-cpu-standin"

# Imported by SGLang's CPU engine at start-up (module level), never called on the prefill path.
NOT_IMPLEMENTED = (
    "copy_all_layer_kv_cache_cpu",  # sglang/srt/mem_cache/cache_move.py (hierarchical cache)
    "assign_draft_cache_locs_contiguous_cpu",  # speculative decoding from here on
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
)


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For request i of the batch (row `req_pool_indices[i]` of `req_to_token`, rows `pool_len`
    long), write its new KV slots: `req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`
    = the next `end_offset[i] - start_offset[i]` entries of `out_cache_loc`, which holds the
    batch's slots request after request (request i's begin after the lengths of requests 0..i-1).
    In place; nothing returned. Refuses (ValueError) what the Triton kernel would read out of
    bounds: a span past `pool_len`, or more slots asked for than `out_cache_loc` holds."""
    if req_to_token.dim() != 2 or req_to_token.shape[1] != pool_len:
        raise ValueError(f"req_to_token is {list(req_to_token.shape)}, expected [*, {pool_len}]")
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    if not len(rows) == len(starts) == len(ends):
        raise ValueError(f"{len(rows)} requests, {len(starts)} starts, {len(ends)} ends")
    at = 0  # the Triton kernel's out_offset: the sum of end - start over the requests before
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        if n > 0:
            if start < 0 or end > pool_len:
                raise ValueError(f"slots [{start}, {end}) of request row {row} lie outside [0, {pool_len})")
            if at < 0 or at + n > out_cache_loc.numel():
                raise ValueError(
                    f"slots {at}..{at + n} asked for, out_cache_loc holds {out_cache_loc.numel()}"
                )
            req_to_token[row, start:end] = out_cache_loc[at : at + n].to(req_to_token.dtype)
        at += n


def _not_implemented(name: str):
    def call(*_args, **_kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: not provided by the CPU stand-in (tests/sglang_cpu/sgl_kernel); "
            "extraction's prefill path does not call it"
        )

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"Stand-in for sgl_kernel.{name}: raises NotImplementedError when called."
    return call


for _name in NOT_IMPLEMENTED:
    globals()[_name] = _not_implemented(_name)
del _name
