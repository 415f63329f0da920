"""hsx.fsutil.read_regular: the one bounded reader of a file someone else may have put there (a
model's config.json: hsx.modelconfig; a source file to patch: hsx.patching). A link is refused
unless asked to follow, a FIFO is an error and never a hang, a file over the limit is refused;
every error names the path."""

from __future__ import annotations

import errno
import os

import pytest

from hsx.fsutil import read_regular

# Every test here: a reader that blocks on a FIFO fails (conftest.no_hang), not a hung run.
pytestmark = pytest.mark.usefixtures("no_hang")


def test_reads_a_regular_file_up_to_the_limit(tmp_path) -> None:
    f = tmp_path / "config.json"
    f.write_bytes(b"x" * 10)
    assert read_regular(str(f), 10) == b"x" * 10
    assert read_regular(str(f), None) == b"x" * 10


def test_over_the_limit_is_refused_naming_the_path(tmp_path) -> None:
    f = tmp_path / "config.json"
    f.write_bytes(b"x" * 11)
    with pytest.raises(ValueError, match=rf"^{f}: over 10 bytes$"):
        read_regular(str(f), 10)


def test_a_link_is_refused_unless_followed(tmp_path) -> None:
    target = tmp_path / "real.json"
    target.write_bytes(b"{}")
    link = tmp_path / "config.json"
    link.symlink_to(target)
    with pytest.raises(OSError) as exc:
        read_regular(str(link), 100)
    assert exc.value.errno == errno.ELOOP and exc.value.filename == str(link)
    assert exc.value.strerror == "a symlink, not followed" and str(link) in str(exc.value)
    assert read_regular(str(link), 100, follow_links=True) == b"{}"


@pytest.mark.parametrize("follow_links", [False, True])
def test_a_fifo_is_refused_not_a_hang(tmp_path, follow_links) -> None:
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    with pytest.raises(OSError) as exc:
        read_regular(str(fifo), 100, follow_links=follow_links)
    assert exc.value.strerror == "not a regular file" and exc.value.filename == str(fifo)


def test_a_directory_and_nothing_are_errors_naming_the_path(tmp_path) -> None:
    with pytest.raises(OSError) as exc:
        read_regular(str(tmp_path), 100)
    assert exc.value.strerror == "not a regular file" and exc.value.filename == str(tmp_path)
    with pytest.raises(FileNotFoundError) as missing:
        read_regular(str(tmp_path / "gone"), 100, follow_links=True)
    assert missing.value.filename == str(tmp_path / "gone")


def test_its_callers_word_its_errors_as_their_own(tmp_path) -> None:
    """modelconfig: ValueError; patching: PatchError; both name the file and follow a link."""
    from hsx.modelconfig import MAX_CONFIG_BYTES, read_json
    from hsx.patching import PatchError, read_text

    config = tmp_path / "config.json"
    os.mkfifo(config)
    with pytest.raises(ValueError, match=rf"^{config}: cannot read the model's config: not a regular file$"):
        read_json(str(tmp_path))
    with pytest.raises(PatchError, match=rf"^{config}: cannot read: not a regular file$"):
        read_text(str(config))
    config.unlink()
    real = tmp_path / "real.json"
    real.write_bytes(b" " * MAX_CONFIG_BYTES + b"{}")
    config.symlink_to(real)
    with pytest.raises(ValueError, match=rf"^{config}: over {MAX_CONFIG_BYTES} bytes, not a model config$"):
        read_json(str(tmp_path))
    real.write_bytes(b'{"a": 1}')
    assert read_json(str(tmp_path)) == {"a": 1} and read_text(str(config)) == '{"a": 1}'
