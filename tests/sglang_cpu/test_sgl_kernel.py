"""The CPU `sgl_kernel` stand-in against SGLang's own kernel: `assign_req_to_token_pool_cpu` must do
what the Triton kernel `assign_req_to_token_pool` (sglang 0.5.23, srt/mem_cache/allocation.py) does,
with the arguments in the order `assign_req_to_token_pool_func` passes them on the CPU. The
reference below is that kernel's loop written out in Python, program by program, block by block
(BLOCK_SIZE 32, masked loads and stores), on flat views as the kernel sees its pointers.

Runs in the project's venv (torch only; no SGLang needed):
    .venv/bin/pytest tests/sglang_cpu/test_sgl_kernel.py -q
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "hsx_sgl_kernel_standin", Path(__file__).with_name("sgl_kernel") / "__init__.py"
)
sgl_kernel = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sgl_kernel)


def triton_reference(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """`assign_req_to_token_pool[(batch_size,)]`, one program id at a time, as written in Triton."""
    BLOCK_SIZE = 32
    flat_pool = req_to_token.view(-1)  # the kernel's `req_to_token` pointer
    bs = req_pool_indices.numel()
    for pid in range(bs):  # tl.program_id(axis=0)
        kv_start = int(start_offset[pid])
        kv_end = int(end_offset[pid])
        token_pool = int(req_pool_indices[pid]) * pool_len
        # tl.sum(end - start) over length_offset < pid (masked loads give 0 elsewhere)
        out_offset = sum(int(end_offset[j]) - int(start_offset[j]) for j in range(pid))
        save_offset = [kv_start + i for i in range(BLOCK_SIZE)]
        load_offset = list(range(BLOCK_SIZE))
        num_loop = -(-(kv_end - kv_start) // BLOCK_SIZE)  # tl.cdiv
        for _ in range(max(num_loop, 0)):
            for s, ld in zip(save_offset, load_offset, strict=True):
                if s < kv_end:  # mask
                    flat_pool[token_pool + s] = out_cache_loc[out_offset + ld]
            save_offset = [s + BLOCK_SIZE for s in save_offset]
            load_offset = [ld + BLOCK_SIZE for ld in load_offset]


def _case(rng: random.Random, pool_rows: int, pool_len: int, bs: int):
    rows = rng.sample(range(pool_rows), bs)
    starts, ends = [], []
    for _ in range(bs):
        start = rng.randint(0, pool_len - 1)
        end = rng.choice([start, rng.randint(start, pool_len)])  # some requests add nothing
        starts.append(start)
        ends.append(end)
    total = sum(e - s for s, e in zip(starts, ends, strict=True))
    out_cache_loc = torch.tensor(rng.sample(range(1, 10 * pool_rows * pool_len), total), dtype=torch.int64)
    req_to_token = torch.full((pool_rows, pool_len), -7, dtype=torch.int32)
    args = (
        torch.tensor(rows, dtype=torch.int64),
        req_to_token,
        torch.tensor(starts, dtype=torch.int64),
        torch.tensor(ends, dtype=torch.int64),
        out_cache_loc,
        pool_len,
    )
    return args


@pytest.mark.parametrize("seed", range(12))
def test_assign_matches_the_triton_kernel(seed):
    rng = random.Random(seed)
    pool_len = rng.choice([1, 31, 32, 33, 100, 257])
    pool_rows = rng.randint(1, 9)
    args = _case(rng, pool_rows, pool_len, rng.randint(1, pool_rows))
    want = args[1].clone()
    triton_reference(args[0], want, *args[2:])
    sgl_kernel.assign_req_to_token_pool_cpu(*args)
    assert torch.equal(args[1], want)
    assert args[1].dtype == torch.int32


def test_assign_writes_the_slots_in_order():
    """Chunked prefill's second piece: request row 3 keeps its slots 0..4, gets 5..7; row 0 gets 0..1."""
    pool = torch.zeros((4, 10), dtype=torch.int32)
    pool[3, :5] = torch.arange(100, 105, dtype=torch.int32)
    out = torch.tensor([7, 8, 9, 20, 21])
    sgl_kernel.assign_req_to_token_pool_cpu(
        torch.tensor([3, 0]), pool, torch.tensor([5, 0]), torch.tensor([8, 2]), out, 10
    )
    assert pool[3].tolist() == [100, 101, 102, 103, 104, 7, 8, 9, 0, 0]
    assert pool[0].tolist() == [20, 21] + [0] * 8
    assert not pool[1:3].any()


def test_assign_refuses_what_the_kernel_would_read_out_of_bounds():
    pool = torch.zeros((2, 4), dtype=torch.int32)
    with pytest.raises(ValueError, match="outside"):
        sgl_kernel.assign_req_to_token_pool_cpu(
            torch.tensor([0]), pool, torch.tensor([2]), torch.tensor([6]), torch.arange(4), 4
        )
    with pytest.raises(ValueError, match="out_cache_loc holds 1"):
        sgl_kernel.assign_req_to_token_pool_cpu(
            torch.tensor([0]), pool, torch.tensor([0]), torch.tensor([3]), torch.arange(1), 4
        )
    assert not pool.any()


@pytest.mark.parametrize("name", sgl_kernel.NOT_IMPLEMENTED)
def test_other_names_raise_naming_themselves(name):
    with pytest.raises(NotImplementedError, match=rf"sgl_kernel\.{name}:"):
        getattr(sgl_kernel, name)(torch.zeros(1))


def test_no_torch_ops_registered():
    """SGLang turns its AMX backend on only when torch.ops.sgl_kernel.convert_weight_packed exists."""
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")
