"""The client's side of the dump directory (#38): markers opened as dumps are, a dump the reader
refuses failing its sample at once, every malformed dump a DumpError naming the file, a dump that
shrinks or cannot be read failing that sample only, and strays in the directory skipped."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from test_sglang_dump_format import RID, ROWS, H, _header  # one dump header for both files

from extraction.sglang import dumps, hook, hsx_dump_format

ROOT = Path(__file__).resolve().parents[2]


def _write(directory: Path, rows: int = ROWS, offset: int = 0, rid: str = RID) -> Path:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (rows,), generator=g)
    hidden = torch.randn(rows, H, generator=g).to(torch.bfloat16)
    parts = [torch.randn(rows, H, generator=g).to(torch.bfloat16) for _ in range(3)]
    path = directory / hsx_dump_format.dump_name(rid, offset)
    hsx_dump_format.write_dump(str(path), _header(rid=rid, offset=offset, seq_len=offset + rows), (ids, hidden, parts))
    return path


def _no_wait(monkeypatch) -> None:
    """A wait for another rename fails the test: the reader must decide at once."""

    def wait(self, prefix, timeout):
        raise AssertionError(f"waited for {prefix} as if the dump were not yet written")

    monkeypatch.setattr(dumps._DirWatch, "wait", wait)
    monkeypatch.setattr(dumps.time, "sleep", lambda s: wait(None, "a poll", s))


# ---------------------------------------------------------------- markers


def test_a_marker_that_is_a_link_is_refused_without_reading_its_target(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("root:x:0:0 the target's text\n")
    (tmp_path / hsx_dump_format.failed_name(RID, 0)).symlink_to(secret)
    with pytest.raises(dumps.DumpError) as e:
        dumps.read_request(str(tmp_path), RID, expected_len=ROWS)
    assert "the target's text" not in str(e.value) and not isinstance(e.value, dumps.DumpWriteFailed)
    assert f"{tmp_path / hsx_dump_format.failed_name(RID, 0)}: " in str(e.value) and "symbolic link" in str(e.value)


def test_a_marker_that_is_a_fifo_does_not_hang_and_a_big_one_is_read_bounded(tmp_path):
    marker = tmp_path / hsx_dump_format.failed_name(RID, 0)
    os.mkfifo(marker)
    caught: list[BaseException] = []

    def read() -> None:
        try:
            dumps.read_request(str(tmp_path), RID, expected_len=ROWS)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            caught.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(5)
    if reader.is_alive():  # free it: a writer at the FIFO's other end, then the end of file
        os.close(os.open(marker, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5)
        pytest.fail("opening a FIFO named as a marker blocked the request slot")
    assert isinstance(caught[0], dumps.DumpError) and "not a regular file" in str(caught[0])
    marker.unlink()
    marker.write_text("OSError: disk full" + "x" * (1 << 20))
    with pytest.raises(dumps.DumpWriteFailed, match="OSError: disk full") as e:
        dumps.read_request(str(tmp_path), RID, expected_len=ROWS)
    assert len(str(e.value)) < 1000


# ---------------------------------------------------------------- refused at once


def test_a_complete_dump_the_reader_refuses_fails_at_once(tmp_path, monkeypatch):
    path = _write(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[:8] = b"HSXDUMP9"
    path.write_bytes(bytes(raw))
    _no_wait(monkeypatch)
    with pytest.raises(dumps.DumpError, match=f"{path}: not a hsx-sglang-dump/2 dump"):
        dumps.wait_request(str(tmp_path), RID, ROWS, timeout=30)


def test_a_missing_piece_is_still_waited_for(tmp_path, monkeypatch):
    _write(tmp_path, rows=4, offset=0)  # 4 of 6 tokens: the rest may still come
    waits: list[str] = []
    monkeypatch.setattr(dumps._DirWatch, "wait", lambda self, prefix, timeout: waits.append(prefix))
    with pytest.raises(dumps.DumpIncomplete, match="dumps cover 4 tokens, expected 6"):
        dumps.wait_request(str(tmp_path), RID, ROWS, timeout=0.2)
    assert waits


def _rewrite_header(path: Path, text: bytes) -> None:
    raw = path.read_bytes()
    start = json.loads(raw[16 : 16 + hsx_dump_format.DUMP_HEAD.unpack_from(raw)[1]])["tensors"]["input_ids"]["at"]
    assert len(text) + 16 <= start
    path.write_bytes(hsx_dump_format.DUMP_HEAD.pack(hsx_dump_format.DUMP_MAGIC, len(text)) + text + raw[16 + len(text) :])


def test_a_deeply_nested_header_is_a_dump_error(tmp_path):
    path = _write(tmp_path)
    _rewrite_header(path, b"[" * 4000)
    with pytest.raises(dumps.DumpError, match=f"{path}: unreadable header"):
        dumps._load(str(path), RID)


def _v1(directory: Path, **fields) -> Path:
    record = {
        "format": hsx_dump_format.FORMAT_V1,
        "rid": RID,
        "offset": 0,
        "seq_len": 3,
        "input_ids": torch.arange(3),
        "hidden_state": torch.zeros(3, H),
        "aux_hidden_state": torch.zeros(3, 3 * H),
        "layer_ids": [1, 2, 3],
        "capture_owner": hook.OWNER_HOOK,
        "sglang_version": "0.5.9",
    }
    record.update(fields)
    record = {k: v for k, v in record.items() if v is not None}
    path = directory / hsx_dump_format.dump_name(RID, 0)
    torch.save(record, path)
    return path


@pytest.mark.parametrize(
    "fields",
    [
        {"input_ids": None},  # KeyError
        {"input_ids": torch.tensor(7)},  # IndexError: a 0-d tensor
        {"offset": "zero"},  # ValueError
        {"layer_ids": None},  # KeyError, in the join
        {"hidden_state": torch.zeros(3)},  # IndexError: the width
        {"aux_hidden_state": "not a tensor"},
    ],
    ids=["no-ids", "0d-ids", "str-offset", "no-layers", "1d-hidden", "str-aux"],
)
def test_every_malformed_format_1_dump_is_a_dump_error_naming_the_file(tmp_path, fields):
    path = _v1(tmp_path, **fields)
    with pytest.raises(dumps.DumpError, match=str(path)):
        dumps.read_request(str(tmp_path), RID, expected_len=3)


# ---------------------------------------------------------------- a dump that cannot be read


def test_a_dump_that_shrinks_after_it_was_read_cannot_kill_the_client(tmp_path):
    path = _write(tmp_path)
    code = f"""
