"""Anchored, versioned, revertible source patches.

`ansible.posix.patch` decides "applied" by a reverse dry run, so once v1 of a patch is in a file it
cannot tell that v2 is wanted. Here every inserted block sits between marker comments that name the
patch, the block, the patch version, a digest of the patch content and a digest of the unpatched
file. From any file we can therefore recover the original text (drop our blocks), say whether the
wanted version is applied, and upgrade or revert in place; revert gives the original back byte for
byte, and the recorded digest proves it.

Part of the stdlib-only core: Ansible ships it to hosts as ansible.module_utils.hsx.patching, where
the extraction package may not be installed.
"""

from __future__ import annotations

import ast
import difflib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from .fsutil import read_regular

UNPATCHED = "unpatched"
PATCHED = "patched"
OUTDATED = "outdated"
UNSUPPORTED = "unsupported"  # an anchor does not match exactly once
DAMAGED = "damaged"  # our markers are unbalanced: someone edited inside a block

_BEGIN = re.compile(
    r"^[ \t]*# >>> hsx-patch (?P<id>\S+) block=(?P<block>\S+) v=(?P<version>\S+)"
    r" sha=(?P<digest>[0-9a-f]+) orig=(?P<orig>[0-9a-f]+) >>>\r?$"
)
_END = re.compile(r"^[ \t]*# <<< hsx-patch (?P<id>\S+) block=(?P<block>\S+) <<<\r?$")
_NAME = re.compile(r"^[A-Za-z0-9_.:-]+$")


class PatchError(Exception):
    """The patch cannot be applied or removed as asked; the file was not touched."""


@dataclass(frozen=True)
class Block:
    """Lines inserted right `after` or `before` the one line whose stripped text equals `anchor`.

    `code` lines are relative to the anchor line's indentation, which is prepended to each.
    """

    name: str
    anchor: str
    where: str
    code: tuple[str, ...]

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"block name {self.name!r}: use letters, digits, _ . : -")
        if self.where not in ("after", "before"):
            raise ValueError(f"block {self.name}: where must be 'after' or 'before', not {self.where!r}")
        if not self.anchor.strip() or "\n" in self.anchor:
            raise ValueError(f"block {self.name}: anchor must be one non-empty line")
        if not self.code or any("\n" in line or "\r" in line for line in self.code):
            raise ValueError(f"block {self.name}: code must be a non-empty list of single lines")


@dataclass(frozen=True)
class Patch:
    patch_id: str
    version: str
    blocks: tuple[Block, ...]
    description: str = ""

    def __post_init__(self) -> None:
        if not _NAME.match(self.patch_id):
            raise ValueError(f"patch id {self.patch_id!r}: use letters, digits, _ . : -")
        if not _NAME.match(str(self.version)):
            raise ValueError(f"patch version {self.version!r}: use letters, digits, _ . : -")
        if not self.blocks:
            raise ValueError(f"patch {self.patch_id}: no blocks")
        names = [b.name for b in self.blocks]
        if len(set(names)) != len(names):
            raise ValueError(f"patch {self.patch_id}: block names repeat: {names}")
        anchors = [b.anchor.strip() for b in self.blocks]
        if len(set(anchors)) != len(anchors):
            raise ValueError(f"patch {self.patch_id}: two blocks share an anchor")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Patch:
        """Build from plain data (module arguments, a patch definition file)."""
        blocks = tuple(
            Block(
                name=str(b["name"]),
                anchor=str(b["anchor"]),
                where=str(b.get("where", "after")),
                code=tuple(str(line) for line in b["code"]),
            )
            for b in data["blocks"]
        )
        return cls(str(data["id"]), str(data["version"]), blocks, str(data.get("description", "")))

    @property
    def digest(self) -> str:
        """12 hex of sha256 over everything that decides the inserted text (not indentation)."""
        payload = {
            "id": self.patch_id,
            "version": self.version,
            "blocks": [[b.name, b.anchor.strip(), b.where, list(b.code)] for b in self.blocks],
        }
        blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


