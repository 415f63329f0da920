"""roles/hsx/files/hsx-own-tree: OUTPUT (or the dump directory) given to the job's account without
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
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "roles/hsx/files/hsx-own-tree"
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="changes owners: needs root")
USER, GROUP = "nobody", "nogroup"


def run(*specs: str, check: bool = False) -> subprocess.CompletedProcess:
    args = [sys.executable, str(SCRIPT), USER, GROUP, *(["--check"] if check else []), *specs]
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


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


def test_takes_over_a_root_tree_without_following_links(legacy):
    out, outside = legacy["out"], legacy["outside"]
    dry = run(str(out), check=True)
    assert dry.returncode == 0 and json.loads(dry.stdout)["changed"], dry.stderr
    assert (out / "index.jsonl").stat().st_uid == 0, "check mode changed something"
    done = run(str(out))
    assert done.returncode == 0, done.stderr
    counts = json.loads(done.stdout)["paths"][str(out)]
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
    assert again.returncode == 0 and json.loads(again.stdout)["changed"] is False  # idempotent


def test_creates_a_missing_directory_and_refuses_a_planted_link(legacy):
    dumps = legacy["tmp"] / "run" / "dumps"
    made = run("=" + str(dumps))
    assert made.returncode == 0 and json.loads(made.stdout)["paths"][str(dumps)]["created"], made.stderr
    assert dumps.stat().st_uid == pwd.getpwnam(USER).pw_uid and dumps.stat().st_mode & 0o777 == 0o750
    planted = legacy["tmp"] / "planted"
    planted.symlink_to(legacy["out"])
    refused = run("=" + str(planted))
    assert refused.returncode != 0 and "is a symbolic link" in refused.stderr and "planted" in refused.stderr
    assert legacy["out"].stat().st_uid == 0  # nothing behind the link changed
    # OUTPUT itself may be the operator's link (to another disk): followed at the top only.
    assert run(str(planted)).returncode == 0


def test_refuses_a_tree_another_user_owns(legacy):
    other = legacy["tmp"] / "theirs"
    other.mkdir()
    os.chown(other, 12345, 12345)
    refused = run(str(other))
    assert refused.returncode != 0 and "not ours to take over" in refused.stderr
    assert other.stat().st_uid == 12345


def test_a_tree_deeper_than_pythons_recursion_limit(tmp_path: Path):
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
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-500:]
        assert json.loads(done.stdout)["paths"][str(out)]["changed"] == 1101
        deepest = out / "/".join(["d"] * 1100)
        assert deepest.stat().st_uid == pwd.getpwnam(USER).pw_uid
    finally:  # deepest first: pytest's cleanup (shutil.rmtree) recurses as deep as the tree
        for depth in range(1100, 0, -1):
            os.rmdir(out / "/".join(["d"] * depth))


def test_a_dangling_or_foreign_output_link_is_a_clear_error(tmp_path: Path):
    """OUTPUT may be the operator's link, never a dangling one (a traceback) nor one someone else
    made (it would point root's chown anywhere, /etc say)."""
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    refused = run(str(dangling))
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert f"{dangling} is a symbolic link to {tmp_path / 'nowhere'}, which does not exist" in refused.stderr
    target = tmp_path / "etc-like"
    target.mkdir()
    foreign = tmp_path / "foreign"
    foreign.symlink_to(target)
    for uid in (12345, pwd.getpwnam(USER).pw_uid):
        os.lchown(foreign, uid, uid)
        refused = run(str(foreign))
        assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
        assert "a link only root may make" in refused.stderr
        assert target.stat().st_uid == 0
