"""torch.save's file layout for a shard, written directly: the same bytes, far less Python.

`torch.save` spends ~0.3 ms of Python per shard (pickling four tensors through torch's reducers,
plus its writer set-up) holding the GIL that the forward pass needs, and it CRCs every record a
second time inside its C++ writer. A shard's layout is fixed (a dict of four tensors in a zip of
64-byte-aligned stored records), so `TorchZipLayout` lays out exactly the bytes torch.save would
write: the protocol-2 pickle emitted opcode by opcode, the zip headers packed with struct, the
tensors' bytes handed to `os.writev` straight from their (pinned) host memory without a copy.
Each record's CRC32 comes from one pass over its bytes with the GIL released, and the whole
file's CRC32 (the index's checksum) is combined from them instead of read back.

Trust, but check: `learn_layout` saves a probe with this host's torch.save, takes the records
it writes (names, order, constant contents) from it, lays out a second probe itself and uses the
direct path only when every byte agrees (serialization id included). A torch that writes
anything differently gets torch.save, and the reason says why.
"""

from __future__ import annotations

import ctypes
import io
import os
import struct
import zlib
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from extraction.shards.filebytes import FileBytes
from hsx.crc import active_crc32, crc32_combine
from hsx.layout import DTYPES, KEY_AUX, KEY_HIDDEN, KEY_INPUT_IDS, KEY_LOSS_MASK
from hsx.ziprecords import ShardReader, read_zip_records

_ALIGN = 64  # torch aligns every record's data to 64 bytes ("FB" padding in the local extra field)
_U32 = 0xFFFFFFFF
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_DESCRIPTOR = struct.Struct("<IIII")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")
_FLAGS = 0x0808  # data descriptor follows the data; UTF-8 names
_REBUILD = ("torch._utils", "_rebuild_tensor_v2")
_ID_RECORD = ".data/serialization_id"
_MASK64 = (1 << 64) - 1


def pickle_int(n: int) -> bytes:
    """An int as protocol 2 pickles it (BININT1, BININT2, BININT or LONG1)."""
    if 0 <= n <= 0xFF:
        return b"K" + bytes((n,))
    if 0 <= n <= 0xFFFF:
        return b"M" + struct.pack("<H", n)
    if -0x80000000 <= n <= 0x7FFFFFFF:
        return b"J" + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes((len(raw),)) + raw


class _Pickler:
    """Protocol-2 opcodes with Python's memo numbering: the subset a dict of tensors needs."""

    def __init__(self) -> None:
        self.out: list[bytes] = [b"\x80\x02"]
        self.memo: dict[Any, int] = {}

    def put(self, key: Any = None) -> None:
        index = len(self.memo)
        self.memo[key if key is not None else ("#", index)] = index
        self.out.append(b"q" + bytes((index,)) if index < 256 else b"r" + struct.pack("<I", index))

    def get_or_put(self, key: Any, emit: bytes) -> None:
        index = self.memo.get(key)
        if index is None:
            self.out.append(emit)
            self.put(key)
        else:
            self.out.append(b"h" + bytes((index,)) if index < 256 else b"j" + struct.pack("<I", index))

    def text(self, s: str, shared: bool = False) -> None:
        raw = s.encode("utf-8")
        emit = b"X" + struct.pack("<I", len(raw)) + raw
        if shared:  # the same str object every time in torch's pickling: memoized once
            self.get_or_put(("str", s), emit)
        else:
            self.out.append(emit)
            self.put()

    def global_(self, module: str, name: str) -> None:
        self.get_or_put(("global", module, name), b"c" + f"{module}\n{name}\n".encode())

    def int_tuple(self, values: Sequence[int]) -> None:
        """A tuple of ints: TUPLE1-3 or MARK..TUPLE, memoized; the empty tuple is not."""
        if not values:
            self.out.append(b")")
            return
        body = b"".join(pickle_int(v) for v in values)
        end = (b"\x85", b"\x86", b"\x87")[len(values) - 1] if len(values) <= 3 else b"t"
        self.out.append(body + end if len(values) <= 3 else b"(" + body + end)
        self.put()


