"""The in-memory path: a dump's tensors read with pread into memory the client owns.

Which tensors take it: a piece's input ids always (small: the client compares them with the ids
it sent); its states only where they cannot stay in the file (extraction/sglang/dump_states.py):
the hook's header says it found a NaN/Inf (`finite: false`: read so that the publisher's check
refuses them, naming the sample), the caller did not ask for states in files, or one piece of a
request was read (then all are, joined with torch.cat). Format 1 dumps are torch.load'ed
(dump_piece.py), not read here.

Contract:
- `read_tensors(path, fd, specs, size)`: {name: tensor} for specs {name: (dtype, shape, at)}, the
  tensors laid out from the smallest `at` up to byte `size`, read with pread (never a mapping)
  into one buffer of ours, each a view of it. A file that ends before `size` (it shrank since it
  was opened) or a read error is a DumpError naming the file and the byte, never a SIGBUS.
- `read_unchecked(t)`: a tensor as it is; FileBytes read into memory without their NaN/Inf check
  (the publisher checks what is in memory, naming the sample and the tensor).
- `join(parts)`: the pieces' tensors in row order, one tensor (torch.cat; a single piece as it is).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import replace

import torch

from extraction.sglang.dump_errors import DumpError
from extraction.shards.filebytes import FileBytes


def nbytes(dtype: torch.dtype, shape: list[int] | tuple[int, ...]) -> int:
    """The bytes of a C-contiguous tensor of `shape` x `dtype`."""
    n = torch.empty((), dtype=dtype).element_size()
    for d in shape:
        n *= d
    return n


def read_tensors(path: str, fd: int, specs: dict, size: int) -> dict[str, torch.Tensor]:
    """The tensors `specs` ({name: (dtype, shape, at)}, laid out up to byte `size`: the file's
    end, or where the states left in it start) read with pread into one buffer of ours, views of
    it. Never a mapping of the file: a dump that shrinks, or a disk read error (the fallback
    /data/hsx/dumps), is a DumpError here, not a SIGBUS later."""
    first = min(at for _dtype, _shape, at in specs.values())
    total = size - first
    buf = torch.empty(total, dtype=torch.uint8)
    view = memoryview((ctypes.c_ubyte * total).from_address(buf.data_ptr())).cast("B") if total else None
    done = 0
    while done < total:
        try:
            got = os.preadv(fd, [view[done:]], first + done)
        except OSError as exc:
            raise DumpError(f"{path}: read error at byte {first + done}: {exc}") from None
        if got == 0:
            raise DumpError(
                f"{path}: the file shrank to {first + done} bytes while being read ({size} when opened)"
            )
        done += got
    return {
        name: buf[at - first : at - first + nbytes(dtype, shape)].view(dtype).view(shape)
        for name, (dtype, shape, at) in specs.items()
    }


def read_unchecked(t: torch.Tensor | FileBytes) -> torch.Tensor:
    """`t` in memory; a FileBytes read without its NaN/Inf check (the publisher checks what is in
    memory, naming the sample and the tensor)."""
    return replace(t, check=False).read() if isinstance(t, FileBytes) else t


def join(parts: list[torch.Tensor | FileBytes]) -> torch.Tensor:
    """The pieces' tensors in memory, in row order (one copy more where there are several)."""
    tensors = [read_unchecked(p) for p in parts]
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
