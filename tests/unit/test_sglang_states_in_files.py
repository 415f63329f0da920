"""States the hook found finite stay in the dump files and go into the shard from there (#38's way back).

The hook records each piece's finiteness in the dump's header (hsx_dump_format.FINITE_FIELD); the
client then never reads those states into memory (nor maps them): they are FileBytes over the
dump's descriptor, copied into the shard by the writer through a small buffer, CRC32 taken on the
way (extraction/shards/filebytes.py). Real dump files written by the hook's own writer, real
shards, read back by `hsx verify`.
"""

from __future__ import annotations

import os

import pytest
import torch
from shard_helpers import H, K, manifest

from extraction.sglang import dumps, hook, hsx_dump_format
from extraction.shards import ShardWriter
from extraction.shards.filebytes import FileBytes, in_memory
from extraction.shards.verify import verify_output
from hsx.index import read_index
from hsx.layout import KEY_AUX, KEY_HIDDEN

RID = "hsx-c0ffee00-s_000-0"
LAYERS = [1, 3, 4]


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


def test_a_dump_that_shrinks_fails_its_sample_only_and_leaves_nothing(tmp_path):
    (tmp_path / "dumps").mkdir()
    _dump(tmp_path / "dumps", [(0, 9)], finite=True)
    kept = dumps.read_request(str(tmp_path / "dumps"), RID, expected_len=9, states_in_files=True)
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


def test_a_finite_claim_is_the_servers_word_deep_verification_checks_it(tmp_path):
    """The trust rule (docs/security.md): only the server's account can create names in the dump
    directory (dump_dir_problem, at both ends), so `finite: true` is the server's word and the
    client does not check the values: a NaN under it reaches the shard, whose bytes and CRCs
    still agree (full passes); deep verification finds the NaN. `false`, a missing field or
    anything but a boolean is no claim: the states are read and the client checks them."""
    (tmp_path / "dumps").mkdir()
    _dump(tmp_path / "dumps", [(0, 6)], finite=True)
    path = tmp_path / "dumps" / hsx_dump_format.dump_name(RID, 0)
    record = dumps._load(str(path), RID)
    at = record["hidden_state"].spans[0][1]
    with open(path, "r+b") as f:  # a NaN (bf16 0x7FC0) where the header says finite
        f.seek(at)
        f.write(b"\xc0\x7f")
    kept = dumps.read_request(str(tmp_path / "dumps"), RID, expected_len=6, states_in_files=True)
    assert kept.finite is True and torch.isnan(in_memory(kept.hidden_state)).any()
    _publish(tmp_path / "out", "s0", kept)
    assert verify_output(str(tmp_path / "out"), "full").ok == 1
    deep = verify_output(str(tmp_path / "out"), "deep")
    assert [b.reason for b in deep.bad] == [f"{KEY_HIDDEN} has NaN or Inf values"]

    for claim in (False, None):
        (tmp_path / f"d{claim}").mkdir()
        _dump(tmp_path / f"d{claim}", [(0, 6)], **({} if claim is None else {"finite": claim}))
        got = dumps.read_request(str(tmp_path / f"d{claim}"), RID, states_in_files=True)
        assert got.finite is None and isinstance(got.hidden_state, torch.Tensor), claim
    (tmp_path / "dyes").mkdir()
    _dump(tmp_path / "dyes", [(0, 6)], finite="yes")
    with pytest.raises(dumps.DumpError, match=r"'finite' is 'yes', not true or false"):
        dumps.read_request(str(tmp_path / "dyes"), RID)


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

    monkeypatch.setattr(dumps, "_read_tensors", failing_read)
    with pytest.raises(dumps.DumpError, match="Input/output error"):
        dumps.read_request(str(tmp_path / "dumps"), RID, expected_len=4, states_in_files=True)
    victim = os.open(tmp_path / "victim", os.O_CREAT | os.O_WRONLY, 0o600)  # most likely the freed number
    try:
        gc.collect()  # anything left holding the failed piece's descriptor is finalized now
        assert os.write(victim, b"still mine") == 10
    finally:
        os.close(victim)