def tensor_dict_pickle(items: Sequence[tuple[str, str, str, tuple[int, ...]]]) -> bytes:
    """data.pkl of torch.save({key: tensor}) for contiguous CPU tensors that own their storage.

    items: (key, storage class name such as 'BFloat16Storage', storage key, shape) in dict order.
    """
    p = _Pickler()
    p.out.append(b"}")
    p.put()
    p.out.append(b"(")
    for key, storage_class, storage_key, shape in items:
        numel = 1
        for d in shape:
            numel *= d
        stride, acc = [], 1
        for d in reversed(shape):
            stride.append(acc)
            acc *= max(d, 1)
        p.text(key)
        p.global_(*_REBUILD)
        p.out.append(b"((")
        p.text("storage", shared=True)
        p.global_("torch", storage_class)
        p.text(storage_key)
        p.text("cpu", shared=True)
        p.out.append(pickle_int(numel) + b"t")
        p.put()
        p.out.append(b"Q" + pickle_int(0))
        p.int_tuple(shape)
        p.int_tuple(tuple(reversed(stride)))
        p.out.append(b"\x89")
        p.global_("collections", "OrderedDict")
        p.out.append(b")R")
        p.put()
        p.out.append(b"t")
        p.put()
        p.out.append(b"R")
        p.put()
    p.out.append(b"u.")
    return b"".join(p.out)


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64-bit size_t: how torch folds the record CRCs into the save id."""
    return seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _MASK64) + (seed >> 2)) & _MASK64)


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (the tensor must outlive the view)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


@dataclass(frozen=True)
class _Record:
    name: str  # without the archive prefix
    constant: bytes | None  # the bytes of a record torch writes the same every time


@dataclass
class Encoded:
    """One shard laid out: write `pieces` in order; `size` bytes with CRC32 `crc` in all."""

    pieces: list[Any]
    size: int
    crc: int


class TorchZipLayout:
    """The records one torch version writes for a dict of tensors, and how to lay them out."""

    def __init__(
        self,
        prefix: str,
        records: list[_Record],
        name_hash: str,
        crc32: Callable[..., int],
        combine: Callable[[int, int, int], int] | None,
    ):
        self.prefix = prefix
        self.records = records
        self.name_hash = name_hash  # first half of the save id: depends on the record names only
        self.crc32 = crc32
        self.combine = combine

    def encode(self, payload: dict[str, torch.Tensor]) -> Encoded:
        """The pieces of torch.save(payload)'s file; tensors must be contiguous CPU tensors."""
        pieces: list[Any] = []
        steps = self.steps(payload)
        crc: int | None = None
        try:
            while True:
                piece = steps.send(crc)
                if isinstance(piece, FileBytes):
                    raise TypeError("a FileBytes is copied while it is written (steps), not encoded")
                pieces.append(piece)
                crc = None if isinstance(piece, bytes) else self.crc32(piece)
        except StopIteration as stop:
            size, whole = stop.value
        return Encoded(pieces, size, whole)

    def steps(self, payload: dict[str, Any]) -> Generator[Any, int | None, tuple[int, int]]:
        """torch.save(payload)'s file as pieces, in order: bytes (send None back), and each
        tensor's data - a memoryview of a contiguous CPU tensor, or a FileBytes - whose CRC32 the
        caller sends back (encode computes it; the shard writer takes it while copying a FileBytes:
        the records after a tensor's data depend on it). Returns (size, CRC32 of the whole file)."""
        crc32, combine = self.crc32, self.combine
        items, buffers = [], {}
        for i, (key, t) in enumerate(payload.items()):
            storage = DTYPES[str(t.dtype).removeprefix("torch.")][0]
            items.append((key, storage, str(i), tuple(t.shape)))
            buffers[f"data/{i}"] = t if isinstance(t, FileBytes) else tensor_buffer(t)
        pickled = tensor_dict_pickle(items)
        small: list[bytes] = []  # bytes not yet handed out
        central: list[bytes] = []
        cursor = whole = save_id = 0

        def flush() -> Generator[bytes, int | None, None]:
            nonlocal whole
            if small:
                block = b"".join(small)
                whole = crc32(block, whole)
                small.clear()
                yield block

        for rec in self.records:
            if rec.name == _ID_RECORD:
                data: Any = f"{self.name_hash}{save_id:020d}".encode()
            elif rec.name == "data.pkl":
                data = pickled
            elif rec.constant is not None:
                data = rec.constant
            else:
                data = buffers.pop(rec.name, None)
                if data is None:
                    raise ValueError(f"the payload has no tensor for record {rec.name}")
            size = data.nbytes if isinstance(data, FileBytes) else len(data)
            if size >= _U32 or cursor >= _U32:
                raise ValueError("a record beyond 4 GiB needs zip64 headers: left to torch.save")
            name = (self.prefix + rec.name).encode()
            pad = -(cursor + _LOCAL.size + len(name) + 4) % _ALIGN
            header = _LOCAL.pack(0x04034B50, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(name), pad + 4)
            small += [header, name, b"FB", struct.pack("<H", pad), b"Z" * pad]
            data_offset = cursor + _LOCAL.size + len(name) + 4 + pad
            if isinstance(data, bytes):
                rec_crc = zlib.crc32(data)
                small.append(data)
            else:  # a tensor's bytes: CRC'd once (GIL released), written from where they are
                yield from flush()
                rec_crc = yield data
                if rec_crc is None:
                    raise ValueError(f"no CRC32 sent back for record {rec.name}")
                if combine is not None:
                    whole = combine(whole, rec_crc, size)
                elif isinstance(data, FileBytes):  # not in memory: no second pass to be had
                    whole = crc32_combine(whole, rec_crc, size)
                else:  # without a C crc32_combine (zlib only) a second pass beats Python's (~80 us)
                    whole = crc32(data, whole)
            small.append(_DESCRIPTOR.pack(0x08074B50, rec_crc, size, size))
            central.append(
                _CENTRAL.pack(
                    0x02014B50, 0, 0, _FLAGS, 0, 0, 0, rec_crc, size, size, len(name), 0, 0, 0, 0, 0, cursor
                )
                + name
            )
            cursor = data_offset + size + _DESCRIPTOR.size
            if rec.name != _ID_RECORD:
                save_id = _hash_combine(save_id, rec_crc)
        if buffers:
            raise ValueError(f"tensors without a record in this layout: {sorted(buffers)}")
        cd = b"".join(central)
        n = len(central)
        zip64_at = cursor + len(cd)
        small += [
            cd,
            _ZIP64_END.pack(0x06064B50, 44, 0x031E, 0x2D, 0, 0, n, n, len(cd), cursor),
            _ZIP64_LOCATOR.pack(0x07064B50, 0, zip64_at, 1),
            _END.pack(0x06054B50, 0, 0, n, n, len(cd), cursor, 0),
        ]
        yield from flush()
        return zip64_at + _ZIP64_END.size + _ZIP64_LOCATOR.size + _END.size, whole

    def to_bytes(self, payload: dict[str, torch.Tensor]) -> bytes:
        return b"".join(bytes(p) for p in self.encode(payload).pieces)


