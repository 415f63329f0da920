"""Verification of real shards under every corruption, reconciliation, quarantine and `hsx verify`."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch
from shard_helpers import (
    H,
    expect,
    flip,
    make_run,
    read_record,
    replace_record,
    save,
    shard_dict,
    tree,
)

from extraction.cli import main as hsx
from extraction.shards import ShardWriter
from extraction.shards.verify import deep_check, verify_output
from hsx import crc, ziprecords
from hsx.errors import ShardBad
from hsx.index import append_index, index_record, load_index
from hsx.layout import REASON_SUFFIX, shard_relpath, temp_name
from hsx.verify import check as check_module
from hsx.verify.check import LEVELS, check_shard
from hsx.ziprecords import ShardReader, read_zip_records


def check(path: Path, level: str = "quick", entry=None) -> str | None:
    """The reason a shard is bad, or None."""
    try:
        check_shard(str(path), expect(), level, entry, deep_check)
    except ShardBad as e:
        return str(e)
    return None


@pytest.fixture()
def good(tmp_path):
    _, (entry,) = make_run(tmp_path, n=1, length=5)
    return tmp_path / entry.path, entry


def test_good_shard_passes_every_level(good):
    path, entry = good
    for level in LEVELS:
        assert check(path, level, entry) is None


def test_truncation_at_every_offset_is_caught_by_quick(good):
    path, entry = good
    data = path.read_bytes()
    for cut in range(len(data)):
        cut_path = path.with_name(f"cut{cut}.pt")  # a new file each time: cheaper than truncating
        cut_path.write_bytes(data[:cut])
        assert check(cut_path, "quick", None) is not None, f"truncated at {cut} of {len(data)} passed"
    path.write_bytes(data + b"\0")
    assert check(path, "quick", None) is not None


def test_every_flipped_byte_is_caught_by_full_with_the_index(good):
    path, entry = good
    data = path.read_bytes()
    with open(path, "r+b") as f:  # flip in place and back: no truncate, no re-create
        for off in range(len(data)):
            os.pwrite(f.fileno(), bytes([data[off] ^ 0x10]), off)
            assert check(path, "full", entry) is not None, f"flip at {off} of {len(data)} passed"
            os.pwrite(f.fileno(), data[off : off + 1], off)
    assert check(path, "full", entry) is None


def test_flipped_tensor_data_passes_quick_and_fails_full_on_record_crc(good):
    path, _ = good
    rec = {r.name.rsplit("/", 1)[-1]: r for r in _records(path) if "/data/" in r.name}
    flip(path, rec["2"].data_offset + 3)
    assert check(path, "quick") is None
    assert "CRC32 mismatch" in check(path, "full")  # no index entry: the record CRC alone catches it


def _records(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_zip_records(ShardReader(fd, os.fstat(fd).st_size))[0]
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "old, new, reason",
    [
        (b"hidden_state", b"hidden_stat_", "missing keys"),
        (b"BFloat16Storage", b"BFloat16Storagx", "not a tensor"),
        (b"_rebuild_tensor_v2", b"_rebuild_tensor_v3", "not a tensor"),
    ],
)
def test_flipped_metadata_is_caught_by_quick(good, old, new, reason):
    path, _ = good
    data = path.read_bytes()
    assert data.count(old) >= 1
    path.write_bytes(data.replace(old, new, 1))
    assert reason in check(path, "quick")


def test_shape_metadata_edit_is_caught_by_quick(good):
    path, _ = good
    pkl = read_record(path, "data.pkl")
    # hidden_state's shape tuple (1, 5, 8) -> (1, 5, 9): BININT1 9 instead of 8 after "K\x05K"
    edited = pkl.replace(b"K\x01K\x05K\x08\x87", b"K\x01K\x05K\x09\x87", 1)
    assert edited != pkl
    replace_record(path, "data.pkl", edited)
    assert "hidden_state: view reaches element 40 of a 40-element storage" == check(path, "quick")


def test_zero_length_file(good):
    path, _ = good
    path.write_bytes(b"")
    assert check(path) == "empty file"


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda d: d.pop("loss_mask"), "missing keys ['loss_mask']"),
        (lambda d: d.update(extra=torch.zeros(1)), "unexpected keys ['extra']"),
        (
            lambda d: d.update(hidden_state=torch.randn(1, 6, H).bfloat16()),
            "hidden_state has shape [1, 6, 8]",
        ),
        (
            lambda d: d.update(aux_hidden_state=torch.randn(1, 5, 2 * H).bfloat16()),
            "aux_hidden_state has shape",
        ),
        (lambda d: d.update(input_ids=d["input_ids"].view(1, -1)), "input_ids has shape [1, 5]"),
        (
            lambda d: d.update(hidden_state=d["hidden_state"].float()),
            "hidden_state is float32, expected bfloat16",
        ),
        (lambda d: d.update(input_ids=d["input_ids"].int()), "input_ids is int32"),
        (lambda d: d.update(loss_mask=d["loss_mask"].float()), "loss_mask is float32"),
        (
            lambda d: [d.update({k: v[..., :0] if v.dim() == 1 else v[:, :0]}) for k, v in list(d.items())],
            "expected",
        ),
    ],
)
def test_wrong_keys_shapes_and_dtypes(tmp_path, mutate, reason):
    d = shard_dict()
    mutate(d)
    path = save(tmp_path / "s.pt", d)
    assert reason in check(path)


def test_a_bare_tensor_or_list_is_not_a_shard(tmp_path):
    assert "not a dict of tensors" in check(save(tmp_path / "t.pt", torch.zeros(3)))
    assert "opcode" in check(save(tmp_path / "l.pt", [torch.zeros(3)]))
    (tmp_path / "z.pt").write_bytes(b"PK\x05\x06" + b"\0" * 18)
    assert check(tmp_path / "z.pt") is not None


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda d: d["hidden_state"].view(-1).__setitem__(3, float("nan")), "hidden_state has NaN"),
        (
            lambda d: d["aux_hidden_state"].view(-1).__setitem__(0, float("inf")),
            "aux_hidden_state has NaN or Inf",
        ),
        (lambda d: d["input_ids"].__setitem__(2, 100), "outside the vocabulary"),
        (lambda d: d["input_ids"].__setitem__(2, -1), "negative id"),
        (lambda d: d["loss_mask"].__setitem__(0, 2), "loss_mask has values other than 0 and 1"),
    ],
)
def test_bad_values_with_valid_crc_fail_only_deep(tmp_path, mutate, reason):
    d = shard_dict()
    mutate(d)
    path = save(tmp_path / "s.pt", d)
    assert check(path, "full") is None
    assert reason in check(path, "deep")


def test_code_payload_shard_is_bad_at_every_level_with_no_side_effect(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    _, (entry,) = make_run(tmp_path / "run", n=1)
    path = tmp_path / "run" / entry.path
    replace_record(path, "data.pkl", pickle.dumps({"input_ids": Payload()}, protocol=2))
    for level in LEVELS:
        assert "refused, nothing executed" in check(path, level)
    assert hsx(["verify", str(tmp_path / "run"), "--level", "deep", "--json", "--workers", "1"]) == 1
    assert not marker.exists()


# --- whole runs -------------------------------------------------------------------------------
def _json(capsys, *argv) -> tuple[int, dict]:
    rc = hsx(["verify", *map(str, argv), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_clean_run_json_shape_and_exit_0(tmp_path, capsys):
    make_run(tmp_path, n=5)
    rc, out = _json(capsys, tmp_path, "--level", "full", "--workers", "2")
    assert rc == 0
    assert {
        "level",
        "checked",
        "ok",
        "bad",
        "missing",
        "unindexed",
        "orphans_removed",
        "bytes",
        "seconds",
    } <= set(out)
    assert (out["level"], out["checked"], out["ok"], out["bad"], out["missing"], out["unindexed"]) == (
        "full",
        5,
        5,
        [],
        [],
        [],
    )
    assert out["bytes"] == sum(p.stat().st_size for p in (tmp_path / "shards").rglob("*.pt"))


def test_mixed_run_check_then_quarantine_then_clean(tmp_path, capsys):
    _, entries = make_run(tmp_path, n=6)
    paths = [tmp_path / e.path for e in entries]
    paths[0].write_bytes(paths[0].read_bytes()[:-100])  # truncated by a crash
    flip(paths[1], paths[1].stat().st_size // 2)  # bit rot (CRC)
    os.unlink(paths[2])  # indexed, gone
    stray = tmp_path / shard_relpath("stray")  # on disk, not indexed (crash before indexing)
    stray.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(paths[3], stray)
    old_temp = paths[4].parent / temp_name("s004.pt")
    old_temp.write_bytes(b"partial")
    os.utime(old_temp, (time.time() - 3600, time.time() - 3600))
    young_temp = paths[4].parent / temp_name("s005.pt")
    young_temp.write_bytes(b"in flight")
    before = tree(tmp_path)

    rc, out = _json(capsys, tmp_path, "--level", "full")
    assert rc == 1 and tree(tmp_path) == before  # without --quarantine nothing moves
    assert sorted((b["sample_id"], b["path"]) for b in out["bad"]) == [
        (e.sample_id, e.path) for e in entries[:2]
    ]
    assert out["missing"] == ["s002"] and out["unindexed"] == [shard_relpath("stray")]
    assert out["checked"] == 6 and out["ok"] == 4 and out["orphans_removed"] == 0

    rc, out = _json(capsys, tmp_path, "--level", "full", "--quarantine")
    assert rc == 1 and out["orphans_removed"] == 1
    assert not old_temp.exists() and young_temp.exists()
    for e in entries[:2]:
        q = tmp_path / "quarantine" / Path(e.path).relative_to("shards")
        assert q.exists() and not (tmp_path / e.path).exists()
        reason = json.loads(Path(str(q) + REASON_SUFFIX).read_text())
        assert reason["sample_id"] == e.sample_id and reason["reason"]
    assert set(load_index(tmp_path)) == {"s003", "s004", "s005"}  # bad and missing are not done

    rc, out = _json(capsys, tmp_path, "--level", "full", "--quarantine")
    assert rc == 0 and out["bad"] == [] and out["missing"] == [] and out["orphans_removed"] == 0


def test_check_mode_moves_nothing(tmp_path):
    _, entries = make_run(tmp_path, n=2)
    (tmp_path / entries[0].path).write_bytes(b"junk")
    before = tree(tmp_path)
    r = verify_output(str(tmp_path), "quick", quarantine=True, check_mode=True, orphan_min_age=0)
    assert r.exit_code == 1 and r.quarantined == [] and tree(tmp_path) == before


def test_quarantine_never_overwrites_an_earlier_quarantined_file(tmp_path):
    _, (entry,) = make_run(tmp_path, n=1)
    for _ in range(2):
        (tmp_path / entry.path).write_bytes(b"junk")
        append_index(str(tmp_path), [index_record(entry)])
        r = verify_output(str(tmp_path), "quick", quarantine=True)
        assert len(r.quarantined) == 1
    assert len(list((tmp_path / "quarantine").rglob("*.pt*"))) == 4  # 2 shards + 2 reason files


def test_stale_index_entry_pointing_outside_is_never_touched(tmp_path, capsys):
    make_run(tmp_path, n=1)
    victim = tmp_path.parent / f"{tmp_path.name}-victim.pt"
    victim.write_bytes(b"precious")
    append_index(
        str(tmp_path),
        [{"id": "evil", "path": f"../{victim.name}", "size": 8, "checksum": "crc32:0", "num_tokens": 1}],
    )
    rc, out = _json(capsys, tmp_path, "--quarantine")
    assert rc == 1 and out["bad"][0]["sample_id"] == "evil" and victim.read_bytes() == b"precious"
    assert "evil" not in load_index(tmp_path)


def test_index_with_size_or_token_count_mismatch(tmp_path):
    _, (entry,) = make_run(tmp_path, n=1)
    append_index(str(tmp_path), [{**index_record(entry), "size": entry.size + 1}])
    assert "differs from the index" in verify_output(str(tmp_path)).bad[0].reason
    append_index(str(tmp_path), [{**index_record(entry), "num_tokens": 99}])
    assert "the index says 99" in verify_output(str(tmp_path)).bad[0].reason
    append_index(str(tmp_path), [{**index_record(entry), "checksum": "crc32:00000000"}])
    assert verify_output(str(tmp_path)).bad == []
    assert "checksum" in verify_output(str(tmp_path), "full").bad[0].reason


def test_symlinked_shard_is_not_followed(tmp_path):
    _, (entry,) = make_run(tmp_path, n=1)
    target = tmp_path / "elsewhere.pt"
    os.replace(tmp_path / entry.path, target)
    os.symlink(target, tmp_path / entry.path)
    r = verify_output(str(tmp_path), quarantine=True)
    assert r.bad[0].reason.startswith("a symlink") and target.exists()


def test_not_a_run_exits_2_and_moves_nothing(tmp_path, capsys):
    _, (entry,) = make_run(tmp_path / "run", n=1)
    (tmp_path / "run" / "run.json").unlink()
    (tmp_path / "run" / entry.path).write_bytes(b"junk")
    before = tree(tmp_path)
    assert hsx(["verify", str(tmp_path / "run"), "--quarantine"]) == 2
    assert "not an extraction run" in capsys.readouterr().err and tree(tmp_path) == before
    assert hsx(["verify", str(tmp_path / "absent")]) == 2
    assert hsx(["verify", str(tmp_path / "run"), "--workers", "0"]) == 2


def test_unreadable_shard_exits_2_and_moves_nothing(tmp_path, capsys, monkeypatch):
    _, entries = make_run(tmp_path, n=3)
    (tmp_path / entries[0].path).write_bytes(b"junk")  # bad, but must not move: an I/O error too
    locked = str(tmp_path / entries[1].path)
    if os.geteuid() != 0:
        os.chmod(locked, 0)
    else:  # root reads anything: make the kernel's answer for this one path EACCES
        real_open = os.open

        def deny(path, *a, dir_fd=None, **k):  # by its path, or by its name in its open folder
            if dir_fd is not None:
                full = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
            else:
                full = str(path)
            if full == locked:
                raise PermissionError(13, "Permission denied", path)
            return real_open(path, *a, dir_fd=dir_fd, **k)

        monkeypatch.setattr(os, "open", deny)
    before = tree(tmp_path)
    assert hsx(["verify", str(tmp_path), "--quarantine", "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert locked in err and "Permission denied" in err and "nothing was moved" in err
    assert tree(tmp_path) == before


def test_human_summary(tmp_path, capsys):
    _, (entry, _) = make_run(tmp_path, n=2)
    (tmp_path / entry.path).write_bytes(b"junk")
    assert hsx(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "ok 1, bad 1" in out and "too short to be a zip" in out and "--quarantine" in out


def test_a_foreign_writers_file_is_judged_on_structure(tmp_path):
    # A shard written by plain torch.save (as SpecForge does) under our layout: valid at every level.
    ShardWriter(tmp_path, __import__("shard_helpers").manifest())
    save(tmp_path / shard_relpath("foreign"), shard_dict())
    r = verify_output(str(tmp_path), "deep")
    assert r.exit_code == 0 and r.unindexed == [shard_relpath("foreign")] and r.ok == 1


def test_many_workers_agree_with_one(tmp_path):
    _, entries = make_run(tmp_path, n=40, length=3)
    for e in entries[::7]:
        flip(tmp_path / e.path, 200)
    one = verify_output(str(tmp_path), "full", workers=1)
    two = verify_output(str(tmp_path), "full", workers=2)
    assert [b.path for b in one.bad] == [b.path for b in two.bad] and len(one.bad) == 6
    assert (one.checked, one.ok, one.bytes) == (two.checked, two.ok, two.bytes)


def test_large_file_paths_pread_chunks_and_crc_combine(good, monkeypatch):
    # Big shards are read in chunks with pread and their whole-file CRC is combined per region;
    # shrink the thresholds so a small real shard takes those paths, chunk edges inside records.
    path, entry = good
    monkeypatch.setattr(ziprecords, "SMALL_FILE", 0)
    monkeypatch.setattr(crc, "_DIRECT_CRC_MAX", 0)
    monkeypatch.setattr(crc, "_CHUNK", 97)
    assert check(path, "full", entry) is None
    data = path.read_bytes()
    with open(path, "r+b") as f:
        for off in range(0, len(data), 31):
            os.pwrite(f.fileno(), bytes([data[off] ^ 0x01]), off)
            assert check(path, "full", entry) is not None, f"flip at {off} passed"
            os.pwrite(f.fileno(), data[off : off + 1], off)


def test_layout_memo_skips_reparsing_only_byte_identical_structure(tmp_path, monkeypatch):
    # Two shards of equal length: the second is recognised by its structural bytes (no parse).
    _, (a, b) = make_run(tmp_path, n=2, length=11)
    calls = []
    real = check_module._inspect
    monkeypatch.setattr(check_module, "_inspect", lambda r, e: calls.append(1) or real(r, e))
    monkeypatch.setattr(check_module, "_LAYOUTS", {})
    assert check(tmp_path / a.path) is None and check(tmp_path / b.path, "full", b) is None
    assert len(calls) == 1
    # One changed byte in a structural region (the pickle) is not a match: parsed, and bad.
    pkl = next(r for r in _records(tmp_path / b.path) if r.name.endswith("data.pkl"))
    with open(tmp_path / b.path, "r+b") as f:
        os.pwrite(f.fileno(), b"\x88", pkl.data_offset + pkl.size - 3)  # the last BINPUT index: harmless
    assert check(tmp_path / b.path) is None and len(calls) == 2  # parsed again; still a valid tensor dict
    with open(tmp_path / b.path, "r+b") as f:
        os.pwrite(f.fileno(), b"\x00", pkl.data_offset + 2)  # EMPTY_DICT -> an unknown opcode
    assert "opcode 0x00" in check(tmp_path / b.path) and len(calls) == 3