@dataclass
class FoundBlock:
    name: str
    version: str
    digest: str
    orig: str
    line: int  # 1-based line of the begin marker


@dataclass
class Inspection:
    """What a file holds with respect to one patch."""

    status: str  # UNPATCHED | PATCHED | OUTDATED | UNSUPPORTED | DAMAGED
    reason: str
    found: list[FoundBlock]
    original: str | None  # the text without our blocks (None when DAMAGED)
    desired: str | None  # the text with the wanted patch (None when it cannot be applied)
    anchor_lines: dict[str, list[int]] = field(default_factory=dict)  # block -> 1-based lines

    @property
    def found_version(self) -> str | None:
        versions = sorted({b.version for b in self.found})
        return ",".join(versions) if versions else None


@dataclass
class Result:
    path: str
    state: str
    changed: bool
    before: str  # inspection status before
    after: str  # inspection status after (as it would be, in check mode)
    found_version: str | None
    patch_version: str
    digest: str
    diff: str
    backup: str | None = None
    message: str = ""
    original_verified: bool | None = None  # absent: the restored text hashes to the recorded original


def sha12(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def split_lines(text: str) -> list[str]:
    """Split on '\\n' only, keeping it (str.splitlines also splits on form feeds etc.)."""
    parts = text.split("\n")
    lines = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def _strip_blocks(text: str, patch_id: str) -> tuple[str, list[FoundBlock]]:
    """Remove this patch's marked blocks; raise PatchError on unbalanced markers."""
    lines = split_lines(text)
    kept: list[str] = []
    found: list[FoundBlock] = []
    i = 0
    while i < len(lines):
        begin = _BEGIN.match(lines[i].rstrip("\n"))
        end = _END.match(lines[i].rstrip("\n"))
        if end and end["id"] == patch_id:
            raise PatchError(f"line {i + 1}: end marker of block {end['block']} without its begin marker")
        if not (begin and begin["id"] == patch_id):
            kept.append(lines[i])
            i += 1
            continue
        j = i + 1
        while j < len(lines):
            inner_begin = _BEGIN.match(lines[j].rstrip("\n"))
            if inner_begin and inner_begin["id"] == patch_id:
                raise PatchError(f"line {i + 1}: block {begin['block']} is not closed before line {j + 1}")
            inner_end = _END.match(lines[j].rstrip("\n"))
            if inner_end and inner_end["id"] == patch_id:
                if inner_end["block"] != begin["block"]:
                    raise PatchError(
                        f"line {j + 1}: end marker of block {inner_end['block']} closes block {begin['block']}"
                    )
                break
            j += 1
        else:
            raise PatchError(f"line {i + 1}: block {begin['block']} has no end marker")
        found.append(FoundBlock(begin["block"], begin["version"], begin["digest"], begin["orig"], i + 1))
        i = j + 1
    return "".join(kept), found


def _anchor_lines(lines: list[str], anchor: str) -> list[int]:
    want = anchor.strip()
    return [i for i, line in enumerate(lines) if line.strip() == want]


def _insert(
    original: str, patch: Patch, force: bool, orig: str | None = None
) -> tuple[str | None, str, dict[str, list[int]]]:
    """The patched text, or None and the reason when an anchor does not match exactly once."""
    lines = split_lines(original)
    orig = orig or sha12(original)
    positions: dict[str, list[int]] = {}
    problems: list[str] = []
    inserts: list[tuple[int, int, list[str]]] = []
    for order, block in enumerate(patch.blocks):
        hits = _anchor_lines(lines, block.anchor)
        positions[block.name] = [h + 1 for h in hits]
        if len(hits) == 0:
            problems.append(f"anchor of block {block.name} ({block.anchor.strip()!r}) not found")
            continue
        if len(hits) > 1 and not force:
            problems.append(
                f"anchor of block {block.name} ({block.anchor.strip()!r}) matches {len(hits)} lines "
                f"({', '.join(str(h + 1) for h in hits)}); expected exactly one"
            )
            continue
        idx = hits[0]
        anchor_line = lines[idx]
        if not anchor_line.endswith("\n"):
            if block.where == "after":
                problems.append(f"anchor of block {block.name} is the last line and has no newline")
                continue
        newline = "\r\n" if anchor_line.endswith("\r\n") else "\n"
        indent = anchor_line[: len(anchor_line) - len(anchor_line.lstrip(" \t"))]
        body = [
            f"{indent}# >>> hsx-patch {patch.patch_id} block={block.name} v={patch.version}"
            f" sha={patch.digest} orig={orig} >>>{newline}",
            *[(indent + code if code.strip() else "") + newline for code in block.code],
            f"{indent}# <<< hsx-patch {patch.patch_id} block={block.name} <<<{newline}",
        ]
        inserts.append((idx + 1 if block.where == "after" else idx, order, body))
    if problems:
        return None, "; ".join(problems), positions
    for pos, _order, body in sorted(inserts, key=lambda t: (t[0], t[1]), reverse=True):
        lines[pos:pos] = body
    return "".join(lines), "", positions


def examine(text: str, patch: Patch, force: bool = False) -> Inspection:
    """Classify `text` against `patch`; never raises for file content."""
    try:
        original, found = _strip_blocks(text, patch.patch_id)
    except PatchError as exc:
        return Inspection(DAMAGED, str(exc), [], None, None)
    desired, problem, positions = _insert(original, patch, force)
    if desired is None:
        status = UNSUPPORTED
        if found:
            problem += f" (the file also holds blocks of {patch.patch_id} v{found[0].version})"
        return Inspection(status, problem, found, original, None, positions)
    if not found:
        return Inspection(UNPATCHED, "no blocks of this patch", found, original, desired, positions)
    origs = {b.orig for b in found}
    if text != desired and len(origs) == 1:
        # Applied on a text that held another patch since removed: the recorded original differs,
        # the blocks are still the wanted ones.
        kept = _insert(original, patch, force, orig=origs.pop())[0]
        desired = kept if kept == text else desired
    if text == desired:
        return Inspection(
            PATCHED, f"{patch.patch_id} v{patch.version} applied", found, original, desired, positions
        )
    stale = sorted({f"v{b.version} ({b.digest})" for b in found if b.digest != patch.digest})
    if stale:
        reason = f"holds {', '.join(stale)}; wanted v{patch.version} ({patch.digest})"
    else:
        reason = f"blocks of v{patch.version} present but not all where the anchors are"
    return Inspection(OUTDATED, reason, found, original, desired, positions)


def unified_diff(before: str, after: str, path: str) -> str:
    return "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True),
            after.splitlines(keepends=True),
            fromfile=f"{path} (before)",
            tofile=f"{path} (after)",
        )
    )


