"""torchzip: the shard's torch.save bytes laid out directly must equal torch.save's, byte for byte."""

from __future__ import annotations

import io
import pickle
import zlib

import pytest
import torch

from extraction.shards import torchzip
from hsx.layout import KEY_AUX, KEY_HIDDEN, KEY_INPUT_IDS, KEY_LOSS_MASK


def _payload(length: int, hidden: int, dtype: torch.dtype, k: int = 3, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        KEY_INPUT_IDS: torch.randint(0, 50_000, (length,), generator=g),
        KEY_LOSS_MASK: torch.randint(0, 2, (length,), generator=g),
        KEY_HIDDEN: torch.randn(1, length, hidden, generator=g).to(dtype),
        KEY_AUX: torch.randn(1, length, k * hidden, generator=g).to(dtype),
    }


def _torch_save(payload: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(payload, buf)
    return buf.getvalue()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "length,hidden,k",
    [(1, 1, 1), (2, 8, 3), (255, 1, 1), (256, 1, 1), (257, 4, 3), (300, 64, 4), (70_000, 1, 1), (5, 20_000, 3)],
)
def test_bytes_size_and_crc_equal_torch_save(dtype, length, hidden, k):
    # Lengths and element counts cross every int width the pickle uses (1, 2 and 4 bytes).
    layout, why = torchzip.layout_for(dtype)
    assert layout is not None, why
    payload = _payload(length, hidden, dtype, k)
    want = _torch_save(payload)
    encoded = layout.encode(payload)
    got = b"".join(bytes(p) for p in encoded.pieces)
    assert got == want
    assert encoded.size == len(want) and encoded.crc == zlib.crc32(want)
    assert all(isinstance(p, memoryview) for p in encoded.pieces[1::2])  # tensors are not copied


def test_tensor_pieces_are_the_tensors_memory():
    layout, _ = torchzip.layout_for(torch.bfloat16)
    payload = _payload(6, 4, torch.bfloat16)
    pieces = layout.encode(payload).pieces
    hidden = payload[KEY_HIDDEN]
    view = [p for p in pieces if isinstance(p, memoryview)][2]  # records in key order
    assert len(view) == hidden.numel() * 2
    hidden.view(-1)[0] = 7.0  # the piece sees the change: it is the tensor's memory, not a copy
    assert bytes(view[:2]) == hidden.view(torch.int16).view(-1)[:1].numpy().tobytes()


@pytest.mark.parametrize(
    "n", [0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**40, 2**63, -1, -256, -(2**31), -(2**31) - 1]
)
def test_ints_are_pickled_as_protocol_2_does(n):
    assert torchzip.pickle_int(n) == pickle.dumps(n, protocol=2)[2:-1]


def test_a_torch_that_writes_differently_is_not_imitated(monkeypatch):
    real = torchzip._torch_save_bytes
    calls = []

    def other_torch(payload):  # a different torch: its probe gets one more constant record
        calls.append(1)
        data = real(payload)
        return data if len(calls) == 1 else data.replace(b"little", b"LITTLE")

    monkeypatch.setattr(torchzip, "_torch_save_bytes", other_torch)
    layout, why = torchzip.learn_layout(torch.bfloat16)
    assert layout is None and "writes byte" in why


def test_an_unreadable_probe_says_why(monkeypatch):
    monkeypatch.setattr(torchzip, "_torch_save_bytes", lambda payload: b"not a zip")
    layout, why = torchzip.learn_layout(torch.float32)
    assert layout is None and why.startswith("probe failed")


def test_records_past_4_gib_are_refused(monkeypatch):
    # zip64 local headers are left to torch.save (the writer falls back on this ValueError).
    layout, _ = torchzip.layout_for(torch.float32)
    payload = _payload(2, 2, torch.float32)

    class Huge:  # a buffer that claims 4 GiB without allocating it
        def __len__(self):
            return 1 << 32

    original = torchzip.tensor_buffer
    monkeypatch.setattr(torchzip, "tensor_buffer", lambda t: Huge() if t is payload[KEY_AUX] else original(t))
    with pytest.raises(ValueError, match="4 GiB"):
        layout.encode(payload)


def test_without_a_crc32_combine_the_file_crc_is_still_right():
    # zlib has no crc32_combine in Python: the whole-file CRC then takes a second pass.
    layout, _ = torchzip.layout_for(torch.bfloat16)
    plain = torchzip.TorchZipLayout(layout.prefix, layout.records, layout.name_hash, zlib.crc32, None)
    payload = _payload(33, 16, torch.bfloat16)
    want = _torch_save(payload)
    encoded = plain.encode(payload)
    assert b"".join(bytes(p) for p in encoded.pieces) == want and encoded.crc == zlib.crc32(want)
