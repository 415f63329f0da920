"""What the dump hook creates in the dump directory, and which directory it agrees to use (#38).

The server may run as root (sglang_server_hardening: false) while the dump directory is the job
account's: nothing the hook writes there may follow a link or wait on a FIFO planted by another
account, and a directory others can write is not used at all.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from types import SimpleNamespace

import pytest
import torch

from extraction.sglang import hook, hsx_dump_format

RID = "hsx-abcd0123-s_000-0"


def _hook(directory) -> hook.DumpHook:
    model = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=6), layers_to_capture=[])
    hk = hook.attach(model, {hook.ENV_DIR: str(directory), hook.ENV_LAYERS: "1,3,4"})
    assert hk is not None
    return hk


def _piece() -> hook._Piece:
    return hook._Piece(RID, 0, [torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), torch.zeros(2, 4)])


def _marker_temp(directory) -> str:
    return os.path.join(directory, f".{hsx_dump_format.failed_name(RID, 0)}.{os.getpid()}.tmp")


def test_a_marker_is_never_written_through_a_planted_link(tmp_path):
    dumps, outside = tmp_path / "dumps", tmp_path / "root-owned"
    dumps.mkdir(mode=0o750)
    outside.write_text("precious\n")
    hk = _hook(dumps)
    os.symlink(outside, _marker_temp(dumps))
    hk._failed(_piece(), OSError(28, "No space left on device"))
    assert outside.read_text() == "precious\n"
    assert os.path.islink(_marker_temp(dumps))  # not ours: left alone, and no marker from it
    assert not (dumps / hsx_dump_format.failed_name(RID, 0)).exists()
    os.unlink(_marker_temp(dumps))
    os.symlink(outside, dumps / hsx_dump_format.failed_name(RID, 0))  # a link at the final name: replaced
    hk._failed(_piece(), OSError(28, "No space left on device"))
    marker = dumps / hsx_dump_format.failed_name(RID, 0)
    assert outside.read_text() == "precious\n"
    assert stat.S_ISREG(marker.lstat().st_mode) and "No space left on device" in marker.read_text()
    assert stat.S_IMODE(marker.stat().st_mode) & ~hook.MARKER_MODE == 0  # nobody else writes it


def test_a_fifo_at_the_marker_temp_does_not_hang_the_writer(tmp_path):
    hk = _hook(tmp_path)
    os.mkfifo(_marker_temp(tmp_path))
    done = threading.Event()

    def fail() -> None:
        hk._failed(_piece(), OSError(5, "Input/output error"))
        done.set()

    threading.Thread(target=fail, daemon=True).start()
    try:
        assert done.wait(5), "the marker's temp was opened on a FIFO: the writer hangs"
    finally:
        if not done.is_set():  # free the stuck writer: a reader at the FIFO's other end
            os.close(os.open(_marker_temp(tmp_path), os.O_RDONLY | os.O_NONBLOCK))
            done.wait(5)
    assert stat.S_ISFIFO(os.lstat(_marker_temp(tmp_path)).st_mode)
    assert not (tmp_path / hsx_dump_format.failed_name(RID, 0)).exists()


def test_a_rid_with_a_trailing_newline_is_not_file_safe():
    assert hsx_dump_format.rid_stem("abc-1") == "abc-1"
    assert hsx_dump_format.rid_stem("abc-1\n").startswith("rid-")
    assert "\n" not in hsx_dump_format.dump_name("abc-1\n", 0)


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o772], ids=oct)
def test_a_dump_directory_others_can_write_is_not_used(tmp_path, caplog, monkeypatch, mode):
    monkeypatch.setattr(hook, "_logged", set())
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    if os.geteuid() == 0:
        os.chown(shared, -1, 12345)  # a group that is neither ours nor the owner's
    elif mode == 0o772:
        pytest.skip("needs root to give the directory a group of others")
    with caplog.at_level(logging.WARNING, logger="hsx_dump_hook"):
        model = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=6), layers_to_capture=[])
        assert hook.attach(model, {hook.ENV_DIR: str(shared), hook.ENV_LAYERS: "1,3,4"}) is None
    assert f"dump directory {shared} is writable by" in caplog.text
    assert f"mode {mode:04o}" in caplog.text and f"chmod go-w {shared}" in caplog.text
    assert model.layers_to_capture == []  # SGLang runs unpatched


def test_the_owners_or_our_group_may_write_the_dump_directory(tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    os.chmod(own, 0o770)  # group: ours (the test's egid)
    assert hsx_dump_format.dump_dir_problem(str(own)) is None
    os.chmod(own, 0o750)
    if os.geteuid() == 0:
        os.chown(own, -1, 12345)
    assert hsx_dump_format.dump_dir_problem(str(own)) is None  # group may read, not write
    (tmp_path / "file").write_text("")
    assert (
        hsx_dump_format.dump_dir_problem(str(tmp_path / "file"))
        == f"dump directory {tmp_path / 'file'} is not a directory"
    )
