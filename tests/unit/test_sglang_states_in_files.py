"""States stay in the dump files and go into the shard from there (#38's way back, #49 item 6).

The client never reads the states into memory (nor maps them): they are FileBytes over the dump's
descriptor, copied into the shard by the writer through a small buffer, CRC32 taken on the way
(extraction/shards/filebytes.py). NaN/Inf (extraction/sglang/dump_states.py): the hook's header
field (hsx_dump_format.FINITE_FIELD) is taken as said, `false` refused, and a header without it
has every value checked as it is copied. Real dump files written by the hook's own writer, real
shards, read back by `hsx verify`.
"""

from __future__ import annotations

import os

import pytest
import torch
from shard_helpers import H, K, manifest

from extraction.publish.publisher import Item
from extraction.sglang import dump_memory, dumps, hook, hsx_dump_format
from extraction.shards import ShardWriter
from extraction.shards.filebytes import FileBytes, NonFiniteBytes, first_nonfinite, in_memory
from extraction.shards.verify import verify_output
from extraction.shards.writer import ShardDataError
from hsx.index import read_index
from hsx.layout import KEY_AUX, KEY_HIDDEN

RID = "hsx-c0ffee00-s_000-0"
LAYERS = [1, 3, 4]



def _item(got) -> Item:
    """The publisher's item for a read request, as the client makes it (its `finite` the hook's word)."""
    return Item("s0", got.input_ids, torch.ones_like(got.input_ids), got.hidden_state, got.aux_hidden_state,
                got.finite)

def _header(offset: int, rows: int, **extra) -> dict:
    return {
        "format": hsx_dump_format.FORMAT,
        "rid": RID,
        "offset": offset,
        "seq_len": offset + rows,
        "layer_ids": LAYERS,
        "capture_owner": hook.OWNER_HOOK,
        "sglang_version": "0.5.23",
        **extra,
    }


def _states(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (rows,), generator=g)
    hidden = torch.randn(rows, H, generator=g).to(torch.bfloat16)
    return ids, hidden, [torch.randn(rows, H, generator=g).to(torch.bfloat16) for _ in range(K)]


