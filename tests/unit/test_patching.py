"""The anchored patch core on small source files: states, refusals, byte-exact revert."""

from __future__ import annotations

import os

import pytest

from hsx import patching
from hsx.patching import Patch, PatchError, apply_file, examine

SOURCE = (
    "class Model:\n"
    "    def __init__(self):\n"
    "        self.layers = []\n"
    "\n"
    "    def forward(self, x):\n"
    "        y = x + 1\n"
    "        if y is None:\n"
    "            return x\n"
    "        return y\n"
)


def make_patch(version: str = "1", extra: str = "") -> Patch:
    return Patch.from_dict(
        {
            "id": "demo",
            "version": version,
            "blocks": [
                {
                    "name": "init",
                    "anchor": "self.layers = []",
                    "where": "after",
                    "code": [f"self.hooked = True{extra}"],
                },
                {
                    "name": "tail",
                    "anchor": "if y is None:",
                    "where": "before",
                    "code": ["y = y * 2", "", "z = 0"],
                },
            ],
        }
    )


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(SOURCE)
    return path


def test_apply_inserts_indented_marked_blocks_and_reapply_is_noop(src):
    p = make_patch()
    r = apply_file(str(src), p)
    assert (r.changed, r.before, r.after) == (True, "unpatched", "patched")
    text = src.read_text()
    lines = text.splitlines()
    i = lines.index("        self.layers = []")
    assert lines[i + 1].startswith(f"        # >>> hsx-patch demo block=init v=1 sha={p.digest} orig=")
    assert lines[i + 2] == "        self.hooked = True"
    assert lines[i + 3] == "        # <<< hsx-patch demo block=init <<<"
    j = lines.index("        if y is None:")
    assert lines[j - 5].startswith("        # >>> hsx-patch demo block=tail v=1")
    assert lines[j - 4 : j] == [
        "        y = y * 2",
        "",
        "        z = 0",
        "        # <<< hsx-patch demo block=tail <<<",
    ]
    assert "+        self.hooked = True" in r.diff and r.diff.startswith("---")
    ns: dict = {}
    exec(text, ns)  # still runs: the patched method doubles y
    assert ns["Model"]().forward(1) == 4 and ns["Model"]().hooked is True
    again = apply_file(str(src), p)
    assert (again.changed, again.before, again.diff) == (False, "patched", "")
    assert src.read_text() == text


def test_outdated_version_is_replaced_in_place_and_absent_restores_bytes(src):
    original = src.read_bytes()
    apply_file(str(src), make_patch("1"))
    v2 = make_patch("2", extra="  # v2")
    ins = examine(src.read_text(), v2)
    assert ins.status == "outdated" and ins.found_version == "1" and "wanted v2" in ins.reason
    r = apply_file(str(src), v2)
    assert r.changed and r.before == "outdated" and r.found_version == "1"
    text = src.read_text()
    assert "v=1" not in text and text.count("v=2") == 2 and "self.hooked = True  # v2" in text
    r = apply_file(str(src), v2, state="absent")
    assert r.changed and r.original_verified is True
    assert src.read_bytes() == original
    assert not apply_file(str(src), v2, state="absent").changed


def test_crlf_file_keeps_its_line_endings_and_reverts_byte_for_byte(tmp_path):
    path = tmp_path / "crlf.py"
    original = SOURCE.replace("\n", "\r\n").encode()
    path.write_bytes(original)
    apply_file(str(path), make_patch())
    patched = path.read_bytes()
    assert b"\r\n        self.hooked = True\r\n" in patched and b"\n\n" not in patched.replace(b"\r\n", b"")
    apply_file(str(path), make_patch(), state="absent")
    assert path.read_bytes() == original


def test_check_mode_writes_nothing_and_backup_keeps_the_previous_file(src):
    before = src.read_bytes()
    r = apply_file(str(src), make_patch(), check_mode=True, backup=True)
    assert r.changed and r.diff and r.backup is None
    assert src.read_bytes() == before
    os.chmod(src, 0o640)
    r = apply_file(str(src), make_patch(), backup=True)
    assert r.backup and open(r.backup, "rb").read() == before
    assert oct(src.stat().st_mode & 0o777) == "0o640"


def test_anchor_missing_or_repeated_is_refused_unless_forced(src):
    src.write_text(SOURCE.replace("        if y is None:\n", ""))
    with pytest.raises(PatchError, match=r"anchor of block tail \('if y is None:'\) not found"):
        apply_file(str(src), make_patch())
    with pytest.raises(PatchError, match="not found"):
        apply_file(str(src), make_patch(), force=True)
    twice = SOURCE + "\n\ndef other(self):\n    self.layers = []\n"
    src.write_text(twice)
    with pytest.raises(PatchError, match=r"matches 2 lines \(3, 13\); expected exactly one.*force"):
        apply_file(str(src), make_patch())
    assert src.read_text() == twice  # nothing written
    assert examine(twice, make_patch()).status == "unsupported"
    r = apply_file(str(src), make_patch(), force=True)
    lines = src.read_text().splitlines()
    assert r.changed and lines[4] == "        self.hooked = True"  # after the first match (line 3)


def test_damaged_markers_are_reported_and_refused(src):
    apply_file(str(src), make_patch())
    text = src.read_text()
    broken = "\n".join(line for line in text.splitlines() if "block=init <<<" not in line) + "\n"
    src.write_text(broken)
    ins = examine(broken, make_patch())
    assert ins.status == "damaged" and "block init is not closed" in ins.reason
    for state in ("present", "absent"):
        with pytest.raises(PatchError, match="damaged"):
            apply_file(str(src), make_patch(), state=state)
    assert src.read_text() == broken


def test_patch_that_would_break_the_syntax_is_refused(src):
    bad = Patch.from_dict(
        {"id": "demo", "version": "1", "blocks": [{"name": "b", "anchor": "y = x + 1", "code": ["if True"]}]}
    )
    with pytest.raises(PatchError, match="does not parse: line 8"):
        apply_file(str(src), bad)
    assert src.read_text() == SOURCE


def test_other_patches_blocks_are_left_alone(src):
    apply_file(str(src), make_patch())
    other = Patch.from_dict(
        {"id": "other", "version": "1", "blocks": [{"name": "b", "anchor": "y = x + 1", "code": ["pass"]}]}
    )
    apply_file(str(src), other)
    apply_file(str(src), make_patch(), state="absent")
    text = src.read_text()
    assert "hsx-patch other" in text and "hsx-patch demo" not in text
    assert examine(text, other).status == "patched"


def test_revert_after_foreign_edit_says_original_not_verified(src):
    apply_file(str(src), make_patch())
    src.write_text(src.read_text().replace("return y\n", "return y  # edited\n"))
    r = apply_file(str(src), make_patch(), state="absent")
    assert r.original_verified is False and "changed since" in r.message


def test_bad_patch_definitions_are_rejected():
    with pytest.raises(ValueError, match="where"):
        patching.Block("a", "x", "around", ("pass",))
    with pytest.raises(ValueError, match="share an anchor"):
        Patch(
            "p",
            "1",
            (patching.Block("a", "x", "after", ("pass",)), patching.Block("b", " x ", "after", ("pass",))),
        )
    with pytest.raises(ValueError, match="single lines"):
        patching.Block("a", "x", "after", ("pass\npass",))