import os, torch
from extraction.sglang import dumps
record = dumps._load({str(path)!r}, {RID!r})
want = [record[k].clone() for k in dumps._KEYS]
os.truncate({str(path)!r}, 0)  # the file shrinks under whatever holds its bytes
assert all(torch.equal(record[k], w) for k, w in zip(dumps._KEYS, want))
print("read", float(record["hidden_state"].float().sum()))
"""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'module_utils'}"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"rc {done.returncode} (-7: SIGBUS): {done.stderr[-500:]}"
    assert done.stdout.startswith("read ")


@pytest.mark.parametrize("fault", ["shrinks", "eio"])
def test_a_dump_that_shrinks_or_cannot_be_read_is_a_dump_error(tmp_path, monkeypatch, fault):
    path = _write(tmp_path)
    real = os.preadv

    def preadv(fd, buffers, offset):
        if fault == "eio":
            raise OSError(errno.EIO, "Input/output error")
        os.truncate(path, offset)  # shrunk between the header's check and the read
        return real(fd, buffers, offset)

    monkeypatch.setattr(dumps.os, "preadv", preadv)
    with pytest.raises(dumps.DumpError, match=str(path)) as e:
        dumps._load(str(path), RID)
    assert ("shrank" if fault == "shrinks" else "Input/output error") in str(e.value)


# ---------------------------------------------------------------- strays


def test_strays_named_like_stale_files_are_skipped_and_named(tmp_path):
    other = "hsx-0000dead-s-1"
    stale = _write(tmp_path, rid=other)
    (tmp_path / hsx_dump_format.dump_name(other, 16)).mkdir()  # a directory named like a dump
    huge_pid = tmp_path / f".{hsx_dump_format.dump_name(other, 32)}.{'9' * 20}.tmp"
    huge_pid.write_bytes(b"")
    strays: list[str] = []
    assert dumps.stale_names(str(tmp_path), "hsx-abcd0123-", strays) == [stale.name]
    assert sorted(strays) == sorted(
        [
            f"{hsx_dump_format.dump_name(other, 16)} (not a regular file)",
            f"{huge_pid.name} (pid {'9' * 20} is no process id)",
        ]
    )
    assert dumps.remove_request(str(tmp_path), other) == 1  # the directory is left, not fatal
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([hsx_dump_format.dump_name(other, 16), huge_pid.name])
