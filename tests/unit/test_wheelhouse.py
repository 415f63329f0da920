"""The wheelhouse's archive (what hosts receive) and the input digest (what decides a rebuild)."""

from __future__ import annotations

import tarfile
from pathlib import Path

from extraction.deploy.wheelhouse import _complete, source_digest, write_archive


def make_wheels(dest: Path, names: list[str]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        (dest / name).write_bytes(name.encode() * 100)


def test_archive_holds_exactly_the_wheels_and_is_deterministic(tmp_path):
    names = ["b-1-py3-none-any.whl", "a-2-py3-none-any.whl"]
    make_wheels(tmp_path, names)
    (tmp_path / "stray.txt").write_text("not a wheel of the manifest")
    first = write_archive(tmp_path, names, "0123456789abcdef" * 4)
    data = (tmp_path / first).read_bytes()
    with tarfile.open(tmp_path / first) as tar:
        assert tar.getnames() == sorted(names)
        assert tar.extractfile("a-2-py3-none-any.whl").read() == (tmp_path / "a-2-py3-none-any.whl").read_bytes()
    (tmp_path / first).unlink()
    assert (tmp_path / write_archive(tmp_path, names, "0123456789abcdef" * 4)).read_bytes() == data


def test_a_new_archive_replaces_the_old_one(tmp_path):
    make_wheels(tmp_path, ["a-1-py3-none-any.whl"])
    old = write_archive(tmp_path, ["a-1-py3-none-any.whl"], "1" * 64)
    new = write_archive(tmp_path, ["a-1-py3-none-any.whl"], "2" * 64)
    assert old != new and not (tmp_path / old).exists() and (tmp_path / new).is_file()
    assert not list(tmp_path.glob(".*.tmp"))


def test_source_digest_follows_content_not_timestamps(tmp_path):
    src = tmp_path / "src"
    (src / "extraction" / "__pycache__").mkdir(parents=True)
    (src / "pyproject.toml").write_text("[project]\nname='x'\n")
    (src / "constraints.txt").write_text("torch==2.13.0\n")
    module = src / "extraction" / "mod.py"
    module.write_text("A = 1\n")
    before = source_digest(src, src / "constraints.txt")
    (src / "extraction" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"compiled")
    module.touch()
    assert source_digest(src, src / "constraints.txt") == before
    module.write_text("A = 2\n")
    assert source_digest(src, src / "constraints.txt") != before
    module.write_text("A = 1\n")
    (src / "constraints.txt").write_text("torch==2.14.1\n")
    assert source_digest(src, src / "constraints.txt") != before



def test_source_digest_follows_the_core_package_too(tmp_path):
    """The wheel holds module_utils/hsx as `hsx`: a change there is a change of the wheel."""
    src = tmp_path / "src"
    (src / "extraction").mkdir(parents=True)
    (src / "module_utils" / "hsx").mkdir(parents=True)
    (src / "pyproject.toml").write_text("[project]\nname='x'\n")
    (src / "constraints.txt").write_text("torch==2.13.0\n")
    core = src / "module_utils" / "hsx" / "layout.py"
    core.write_text("A = 1\n")
    before = source_digest(src, src / "constraints.txt")
    core.write_text("A = 2\n")
    assert source_digest(src, src / "constraints.txt") != before

def test_a_manifest_is_complete_only_with_every_file(tmp_path):
    make_wheels(tmp_path, ["p-1-py3-none-any.whl", "d-1-py3-none-any.whl"])
    manifest = {"package_wheel": "p-1-py3-none-any.whl", "wheels": ["p-1-py3-none-any.whl", "d-1-py3-none-any.whl"]}
    assert not _complete(tmp_path, manifest), "no archive yet"
    manifest["archive"] = write_archive(tmp_path, manifest["wheels"], "3" * 64)
    assert _complete(tmp_path, manifest)
    (tmp_path / "d-1-py3-none-any.whl").unlink()
    assert not _complete(tmp_path, manifest)
