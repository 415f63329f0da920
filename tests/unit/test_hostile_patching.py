"""Files we did not write are data, not truth (issue #30, items 1, 5, 12a-c): the files a patch changes.

Patching keeps a file's owner, group and mode, writes through a link to its target, refuses rather
than change an owner, and refuses a FIFO or a dangling link with a clear error.
"""

from __future__ import annotations

import os
import stat

import pytest
from hsx_run_helpers import (
    one_thread,  # noqa: F401  (autouse)
    )

from hsx.patching import Patch, apply_file

# ======================================================================== 12c. patching
SOURCE = "def f(x):\n    y = x + 1\n    return y\n"
PATCH = Patch.from_dict(
    {"id": "demo", "version": "1", "blocks": [{"name": "b", "anchor": "y = x + 1", "code": ["y += 1"]}]}
)


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root (as the job runs)")
def test_patching_keeps_owner_group_and_mode(tmp_path) -> None:
    f = tmp_path / "mod.py"
    f.write_text(SOURCE)
    os.chown(f, 1234, 5678)
    os.chmod(f, 0o640)
    for state in ("present", "absent"):
        assert apply_file(str(f), PATCH, state).changed
        st_ = os.stat(f)
        assert (st_.st_uid, st_.st_gid, stat.S_IMODE(st_.st_mode)) == (1234, 5678, 0o640), state
    assert f.read_text() == SOURCE


def test_patching_through_a_symlink_writes_the_target_and_keeps_the_link(tmp_path) -> None:
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    real = real_dir / "mod.py"
    real.write_text(SOURCE)
    os.chmod(real, 0o644)
    link_dir = tmp_path / "site"
    link_dir.mkdir()
    link = link_dir / "mod.py"
    link.symlink_to(os.path.relpath(real, link_dir))
    chain = tmp_path / "chain.py"
    chain.symlink_to(link)

    res = apply_file(str(chain), PATCH, "present")
    assert res.changed and res.path == str(chain)
    assert chain.is_symlink() and link.is_symlink() and os.readlink(chain) == str(link)
    assert "y += 1" in real.read_text() and stat.S_IMODE(os.stat(real).st_mode) == 0o644
    assert not list(link_dir.glob(".hsx-patch-*")) and not list(real_dir.glob(".hsx-patch-*"))

    res = apply_file(str(link), PATCH, "absent")  # revert through the other link
    assert res.changed and res.original_verified
    assert link.is_symlink() and real.read_bytes() == SOURCE.encode()


def test_patching_refuses_rather_than_change_the_owner(tmp_path, monkeypatch) -> None:
    """Not root and not our file (chown not permitted): nothing written, no temp left behind."""
    f = tmp_path / "mod.py"
    f.write_text(SOURCE)
    real_stat = os.stat

    def stat_as_other_owner(p, *a, **kw):
        st_ = real_stat(p, *a, **kw)
        if str(p) == str(f):
            return os.stat_result((st_.st_mode, st_.st_ino, st_.st_dev, st_.st_nlink, 4321, 8765,
                                   *tuple(st_)[6:10]))
        return st_

    def no_chown(*_a, **_kw):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "stat", stat_as_other_owner)
    monkeypatch.setattr(os, "chown", no_chown)
    with pytest.raises(PermissionError, match="cannot keep the file's owner 4321:8765"):
        apply_file(str(f), PATCH, "present")
    monkeypatch.undo()
    assert f.read_text() == SOURCE and sorted(p.name for p in tmp_path.iterdir()) == ["mod.py"]


def test_patching_a_fifo_is_refused_not_a_hang(tmp_path) -> None:
    from hsx.patching import PatchError

    fifo = tmp_path / "mod.py"
    os.mkfifo(fifo)
    with pytest.raises(PatchError, match="not a regular file"):
        apply_file(str(fifo), PATCH, "present")


def test_patching_a_dangling_symlink_is_a_clear_error(tmp_path) -> None:
    from hsx.patching import PatchError

    link = tmp_path / "mod.py"
    link.symlink_to(tmp_path / "gone.py")
    with pytest.raises(PatchError, match="cannot read"):
        apply_file(str(link), PATCH, "present")
    assert link.is_symlink() and not (tmp_path / "gone.py").exists()