def _dump(
    directory, pieces: list[tuple[int, int]], **extra
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Write the request's pieces ((offset, rows) each) as the hook does; the states written."""
    written = []
    for offset, rows in pieces:
        ids, hidden, parts = _states(rows, seed=offset)
        path = os.path.join(directory, hsx_dump_format.dump_name(RID, offset))
        hsx_dump_format.write_dump(path, _header(offset, rows, **extra), (ids, hidden, parts))
        written.append((ids, hidden, torch.cat(parts, dim=-1)))
    return written


def _publish(root, sample_id: str, dump: dumps.RequestDump) -> bytes:
    writer = ShardWriter(root, manifest(), check_finite=False)
    entry = writer.publish(
        sample_id, dump.input_ids, torch.ones_like(dump.input_ids), dump.hidden_state, dump.aux_hidden_state
    )
    writer.close()
    assert read_index(str(root)).entries[sample_id] == entry
    return (root / entry.path).read_bytes()


def _maps() -> str:
    with open("/proc/self/maps", encoding="utf-8") as f:
        return f.read()


def test_states_left_in_the_files_give_the_pread_paths_shard_byte_for_byte(tmp_path):
    """A chunked request (two pieces) the hook found finite: its states are FileBytes (nothing read,
    nothing mapped); the shard written from them equals, byte for byte and in the index's
    checksum, the one written from the states read into memory (the path of older hooks)."""
    (tmp_path / "dumps").mkdir()
    written = _dump(tmp_path / "dumps", [(0, 5), (5, 7)], finite=True)
    kept = dumps.read_request(str(tmp_path / "dumps"), RID, expected_len=12, states_in_files=True)
    read = dumps.read_request(str(tmp_path / "dumps"), RID, expected_len=12)
    assert (
        kept.finite is True and isinstance(kept.hidden_state, FileBytes) and len(kept.hidden_state.spans) == 2
    )
    assert isinstance(read.hidden_state, torch.Tensor)
    assert str(tmp_path / "dumps") not in _maps()
    dumps.remove_request(str(tmp_path / "dumps"), RID)  # the client unlinks them before publishing
    from_files = _publish(tmp_path / "from-files", "s0", kept)
    from_memory = _publish(tmp_path / "from-memory", "s0", read)
    assert from_files == from_memory
    shard = torch.load(tmp_path / "from-files" / read_index(str(tmp_path / "from-files")).entries["s0"].path)
    assert torch.equal(shard[KEY_HIDDEN][0], torch.cat([w[1] for w in written]))
    assert torch.equal(shard[KEY_AUX][0], torch.cat([w[2] for w in written]))
    report = verify_output(str(tmp_path / "from-files"), "deep")
    assert report.ok == 1 and not report.bad


@pytest.mark.parametrize("claim", [True, None], ids=["finite", "no-claim"])
def test_a_dump_that_shrinks_fails_its_sample_only_and_leaves_nothing(tmp_path, claim):
    """A short count under the copy (pread: no SIGBUS) is the sample's DumpError, on the copy the
    hook's claim leaves unchecked as on the checked one."""
    (tmp_path / "dumps").mkdir()
    _dump(tmp_path / "dumps", [(0, 9)], **({} if claim is None else {"finite": claim}))
    kept = dumps.read_request(str(tmp_path / "dumps"), RID, expected_len=9, states_in_files=True)
    assert kept.aux_hidden_state.check is (claim is None)
    path = tmp_path / "dumps" / hsx_dump_format.dump_name(RID, 0)
    os.truncate(path, path.stat().st_size - 100)  # someone shortens it under the client
    writer = ShardWriter(tmp_path / "out", manifest(), check_finite=False)
    ones = torch.ones_like(kept.input_ids)
    with pytest.raises(dumps.DumpError, match=r"shrank while being copied"):
        writer.publish("s0", kept.input_ids, ones, kept.hidden_state, kept.aux_hidden_state)
    assert [p for p in (tmp_path / "out").rglob("*") if p.is_file()] == [tmp_path / "out" / "run.json"]
    ids, hidden, parts = _states(9, seed=1)  # the next sample is written as ever
    writer.publish("s1", ids, ones, hidden, torch.cat(parts, dim=-1))
    assert list(read_index(str(tmp_path / "out")).entries) == ["s1"]


def _plant(path, at: int, value: bytes = b"\xc0\x7f") -> None:
    """Overwrite the bytes at `at` (default a bf16 NaN, 0x7FC0)."""
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(value)


@pytest.mark.parametrize("value", [b"\xc0\x7f", b"\x80\x7f", b"\x80\xff"], ids=["nan", "inf", "-inf"])
def test_without_the_hooks_claim_every_value_is_checked_as_it_is_copied(tmp_path, value):
    """A header without `finite` (a hook deployed before 2026-12-06) claims nothing: every value is
    checked as it is copied (extraction/sglang/dump_states.py), a NaN/Inf refused as a NaN always
    was (ShardDataError naming the tensor, the dump file and the byte), nothing of its shard left;
    the next sample is written as ever."""
    (tmp_path / "dumps").mkdir()
    _dump(tmp_path / "dumps", [(0, 6)])
    path = tmp_path / "dumps" / hsx_dump_format.dump_name(RID, 0)
    record = dumps._load(str(path), RID, states_in_files=True)
    at = record["aux_hidden_state"].spans[0][1] + 2 * (6 * H * K - 1)  # its very last value
    _plant(path, at, value)
    kept = dumps.read_request(str(tmp_path / "dumps"), RID, expected_len=6, states_in_files=True)
    assert (
        kept.finite is True and isinstance(kept.aux_hidden_state, FileBytes) and kept.aux_hidden_state.check
    )
    writer = ShardWriter(tmp_path / "out", manifest(), check_finite=False)
    ones = torch.ones_like(kept.input_ids)
    want = rf"sample 's0': {KEY_AUX} has NaN or Inf values: {path}: a NaN or Inf bfloat16 value at byte {at}$"
    with pytest.raises(ShardDataError, match=want):
        writer.publish("s0", kept.input_ids, ones, kept.hidden_state, kept.aux_hidden_state)
    assert [p for p in (tmp_path / "out").rglob("*") if p.is_file()] == [tmp_path / "out" / "run.json"]
    with pytest.raises(NonFiniteBytes, match=rf"at byte {at}$"):  # read into memory: the same check
        in_memory(kept.aux_hidden_state)
    ids, hidden, parts = _states(6, seed=1)
    writer.publish("s1", ids, ones, hidden, torch.cat(parts, dim=-1))
    assert list(read_index(str(tmp_path / "out")).entries) == ["s1"]


def test_the_hooks_finite_claim_is_taken_and_deep_verify_still_checks_the_values(tmp_path):
    """`finite: true` is the hook's check, made where the states are, on the bytes it writes: the
    client copies those states unchecked (dump_states.py says why that is safe). Were the claim
    wrong (a bug in the hook; nobody outside the server's account can rewrite a dump: here the
    test does), the NaN is still not unnoticed: `hsx verify --level deep` refuses the shard."""
    (tmp_path / "dumps").mkdir()
    _dump(tmp_path / "dumps", [(0, 6)], finite=True)
    path = tmp_path / "dumps" / hsx_dump_format.dump_name(RID, 0)
    kept = dumps.read_request(str(tmp_path / "dumps"), RID, expected_len=6, states_in_files=True)
    assert kept.finite is True and not kept.hidden_state.check and not kept.aux_hidden_state.check
    _plant(path, kept.hidden_state.spans[0][1] + 2 * 7)  # after the hook's check, behind its back
    _publish(tmp_path / "out", "s0", kept)
    report = verify_output(str(tmp_path / "out"), "deep")
    assert report.ok == 0 and "has NaN or Inf values" in str(report.bad)


def test_no_claim_is_checked_the_same_a_false_one_is_read_and_refused(tmp_path):
    """A header without the field (a hook deployed before 2026-12-06) leaves the states in the
    files too, checked as they are copied: the same shard as from memory, and its NaN refused
    when the states go through memory instead (a run in another dtype: the writer reads them).
    `false` (the hook found a NaN/Inf) is read into memory, `finite` False: the publisher refuses
    it on that word. Anything but a boolean is a DumpError."""
    (tmp_path / "dnone").mkdir()
    _dump(tmp_path / "dnone", [(0, 6)])
    kept = dumps.read_request(str(tmp_path / "dnone"), RID, expected_len=6, states_in_files=True)
    read = dumps.read_request(str(tmp_path / "dnone"), RID, expected_len=6)
    assert kept.finite is True and isinstance(kept.hidden_state, FileBytes) and kept.hidden_state.check
    assert read.finite is None and isinstance(read.hidden_state, torch.Tensor)
    assert _publish(tmp_path / "a", "s0", kept) == _publish(tmp_path / "b", "s0", read)
    path = tmp_path / "dnone" / hsx_dump_format.dump_name(RID, 0)
    _plant(path, kept.hidden_state.spans[0][1] + 10)
    writer = ShardWriter(tmp_path / "c", manifest(dtype="float32"), check_finite=False)
    with pytest.raises(ShardDataError, match=rf"{KEY_HIDDEN} has NaN or Inf values: {path}: .* at byte"):
        writer.publish(
            "s0", kept.input_ids, torch.ones(6, dtype=torch.long), *(kept.hidden_state, kept.aux_hidden_state)
        )
    (tmp_path / "dfalse").mkdir()
    _dump(tmp_path / "dfalse", [(0, 6)], finite=False)
    got = dumps.read_request(str(tmp_path / "dfalse"), RID, states_in_files=True)
    assert got.finite is False and isinstance(got.hidden_state, torch.Tensor)
    item = _item(got)
    assert item.nonfinite() == f"{KEY_HIDDEN} or {KEY_AUX}"  # refused on the hook's word alone
    (tmp_path / "dyes").mkdir()
    _dump(tmp_path / "dyes", [(0, 6)], finite="yes")
    with pytest.raises(dumps.DumpError, match=r"'finite' is 'yes', not true or false"):
        dumps.read_request(str(tmp_path / "dyes"), RID)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_first_nonfinite_finds_every_nan_and_inf_and_nothing_else(dtype):
    """The copy's check, by dtype: the largest finite values, subnormals and zeros of both signs
    pass; NaN, +Inf, -Inf are found at their index, anywhere in a chunk."""
    info = torch.finfo(dtype)
    edge = torch.tensor([info.max, -info.max, info.tiny / 2, -0.0, 0.0, info.min], dtype=dtype)
    t = torch.cat([edge, torch.randn(5000).to(dtype)])
    assert first_nonfinite(tensor_view(t), dtype) is None
    assert first_nonfinite(memoryview(b""), dtype) is None
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in (0, 17, t.numel() - 1):
            u = t.clone()
            u[where] = bad
            u[-1] = bad  # a second one after it: the first is named
            assert first_nonfinite(tensor_view(u), dtype) == where, (bad, where)


def tensor_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_the_hook_records_what_it_found(tmp_path, bad):
    """The hook's writer (CPU path: the check runs in the writer thread; on CUDA on the side
    stream, test_sglang_hook's fake-CUDA test) marks a piece with a NaN/Inf anywhere false."""
    model = type("M", (), {})()
    model.config = type("C", (), {"num_hidden_layers": 6})()
    model.layers_to_capture = []
    hk = hook.attach(model, {hook.ENV_DIR: str(tmp_path), hook.ENV_LAYERS: "1,3,4"})
    ids, hidden, parts = _states(4, seed=0)
    clean = hook._Piece("clean", 0, [hidden, ids, *parts])
    dirty_parts = [p.clone() for p in parts]
    dirty_parts[2][3, H - 1] = bad
    dirty = hook._Piece("dirty", 0, [hidden, ids, *dirty_parts])
    assert clean.all_finite() and not dirty.all_finite()
    job = hook._Pass([clean, dirty], 0, LAYERS, hook.OWNER_HOOK, "test")
    hk._write_pass(job)
    assert dumps._load(str(tmp_path / hsx_dump_format.dump_name("clean", 0)), "clean")["finite"] is True
    assert dumps._load(str(tmp_path / hsx_dump_format.dump_name("dirty", 0)), "dirty")["finite"] is False
    assert hsx_dump_format.rows_finite(hidden, dirty_parts).tolist() == [True, True, True, False]
    got = dumps.read_request(str(tmp_path), "dirty", expected_len=4, states_in_files=True)
    item = _item(got)
    assert item.nonfinite() == KEY_AUX  # the client's publisher refuses the sample, naming the tensor


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # a second close: EBADF
def test_a_piece_that_fails_after_its_header_closes_its_descriptor_once(tmp_path, monkeypatch):
    """A read error after the header (the input ids) fails that piece; its descriptor is closed
    exactly once: a second close, later, would close whatever file had got the number since (a
    shard's temp, the index)."""
    import gc

    (tmp_path / "dumps").mkdir()
    _dump(tmp_path / "dumps", [(0, 4)], finite=True)

    def failing_read(path, fd, specs, size):
        raise dumps.DumpError(f"{path}: unreadable dump: [Errno 5] Input/output error")

    monkeypatch.setattr(dump_memory, "read_tensors", failing_read)
    with pytest.raises(dumps.DumpError, match="Input/output error"):
        dumps.read_request(str(tmp_path / "dumps"), RID, expected_len=4, states_in_files=True)
    victim = os.open(tmp_path / "victim", os.O_CREAT | os.O_WRONLY, 0o600)  # most likely the freed number
    try:
        gc.collect()  # anything left holding the failed piece's descriptor is finalized now
        assert os.write(victim, b"still mine") == 10
    finally:
        os.close(victim)
