"""library/own_tree.py (module_utils/hsx/owntree.py): OUTPUT (or the dump directory) given to the job's account without
following a link (issue #30 item 11: an OUTPUT an older release wrote as root is taken over safely).

Run as root against a real tree: the directories and regular files change hands and lose the bits of
others; a symlink's target, a file with a second hard link (a planted link to a file outside) and a
FIFO stay exactly as they were; a link where the dump directory belongs, or a top owned by another
user, is refused.
"""

from __future__ import annotations

import json
import os
import pwd
from pathlib import Path

import pytest
from ansible.module_utils.testing import patch_module_args
from ansible_modules import load_module

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="changes owners: needs root")
USER, GROUP = "nobody", "nogroup"
mod = load_module("own_tree")


@pytest.fixture
def run(capsys):
    """run(*specs, check=False, owner=USER): the module's result (a dict; `failed` and `msg` on a refusal)."""
    def run_module(*specs: str, check: bool = False, owner: str = USER) -> dict:
        args = {"paths": list(specs), "owner": owner, "group": GROUP, "_ansible_check_mode": check}
        with patch_module_args(args), pytest.raises(SystemExit):
            mod.main()
        return json.loads(capsys.readouterr().out)
    return run_module


@pytest.fixture
def legacy(tmp_path: Path) -> dict[str, Path]:
    """A root-owned OUTPUT as an older release left it, with things planted inside."""
    out = tmp_path / "output"
    (out / "shards" / "ab").mkdir(parents=True)
    (out / "index.jsonl").write_text("{}\n")
    (out / "shards" / "ab" / "s.pt").write_bytes(b"x")
    outside = tmp_path / "secret"
    outside.write_text("root's")
    outside.chmod(0o644)
    (out / "shards" / "link.pt").symlink_to(outside)
    (out / "linkdir").symlink_to(tmp_path)
    os.link(outside, out / "shards" / "ab" / "hard.pt")
    os.mkfifo(out / "fifo")
    for p in [out, *out.rglob("*")]:
        if not p.is_symlink():
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
    return {"out": out, "outside": outside, "tmp": tmp_path}


def test_takes_over_a_root_tree_without_following_links(legacy, run):
    out, outside = legacy["out"], legacy["outside"]
    dry = run(str(out), check=True)
    assert not dry.get("failed") and dry["changed"], dry
    assert (out / "index.jsonl").stat().st_uid == 0, "check mode changed something"
    done = run(str(out))
    assert not done.get("failed"), done
    counts = done["paths"][str(out)]
    assert counts["skipped_links"] == 2 and counts["skipped_hardlinks"] == 1 and counts["skipped_other"] == 1
    uid = pwd.getpwnam(USER).pw_uid
    for p, mode in [(out, 0o750), (out / "shards", 0o750), (out / "shards/ab", 0o750),
                    (out / "index.jsonl", 0o640), (out / "shards/ab/s.pt", 0o640)]:
        st = p.stat()
        assert (st.st_uid, st.st_mode & 0o7777) == (uid, mode), p
    # The targets of links, the hard-linked file and the FIFO are as they were.
    for p in (outside, legacy["tmp"], out / "fifo"):
        assert p.stat().st_uid == 0, p
    assert outside.stat().st_mode & 0o777 == 0o644
    again = run(str(out))
    assert not again.get("failed") and again["changed"] is False  # idempotent


def test_creates_a_missing_directory_and_refuses_a_planted_link(legacy, run):
    dumps = legacy["tmp"] / "run" / "dumps"
    dry = run("=" + str(dumps), check=True)
    assert dry["changed"] and dry["paths"][str(dumps)]["created"] and not dumps.parent.exists()
    made = run("=" + str(dumps))
    assert not made.get("failed") and made["paths"][str(dumps)]["created"], made
    assert dumps.stat().st_uid == pwd.getpwnam(USER).pw_uid and dumps.stat().st_mode & 0o777 == 0o750
    planted = legacy["tmp"] / "planted"
    planted.symlink_to(legacy["out"])
    refused = run("=" + str(planted))
    assert refused["failed"] and "is a symbolic link" in refused["msg"] and "planted" in refused["msg"]
    assert legacy["out"].stat().st_uid == 0  # nothing behind the link changed
    # OUTPUT itself may be the operator's link (to another disk): followed at the top only.
    assert not run(str(planted)).get("failed")


def test_refuses_a_tree_another_user_owns(legacy, run):
    other = legacy["tmp"] / "theirs"
    other.mkdir()
    os.chown(other, 12345, 12345)
    refused = run(str(other))
    assert refused["failed"] and "not ours to take over" in refused["msg"]
    assert other.stat().st_uid == 12345


def test_a_tree_deeper_than_pythons_recursion_limit(tmp_path: Path, run):
    """1,100 nested directories (os.fwalk recursed: RecursionError): walked, every one handed over."""
    out = tmp_path / "deep"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(1100):  # not os.makedirs: it recurses too
        os.mkdir("d", dir_fd=fd)
        sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = sub
    os.close(fd)
    try:
        done = run(str(out))
        assert not done.get("failed"), str(done)[-500:]
        assert done["paths"][str(out)]["changed"] == 1101
        deepest = out / "/".join(["d"] * 1100)
        assert deepest.stat().st_uid == pwd.getpwnam(USER).pw_uid
    finally:  # deepest first: pytest's cleanup (shutil.rmtree) recurses as deep as the tree
        for depth in range(1100, 0, -1):
            os.rmdir(out / "/".join(["d"] * depth))


def test_a_dangling_or_foreign_output_link_is_a_clear_error(tmp_path: Path, run):
    """OUTPUT may be the operator's link, never a dangling one (a traceback) nor one someone else
    made (it would point root's chown anywhere, /etc say)."""
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    refused = run(str(dangling))
    assert refused["failed"] and "Traceback" not in refused["msg"], refused
    assert f"{dangling} is a symbolic link to {tmp_path / 'nowhere'}, which does not exist" in refused["msg"]
    target = tmp_path / "etc-like"
    target.mkdir()
    foreign = tmp_path / "foreign"
    foreign.symlink_to(target)
    for uid in (12345, pwd.getpwnam(USER).pw_uid):
        os.lchown(foreign, uid, uid)
        refused = run(str(foreign))
        assert refused["failed"] and "Traceback" not in refused["msg"], refused
        assert "a link only root may make" in refused["msg"]
        assert target.stat().st_uid == 0


def test_bad_input_and_a_missing_account_say_what(tmp_path: Path, run):
    """A relative path is refused naming it; an account not made yet fails a real run naming it, and in
    check mode (the account would be made first) is reported as a change with nothing counted."""
    r = run("relative/out", "=" + str(tmp_path))
    assert r["failed"] and "paths: relative/out not absolute" in r["msg"]
    r = run(str(tmp_path / "out"), owner="hsx-no-such-user")
    assert r["failed"] and "no such user or group" in r["msg"] and not (tmp_path / "out").exists()
    r = run(str(tmp_path / "out"), owner="hsx-no-such-user", check=True)
    assert r["changed"] and r["paths"] == {} and r["note"] == f"no account yet: hsx-no-such-user:{GROUP}"