def check_python(text: str, path: str) -> None:
    try:
        ast.parse(text, filename=path)
    except SyntaxError as exc:
        raise PatchError(f"{path}: the patched text does not parse: line {exc.lineno}: {exc.msg}") from None


def read_text(path: str) -> str:
    """The file's text (through a symlink); PatchError when it cannot be read, is not a regular
    file (a FIFO would block a reader forever) or is not UTF-8 (fsutil.read_regular, no cap)."""
    try:
        data = read_regular(path, None, follow_links=True)
    except OSError as exc:
        raise PatchError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PatchError(f"{path}: not UTF-8 (byte {exc.start})") from None


def write_target(path: str) -> str:
    """The file a write to `path` changes: `path`, or where its symlink (chain) finally points.

    A patch goes through a symlink rather than replacing it: Python imports the file the link
    points at either way, and replacing the link by a patched regular file would cut it from that
    file (which other paths may still reach) and leave a later revert unable to reach it. Refusing
    symlinks instead would fail installs that link their sources (Nix, some conda and editable
    layouts). OSError when the link dangles or loops."""
    if not os.path.islink(path):
        return path
    return os.path.realpath(path, strict=True)


def write_atomic(path: str, text: str) -> None:
    """Replace the file's content: temp file in its directory -> fsync -> rename over it.

    The file stays what it was apart from its bytes: owner, group and permission bits are the old
    file's (the job runs as root: a new file would be root's), and through a symlink the file it
    points at is replaced, the link kept. OSError (the file unchanged) when the file is missing or
    not a regular file, or its owner cannot be kept (not root, and not our file or group).
    """
    target = write_target(path)
    st = os.stat(target)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, "not a regular file", target)
    directory = os.path.dirname(os.path.abspath(target))
    fd, tmp = tempfile.mkstemp(prefix=".hsx-patch-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        tmp_st = os.stat(tmp)
        if (tmp_st.st_uid, tmp_st.st_gid) != (st.st_uid, st.st_gid):
            try:
                os.chown(tmp, st.st_uid, st.st_gid)  # before chmod: chown clears set-id bits
            except PermissionError as exc:
                raise PermissionError(
                    exc.errno,
                    f"cannot keep the file's owner {st.st_uid}:{st.st_gid} ({exc.strerror}); nothing changed",
                    target,
                ) from None
        os.chmod(tmp, stat.S_IMODE(st.st_mode))
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def backup_file(path: str) -> str:
    """Copy the file aside before changing it: `<path>.<timestamp>.hsx-bak` (mode and times kept)."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    dest = f"{path}.{stamp}.{os.getpid()}.hsx-bak"
    shutil.copy2(path, dest)
    return dest


def plan(text: str, patch: Patch, state: str = "present", force: bool = False) -> tuple[str, Inspection]:
    """The text the file should hold for `state`; PatchError when that cannot be reached safely."""
    if state not in ("present", "absent"):
        raise PatchError(f"state must be 'present' or 'absent', not {state!r}")
    ins = examine(text, patch, force=force)
    if ins.status == DAMAGED:
        raise PatchError(f"markers of {patch.patch_id} are damaged: {ins.reason}; fix the file by hand")
    if state == "absent":
        if ins.original is None:
            raise PatchError(f"{patch.patch_id}: the text before the patch cannot be rebuilt ({ins.reason}); "
                             "nothing changed")
        return ins.original, ins
    if ins.status == UNSUPPORTED or ins.desired is None:
        several = "matches" in ins.reason and not force
        hint = " (force applies at the first match when an anchor matches several lines)" if several else ""
        raise PatchError(f"cannot apply {patch.patch_id} v{patch.version}: {ins.reason}{hint}")
    return ins.desired, ins


def apply_file(
    path: str,
    patch: Patch,
    state: str = "present",
    force: bool = False,
    backup: bool = False,
    check_mode: bool = False,
    validate: str | None = "auto",
) -> Result:
    """Bring `path` to `state`; nothing is written in check mode or when anything is wrong."""
    text = read_text(path)
    new_text, ins = plan(text, patch, state, force)
    changed = new_text != text
    if (
        changed
        and state == "present"
        and (validate == "python" or (validate == "auto" and path.endswith(".py")))
    ):
        check_python(new_text, path)
    verified = None
    if state == "absent" and ins.found:
        verified = all(b.orig == sha12(new_text) for b in ins.found)
    result = Result(
        path=path,
        state=state,
        changed=changed,
        before=ins.status,
        after=(PATCHED if state == "present" else UNPATCHED),
        found_version=ins.found_version,
        patch_version=patch.version,
        digest=patch.digest,
        diff=unified_diff(text, new_text, path) if changed else "",
        original_verified=verified,
    )
    if state == "absent" and verified is False:
        result.message = "removed our blocks, but the rest of the file changed since the patch was applied"
    if changed and not check_mode:
        if backup:
            result.backup = backup_file(path)
        write_atomic(path, new_text)
    return result
