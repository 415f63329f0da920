"""Reading the hook's per-request dump files back: join chunked-prefill pieces, check for gaps.

A request's prompt may reach the model in several prefill pieces (chunked prefill); the hook writes
one file per piece, `<rid>.<offset>.pt`. A request is complete when its pieces cover 0..L with no
gap or overlap and all agree on layer ids, widths and dtype. Anything else is a DumpError naming the
file and the problem, so a bad dump never becomes a shard.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass

import torch

from extraction.sglang.hook import FORMAT, rid_stem

_KEYS = ("input_ids", "hidden_state", "aux_hidden_state")


class DumpError(ValueError):
    """A dump is missing, incomplete or inconsistent."""


@dataclass
class RequestDump:
    rid: str
    input_ids: torch.Tensor  # [L] int64
    hidden_state: torch.Tensor  # [L, H]
    aux_hidden_state: torch.Tensor  # [L, k*H]
    layer_ids: list[int]
    capture_owner: str
    sglang_version: str
    pieces: int


def piece_paths(directory: str, rid: str) -> list[str]:
    stem = rid_stem(rid)
    names = re.compile(re.escape(stem) + r"\.\d{9}\.pt")
    found = glob.glob(os.path.join(glob.escape(directory), glob.escape(stem) + ".*.pt"))
    return sorted(p for p in found if names.fullmatch(os.path.basename(p)))


def _load(path: str, rid: str) -> dict:
    try:
        record = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise DumpError(f"{path}: unreadable dump: {exc}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise DumpError(f"{path}: not a {FORMAT} dump")
    if record.get("rid") != rid:
        raise DumpError(f"{path}: holds request {record.get('rid')!r}, expected {rid!r}")
    n = int(record["input_ids"].shape[0])
    for key in _KEYS:
        t = record.get(key)
        if not isinstance(t, torch.Tensor) or int(t.shape[0]) != n:
            raise DumpError(f"{path}: {key} missing or not {n} rows")
    return record


def read_request(directory: str, rid: str, expected_len: int | None = None) -> RequestDump:
    """Join the pieces of one request; DumpError unless they cover 0..L exactly."""
    paths = piece_paths(directory, rid)
    if not paths:
        raise DumpError(f"no dump for request {rid!r} in {directory}")
    records = sorted(((_load(p, rid), p) for p in paths), key=lambda rp: int(rp[0]["offset"]))
    first, first_path = records[0]
    if int(first["offset"]) != 0:
        raise DumpError(
            f"{first_path}: request {rid!r} starts at token {first['offset']}, not 0 "
            "(prefix served from the radix cache? run SGLang with --disable-radix-cache)"
        )
    pos = 0
    for record, path in records:
        offset = int(record["offset"])
        n = int(record["input_ids"].shape[0])
        if offset != pos:
            what = "gap" if offset > pos else "overlap"
            raise DumpError(f"{path}: {what} in request {rid!r}: piece starts at {offset}, expected {pos}")
        for key in ("layer_ids", "capture_owner", "sglang_version"):
            if record[key] != first[key]:
                raise DumpError(
                    f"{path}: {key} {record[key]!r} differs from the first piece's {first[key]!r}"
                )
        for key in ("hidden_state", "aux_hidden_state"):
            a, b = record[key], first[key]
            if a.dtype != b.dtype or a.shape[1:] != b.shape[1:]:
                raise DumpError(
                    f"{path}: {key} is {a.dtype}{list(a.shape)}, first piece {b.dtype}{list(b.shape)}"
                )
        pos = offset + n
    if expected_len is not None and pos != expected_len:
        raise DumpError(f"request {rid!r}: dumps cover {pos} tokens, expected {expected_len}")
    hidden = int(first["hidden_state"].shape[-1])
    if int(first["aux_hidden_state"].shape[-1]) != hidden * len(first["layer_ids"]):
        raise DumpError(f"{first_path}: aux width does not match {len(first['layer_ids'])} layers x {hidden}")

    def cat(key: str) -> torch.Tensor:
        parts = [r[key] for r, _ in records]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    return RequestDump(
        rid=rid,
        input_ids=cat("input_ids"),
        hidden_state=cat("hidden_state"),
        aux_hidden_state=cat("aux_hidden_state"),
        layer_ids=[int(i) for i in first["layer_ids"]],
        capture_owner=str(first["capture_owner"]),
        sglang_version=str(first["sglang_version"]),
        pieces=len(records),
    )


def remove_request(directory: str, rid: str) -> int:
    """Delete a request's pieces (after it was read or abandoned); returns how many."""
    n = 0
    for path in piece_paths(directory, rid):
        try:
            os.unlink(path)
            n += 1
        except FileNotFoundError:
            pass
    return n