def _probe(dtype: torch.dtype, length: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(length)
    hidden = 3
    return {
        KEY_INPUT_IDS: torch.randint(0, 1000, (length,), generator=g),
        KEY_LOSS_MASK: torch.randint(0, 2, (length,), generator=g),
        KEY_HIDDEN: torch.randn(1, length, hidden, generator=g).to(dtype),
        KEY_AUX: torch.randn(1, length, 3 * hidden, generator=g).to(dtype),
    }


def _torch_save_bytes(payload: dict[str, torch.Tensor]) -> bytes:
    buf = io.BytesIO()
    torch.save(payload, buf)
    return buf.getvalue()


def learn_layout(dtype: torch.dtype) -> tuple[TorchZipLayout | None, str]:
    """(layout, how it was checked) when this host's torch.save is reproduced byte for byte;
    (None, why not) otherwise."""
    try:
        reference = _torch_save_bytes(_probe(dtype, 5))
        reader = ShardReader(-1, len(reference), reference)
        zrecords, _ = read_zip_records(reader)
        in_file_order = sorted(zrecords, key=lambda r: r.data_offset)
        prefix = in_file_order[0].name.split("/", 1)[0] + "/"
        records: list[_Record] = []
        name_hash = ""
        for rec in in_file_order:
            short = rec.name[len(prefix) :] if rec.name.startswith(prefix) else rec.name
            data = reference[rec.data_offset : rec.data_offset + rec.size]
            if short == _ID_RECORD:
                name_hash = data[:20].decode()
            is_variable = short in ("data.pkl", _ID_RECORD) or short.startswith("data/")
            records.append(_Record(short, None if is_variable else data))
        # The CRC32 the core chose (and checked against zlib) at import, as `full` uses it.
        layout = TorchZipLayout(prefix, records, name_hash, *active_crc32())
        for length in (5, 300):  # two lengths: a second int width, and the id is no copy
            payload = _probe(dtype, length)
            want = _torch_save_bytes(payload)
            enc = layout.encode(payload)
            got = b"".join(bytes(p) for p in enc.pieces)
            if got != want:
                at = next(
                    (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                    min(len(got), len(want)),
                )
                return None, f"torch {torch.__version__} writes byte {at} differently"
            if enc.size != len(want) or enc.crc != zlib.crc32(want):
                return None, "size or CRC32 bookkeeping disagrees"
        return layout, f"checked against torch {torch.__version__}'s torch.save"
    except Exception as e:  # any surprise in the probe: torch.save stays in charge
        return None, f"probe failed: {e}"


_LEARNED: dict[torch.dtype, tuple[TorchZipLayout | None, str]] = {}


def layout_for(dtype: torch.dtype) -> tuple[TorchZipLayout | None, str]:
    """learn_layout, once per process and dtype (os.environ HSX_SHARD_WRITER=torch turns it off)."""
    if os.environ.get("HSX_SHARD_WRITER", "").lower() == "torch":
        return None, "HSX_SHARD_WRITER=torch"
    if dtype not in _LEARNED:
        _LEARNED[dtype] = learn_layout(dtype)
    return _LEARNED[dtype]
