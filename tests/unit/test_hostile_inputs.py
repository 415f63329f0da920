"""Files we did not write are data, not truth (issue #30, items 1, 5, 12a-c).

The job runs as root under systemd and reads files that a crash, a bug or another user may have
written: dataset rows, status.json, run.json, an export view's mapping.jsonl, the recovery facts,
the files a patch changes. Each test here feeds one of them something hostile and checks that it
becomes a verdict (a row error with its line, an unreadable-status reason, a refused or corrected
mapping line), never a crash or a link to a file nobody verified. The property tests at the end
do the same over generated inputs: 200 examples each in `make test`, more with
HYPOTHESIS_PROFILE=long.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import stat
import time
from pathlib import Path

import pytest
from ansible_modules import load_module
from hsx_run_helpers import (
    LAYERS,
    SharedBackend,
    make_cfg,
    one_thread,  # noqa: F401  (autouse)
    run,
)
from hypothesis import event, given
from hypothesis import strategies as st
from property_settings import PROPERTY

from extraction import export_view as ev
from extraction.cli import main
from extraction.dataset import RowError, content_id, parse_line, scan_dataset
from extraction.export_mapping import ExportError, read_mapping
from extraction.report import host_report
from extraction.runner.plan import assigned_to
from extraction.tiny import write_tiny_dataset
from hsx.exitcodes import EXIT_OK, EXIT_USAGE
from hsx.index import load_index
from hsx.manifest import ManifestError, read_manifest_dict
from hsx.patching import Patch, apply_file
from hsx.status import ERRORS_NAME, describe, now_iso, pid_alive, process_gone, read_status, summarize

LONE = "\ud83d"  # the first half of an emoji: what a scraper that cut a UTF-16 string leaves
ROW_OK = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def _row(content: str = "hi", answer: str = "hello", **extra: object) -> dict:
    return {**extra, "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]}


def _jsonl(path: Path, rows: list) -> Path:
    # ensure_ascii: a lone surrogate becomes the JSON escape "\ud83d", as in scraped files
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ======================================================================= 1. dataset rows
def test_a_lone_surrogate_in_a_row_is_a_row_error_not_a_crash(tmp_path) -> None:
    ds = _jsonl(
        tmp_path / "d.jsonl",
        [
            ROW_OK,
            _row(f"half an emoji {LONE} here"),  # no id: the content id hashes the text
            _row(answer=f"x{LONE}", id="given-1"),  # an id: the tokenizer would meet the text
            _row(id=f"id-{LONE}"),  # the id itself
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": f"{LONE}"}]},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": f"a{LONE}"}]},
                          {"role": "assistant", "content": "b"}]},
            _row("a real emoji \U0001f600 is fine"),  # written as the pair "\ud83d\ude00"
        ],
    )
    assert '\\ud83d\\ude00 is fine' in ds.read_text()
    scan = scan_dataset(ds)
    assert [e.line for e in scan.entries] == [1, 7]
    assert [e.line for e in scan.errors] == [2, 3, 4, 5, 6]
    for err in scan.errors:
        assert "lone surrogate" in err.reason and "U+D83D" in err.reason, err.reason
    assert "messages[0].content" in scan.errors[0].reason
    assert "messages[1].content" in scan.errors[1].reason and scan.errors[1].sample_id == "given-1"
    assert "'id'" in scan.errors[2].reason and scan.errors[2].sample_id is None
    assert "conversations[1].value" in scan.errors[3].reason
    # every record goes into errors.jsonl as it is written there (json.dumps, ASCII)
    for err in scan.errors:
        json.dumps(err.to_record(), sort_keys=True).encode("ascii")


def test_the_hashes_of_ids_never_raise_on_a_lone_surrogate() -> None:
    """Defence in depth: the scan keeps such text out, but the hashes are total (and unchanged
    for valid text: 'surrogatepass' only differs where 'strict' raises)."""
    assert assigned_to(f"id-{LONE}", 0, 2) in (True, False)
    msgs = [{"role": "user", "content": LONE}]
    assert content_id(msgs).startswith("h")
    assert content_id([{"role": "user", "content": "é😀"}]) == content_id([{"role": "user", "content": "é😀"}])


def test_deeply_nested_or_odd_rows_are_row_errors(tmp_path) -> None:
    deep_id = {"id": json.loads("[" * 500 + "]" * 500), **ROW_OK}
    ds = _jsonl(
        tmp_path / "d.jsonl",
        [
            "[" * 100_000,  # RecursionError in json.loads
            json.dumps(deep_id),
            {"messages": [{"role": ["user"] * 3, "content": "x"}, {"role": "assistant", "content": "y"}]},
            {"messages": [{"role": "user", "content": [{"type": "image", "url": "x" * 10_000}]},
                          {"role": "assistant", "content": "y"}]},
            ROW_OK,
        ],
    )
    scan = scan_dataset(ds)
    assert [e.line for e in scan.entries] == [5]
    assert [e.line for e in scan.errors] == [1, 2, 3, 4]
    assert "nested too deeply" in scan.errors[0].reason
    for err in scan.errors:
        assert len(err.reason) < 400, err.reason  # a short reason, not the row back
        assert err.sample_id is None or isinstance(err.sample_id, str)
        json.dumps(err.to_record())


@pytest.mark.parametrize("num_shards", [1, 2])
def test_hsx_extract_records_surrogate_rows_and_goes_on(tmp_path, tiny_model_dir, num_shards) -> None:
    """End to end, as systemd starts it: exit 0, the rows in errors.jsonl with their lines."""
    good = write_tiny_dataset(tmp_path / "g.jsonl", 4, seed=3).read_text().splitlines()
    rows = [
        good[0],
        json.dumps(_row(f"scraped {LONE} chat")),
        good[1],
        json.dumps(_row(id=f"conv-{LONE}")),
        json.dumps(_row(answer=f"{LONE}!", id="conv-ok-id")),
        *good[2:],
    ]
    ds = tmp_path / "d.jsonl"
    ds.write_text("\n".join(rows) + "\n")
    good_ids = {e.sample_id for e in scan_dataset(tmp_path / "g.jsonl").entries}
    indexed: set[str] = set()
    for shard_index in range(num_shards):
        out = tmp_path / f"out{shard_index}"
        argv = ["extract", "--model", str(tiny_model_dir), "--dataset", str(ds), "--output", str(out),
                "--layers", LAYERS, "--dtype", "fp32", "--max-length", "24", "--progress", "off",
                "--num-shards", str(num_shards), "--shard-index", str(shard_index)]
        assert main(argv) == EXIT_OK
        errors = [json.loads(x) for x in (out / ERRORS_NAME).read_text().splitlines()]
        assert [(e["kind"], e["line"]) for e in errors] == [("row", 2), ("row", 4), ("row", 5)]
        assert all("lone surrogate" in e["reason"] for e in errors)
        assert read_status(str(out))["row_errors"] == 3
        indexed |= set(load_index(str(out)))
    assert indexed == good_ids


# ==================================================== 5. export-view follows the index, not the mapping
N_VIEW = 6


@pytest.fixture(scope="module")
def view_output(tiny_model_dir, tmp_path_factory) -> Path:
    """A finished tiny-model run of N_VIEW samples (read-only: copy before changing)."""
    root = tmp_path_factory.mktemp("view")
    ds = write_tiny_dataset(root / "d.jsonl", N_VIEW, seed=5)
    from extraction.backends.hf import HFBackend

    backend = SharedBackend(HFBackend(tiny_model_dir, [1, 3, 4], dtype="fp32"))
    out = root / "out"
    assert run(make_cfg(tiny_model_dir, ds, out), backend) == EXIT_OK
    return out


def _export(capsys, out: Path, dest: Path, link: str) -> tuple[int, dict]:
    capsys.readouterr()
    rc = main(["export-view", str(out), str(dest), "--layout", "specforge", "--json", "--workers", "1",
               "--link", link])
    text = capsys.readouterr().out
    return rc, (json.loads(text) if text.strip() else {})


def _mapping_lines(dest: Path) -> list[dict]:
    return [json.loads(x) for x in (dest / ev.MAPPING_NAME).read_text().splitlines()]


def _link_path(dest: Path, i: int) -> Path:
    return dest / ev.link_relpath(i, ev.DEFAULT_GROUP_SIZE)


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
@pytest.mark.parametrize("where", ["outside", "absolute", "other-sample"])
def test_a_tampered_mapping_line_is_reported_and_not_followed(
    view_output, tmp_path, capsys, link, where
) -> None:
    out = tmp_path / "out"
    shutil.copytree(view_output, out)
    dest = tmp_path / "view"
    rc, rep = _export(capsys, out, dest, link)
    assert rc == 0 and rep["linked"] == N_VIEW
    index = load_index(str(out))
    lines = _mapping_lines(dest)
    victim = lines[0]
    secret = tmp_path / "passwd"  # an /etc/passwd-like file on the same filesystem
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n")
    if where == "outside":
        bad_shard = os.path.relpath(secret, out)  # "../passwd"
    elif where == "absolute":
        bad_shard = str(secret)  # os.path.join(output, "/abs") is "/abs"
    else:
        bad_shard = lines[1]["shard"]  # another sample's (verified) shard
    tampered = dict(victim, shard=bad_shard)
    with open(dest / ev.MAPPING_NAME, "a") as f:  # a later line re-points a number
        f.write(json.dumps(tampered, sort_keys=True) + "\n")
    _link_path(dest, victim["i"]).unlink()  # so the next run must make the link again

    rc, rep = _export(capsys, out, dest, link)
    assert rc == 0, rep
    want = out / index[victim["id"]].path
    got = _link_path(dest, victim["i"])
    assert os.path.samefile(got, want)
    if link == "symlink":
        assert os.readlink(got) == str(want)
    bad_target = os.path.normpath(os.path.join(str(out), bad_shard))
    for p in dest.rglob("data_*.ckpt"):  # nothing in the view is the file the mapping named
        if where != "other-sample" or p != _link_path(dest, lines[1]["i"]):
            assert not os.path.samefile(p, bad_target), p
    (d,) = rep["mapping_disagreed"]
    assert d["i"] == victim["i"] and d["id"] == victim["id"]
    assert d["mapping_shard"] == bad_shard and d["shard"] == index[victim["id"]].path
    # The mapping says again what the link is: a correcting line for the same number.
    last = _mapping_lines(dest)[-1]
    assert (last["i"], last["id"], last["shard"]) == (victim["i"], victim["id"], index[victim["id"]].path)
    rc, rep = _export(capsys, out, dest, link)
    assert rc == 0 and rep["mapping_disagreed"] == [] and rep["relinked"] == 0


def test_a_tampered_mapping_does_not_repoint_an_existing_link(view_output, tmp_path, capsys) -> None:
    """The link is still right; a later mapping line pointing elsewhere must not 'repair' it."""
    out = tmp_path / "out"
    shutil.copytree(view_output, out)
    dest = tmp_path / "view"
    assert _export(capsys, out, dest, "symlink")[0] == 0
    victim = _mapping_lines(dest)[2]
    with open(dest / ev.MAPPING_NAME, "a") as f:
        f.write(json.dumps(dict(victim, shard="../../../../../../etc/passwd"), sort_keys=True) + "\n")
    before = os.readlink(_link_path(dest, victim["i"]))
    rc, rep = _export(capsys, out, dest, "symlink")
    assert rc == 0 and rep["relinked"] == 0 and len(rep["mapping_disagreed"]) == 1
    assert os.readlink(_link_path(dest, victim["i"])) == before


GOOD_META = {"format": "hsx-export-view", "version": 1, "layout": "specforge", "link": "symlink",
             "group_size": 2000, "run": {}}
HOSTILE_META = {
    "a list": b"[1]",
    "deeply nested": b'{"format": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "group size 0": json.dumps({**GOOD_META, "group_size": 0}).encode(),
    "group size a string": json.dumps({**GOOD_META, "group_size": "2000"}).encode(),
    "group size true": json.dumps({**GOOD_META, "group_size": True}).encode(),
    "link something else": json.dumps({**GOOD_META, "link": "copy"}).encode(),
    "run a list": json.dumps({**GOOD_META, "run": [1]}).encode(),
    "version a float": json.dumps({**GOOD_META, "version": 1.0}).encode(),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_META))
def test_a_damaged_export_json_is_refused(tmp_path, case) -> None:
    (tmp_path / ev.META_NAME).write_bytes(HOSTILE_META[case])
    with pytest.raises(ExportError, match="export.json"):
        ev.read_meta(str(tmp_path))
    (tmp_path / ev.META_NAME).write_text(json.dumps(GOOD_META))
    assert ev.read_meta(str(tmp_path)) == GOOD_META


# ============================================================ 12a. status.json we did not write
def _good_status() -> dict:
    now = time.time()
    return {
        "state": "running", "message": "", "done": 5, "total": 10, "written": 5, "skipped_existing": 0,
        "errors": 0, "row_errors": 0, "samples_per_s": 2.0, "tokens_per_s": 10.0, "eta_s": 2.5,
        "bytes_written": 100, "free_bytes": 10**12, "reserve_bytes": 10, "pid": os.getpid(),
        "host": socket.gethostname(), "output": "/x", "started_at": now_iso(now - 60),
        "updated_at": now_iso(now), "history": [[now - 30, 3], [now - 5, 5]],
    }


HOSTILE_STATUS = {
    "not JSON": b"{oops",
    "not UTF-8": b'{"state": "\xff"}',
    "a list": b"[1, 2]",
    "a string": b'"running"',
    "done as a string": json.dumps({**_good_status(), "done": "5"}).encode(),
    "done as a bool": json.dumps({**_good_status(), "done": True}).encode(),
    "total as a float": json.dumps({**_good_status(), "total": 10.5}).encode(),
    "history not a list": json.dumps({**_good_status(), "history": "abc"}).encode(),
    "history point of three": json.dumps({**_good_status(), "history": [[1, 2, 3]]}).encode(),
    "history point of strings": json.dumps({**_good_status(), "history": [["now", "5"]]}).encode(),
    "history point huge": json.dumps({**_good_status(), "history": [[10**400, 1]]}).encode(),
    "samples_per_s a string": json.dumps({**_good_status(), "samples_per_s": "fast"}).encode(),
    "eta NaN": json.dumps({**_good_status(), "eta_s": float("nan")}).encode(),
    "eta Infinity": json.dumps({**_good_status(), "eta_s": float("inf")}).encode(),
    "pid huge": json.dumps({**_good_status(), "pid": 10**30}).encode(),
    "pid negative": json.dumps({**_good_status(), "pid": -1}).encode(),
    "pid a list": json.dumps({**_good_status(), "pid": [1]}).encode(),
    "message an object": json.dumps({**_good_status(), "message": {"a": 1}}).encode(),
    "state a number": json.dumps({**_good_status(), "state": 3}).encode(),
    "updated_at a number": json.dumps({**_good_status(), "updated_at": 3}).encode(),
    "deeply nested": b'{"state": "running", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "huge": b'{"message": "' + b"x" * (5 * 1024 * 1024) + b'"}',
}
extraction_status = load_module("extraction_status_info")


@pytest.mark.parametrize("case", sorted(HOSTILE_STATUS))
def test_a_malformed_status_json_is_a_verdict_not_a_crash(tmp_path, case, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_text("{}")
    (out / "status.json").write_bytes(HOSTILE_STATUS[case])
    with pytest.raises(ValueError) as exc:
        read_status(str(out))
    assert "status.json" in str(exc.value) and len(str(exc.value)) < 500
    # library/extraction_status (recover.yml's assess): an answer, not a traceback
    result = extraction_status.ExtractionStatus(str(out), 120).read()
    assert result["state"] == "none" and result["making_progress"] is False
    # hsx status: a usage error that says why
    capsys.readouterr()
    assert main(["status", str(out)]) == EXIT_USAGE
    assert "status.json" in capsys.readouterr().err


def test_a_well_formed_status_json_still_reads(tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    data = {**_good_status(), "model": "/m", "shard_index": 0, "num_shards": 1, "resume_seconds": 0.1,
            "free_bytes": None, "eta_s": None, "host": None, "something_new": {"x": [1]}}
    (out / "status.json").write_text(json.dumps(data))
    assert read_status(str(out)) == data


def test_pid_alive_on_odd_pids() -> None:
    host = socket.gethostname()
    for pid in (10**30, -1, 0, True, [1], "abc", None, 2**31):
        assert pid_alive(pid, host) is False, pid
    assert pid_alive(str(os.getpid()), host) is True  # as before: a pid given as text


# ======================================================== 12b. the report counts, not list lengths
def _shards_facts(**shards: object) -> dict:
    base = {"level": "full", "ok": 100, "missing_count": 0, "orphans_removed": 0}
    return {"host": "n1", "mode": "apply", "shard_verify_result": {**base, **shards}}


def _shards_check(facts: dict) -> dict:
    return {c["name"]: c for c in host_report(facts)["checks"]}["shards"]


def test_report_uses_the_quarantined_count_not_the_capped_list() -> None:
    listed = [f"quarantine/00/s{i}.pt" for i in range(50)]
    bad = [{"sample_id": f"s{i}", "path": f"shards/00/s{i}.pt", "reason": "crc"} for i in range(50)]
    facts = _shards_facts(bad_count=60, bad=bad, quarantined=listed, quarantined_count=60)
    check = _shards_check(facts)
    assert check["ok"] and "60 quarantined" in check["detail"], check
    assert host_report(facts)["after"]["shards_quarantined"] == 60
    # fewer quarantined than bad, by the counts: not ok
    assert not _shards_check(_shards_facts(bad_count=60, bad=bad, quarantined=listed, quarantined_count=50))["ok"]


def test_report_without_a_count_sees_a_list_cut_at_max_listed() -> None:
    """A shard_verify without quarantined_count: both lists stop at max_listed (50 here) while
    bad_count says 60; the quarantined list being as long as the cut bad list means the cap, not
    10 bad shards left in place."""
    listed = [f"quarantine/00/s{i}.pt" for i in range(50)]
    bad = [{"sample_id": f"s{i}", "path": f"shards/00/s{i}.pt", "reason": "crc"} for i in range(50)]
    check = _shards_check(_shards_facts(bad_count=60, bad=bad, quarantined=listed))
    assert check["ok"] and "at least 50 quarantined" in check["detail"], check
    # not cut: 3 bad, 2 quarantined is 2
    bad3 = bad[:3]
    assert not _shards_check(_shards_facts(bad_count=3, bad=bad3, quarantined=listed[:2]))["ok"]
    assert not _shards_check(_shards_facts(bad_count=3, bad=bad3, quarantined=[]))["ok"]


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


# ==================================================================== property tests
# Text as scraped data has it: any code point incl. lone surrogates and control characters.
TEXT = st.text(st.characters(exclude_categories=[]), max_size=12) | st.lists(
    st.sampled_from([LONE, "\udc00", "\ude00", "\x00", "\x1b", "\u2028", "\ufeff", "a", "\U0001f600"]),
    max_size=6,
).map("".join)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT
JSON = st.recursive(
    SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(TEXT, kids, max_size=4), max_leaves=12
)
ROLES = st.sampled_from(["user", "assistant", "human", "gpt", "system", "tool", "robot"]) | JSON
CONTENT = TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=3) | JSON


def _turn(shape: str) -> st.SearchStrategy:
    role_key, text_key = ("from", "value") if shape == "conversations" else ("role", "content")
    return st.fixed_dictionaries({role_key: ROLES, text_key: CONTENT})


ROWS = st.sampled_from(["conversations", "messages"]).flatmap(
    lambda shape: st.fixed_dictionaries(
        {shape: st.lists(_turn(shape), max_size=4)}, optional={"id": JSON | TEXT | st.integers()}
    )
)


# Rows that are right but for what the text holds: the rows the surrogate check must tell apart.
GOOD_ROWS = st.builds(
    lambda turns, answer, given: {**given, "messages": [*turns, {"role": "assistant", "content": answer}]},
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": TEXT}),
             max_size=3),
    TEXT,
    st.just({}) | st.fixed_dictionaries({"id": TEXT.filter(lambda t: t.strip()) | st.integers(0, 10**6)}),
)


def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


LINES = st.one_of(
    GOOD_ROWS.map(lambda r: json.dumps(r).encode()),
    GOOD_ROWS.map(lambda r: json.dumps(r, ensure_ascii=False).encode("utf-8", "surrogatepass")),
    ROWS.map(lambda r: json.dumps(r).encode()),  # ensure_ascii: lone surrogates as \udXXX escapes
    ROWS.map(lambda r: json.dumps(r, ensure_ascii=False).encode("utf-8", "surrogatepass")),  # raw CESU
    JSON.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b" ")),
    st.integers(1, 200_000).map(_deep),
    st.sampled_from([b"", b"   ", b"\t\r", b"\xef\xbb\xbf{}"]),
)


@PROPERTY
@given(st.lists(LINES, max_size=12))
def test_property_scan_gives_one_verdict_per_line_and_never_raises(tmp_path_factory, lines) -> None:
    path = tmp_path_factory.mktemp("p") / "d.jsonl"
    data = b"\n".join(lines) + b"\n"
    path.write_bytes(data)
    scan = scan_dataset(path)  # must not raise
    expect = [n for n, raw in enumerate(data.split(b"\n")[:-1], 1) if raw.strip()]
    verdicts = sorted([e.line for e in scan.entries] + [e.line for e in scan.errors])
    assert verdicts == expect  # one each: ok or a row error, with its line
    event(f"rows ok: {min(len(scan.entries), 2)}{'+' if len(scan.entries) >= 2 else ''}")
    event(f"a lone surrogate rejected: {any('lone surrogate' in e.reason for e in scan.errors)}")
    event(f"nested too deeply rejected: {any('too deeply' in e.reason for e in scan.errors)}")
    for e in scan.entries:
        e.sample_id.encode("utf-8")  # valid text only: shard names, hashes, logs
        assigned_to(e.sample_id, 1, 3)
        (conv,) = [parse_line(data.split(b"\n")[e.line - 1] + b"\n", e.line)]
        for m in conv.messages:
            m["content"].encode("utf-8")
    for err in scan.errors:
        assert isinstance(err, RowError) and err.reason and len(err.reason) < 1000
        assert err.sample_id is None or isinstance(err.sample_id, str)
        json.dumps(err.to_record(), sort_keys=True)  # as errors.jsonl writes it


def _valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@PROPERTY
@given(st.lists(GOOD_ROWS, max_size=8), st.booleans())
def test_property_a_good_row_is_refused_exactly_when_its_text_is_not_unicode(
    tmp_path_factory, rows, raw_utf8
) -> None:
    path = tmp_path_factory.mktemp("g") / "d.jsonl"
    dump = (lambda r: json.dumps(r, ensure_ascii=False).encode("utf-8", "surrogatepass")) if raw_utf8 else (
        lambda r: json.dumps(r).encode()
    )
    path.write_bytes(b"".join(dump(r) + b"\n" for r in rows))
    scan = scan_dataset(path)
    ok = {e.line for e in scan.entries}
    errors = {e.line: e.reason for e in scan.errors}
    for n, row in enumerate(rows, 1):
        if not raw_utf8:  # what a reader gets: JSON joins an escaped pair "\\ud83d\\ude00" into one
            row = json.loads(json.dumps(row))
        texts = [m["content"] for m in row["messages"]] + ([row["id"]] if isinstance(row.get("id"), str) else [])
        said = any(m["role"] == "assistant" and m["content"].strip() for m in row["messages"])
        if all(_valid_unicode(t) for t in texts) and not said:  # nothing to train on
            assert "every assistant turn is empty" in errors[n] or "duplicate id" in errors[n], errors.get(n)
        elif all(_valid_unicode(t) for t in texts):
            assert n in ok or "duplicate id" in errors[n], (row, errors.get(n))
        elif raw_utf8:  # CESU bytes of a surrogate are not UTF-8: the line is not even JSON text
            assert "invalid JSON" in errors[n] or "lone surrogate" in errors[n], errors.get(n)
        else:
            assert "lone surrogate" in errors[n], errors.get(n)
    event(f"rows ok: {len(ok) > 0}, refused for a surrogate: {any('surrogate' in r for r in errors.values())}")


STATUS_KEYS = ["state", "message", "done", "total", "written", "skipped_existing", "errors", "row_errors",
               "samples_per_s", "tokens_per_s", "eta_s", "bytes_written", "free_bytes", "reserve_bytes",
               "pid", "host", "output", "started_at", "updated_at", "history", "model", "num_shards"]
STATUS_VALUES = (
    JSON
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.lists(st.lists(st.integers() | st.floats() | TEXT, max_size=3), max_size=4)
)
STATUS_DOCS = st.one_of(
    st.dictionaries(st.sampled_from(STATUS_KEYS), STATUS_VALUES).map(lambda d: json.dumps(d).encode()),
    st.builds(lambda good, bad: json.dumps({**good, **bad}).encode(), st.just(_good_status()),
              st.dictionaries(st.sampled_from(STATUS_KEYS), STATUS_VALUES, max_size=2)),
    st.fixed_dictionaries({}, optional={k: st.just(v) for k, v in _good_status().items()}).map(
        lambda d: json.dumps(d).encode()  # any part of a good status
    ),
    st.builds(  # well-formed but for values of about the right kind
        lambda good, bad: json.dumps({**good, **bad}).encode(), st.just(_good_status()),
        st.dictionaries(st.sampled_from(STATUS_KEYS),
                        st.none() | st.integers(-5, 10**7) | st.floats(-1, 1e7) | TEXT, max_size=3),
    ),
    JSON.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=60),
    st.integers(1, 200_000).map(_deep),
)


@PROPERTY
@given(STATUS_DOCS)
def test_property_read_status_is_a_dict_or_a_reason(tmp_path_factory, raw) -> None:
    out = tmp_path_factory.mktemp("s")
    (out / "status.json").write_bytes(raw)
    try:
        status = read_status(str(out))
    except ValueError as e:
        assert "status.json" in str(e)
        status = None
    event(f"status.json {'refused' if status is None else 'read'}")
    if status is not None:  # what every caller does with it must not raise
        assert isinstance(status, dict)
        status["pid_alive"] = pid_alive(status.get("pid"), status.get("host"))
        process_gone(status)
        describe(status)
        summarize([status, status])
        for k in ("done", "total", "eta_s", "samples_per_s"):
            v = status.get(k)
            assert v is None or (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v))
    result = extraction_status.ExtractionStatus(str(out), 120).read()
    assert isinstance(result["making_progress"], bool)


@PROPERTY
@given(st.one_of(JSON.map(lambda v: json.dumps(v).encode()), st.binary(max_size=60),
                 st.dictionaries(TEXT, JSON).map(lambda d: json.dumps(d).encode())))
def test_property_read_manifest_dict_is_a_dict_or_a_manifest_error(tmp_path_factory, raw) -> None:
    out = tmp_path_factory.mktemp("m")
    (out / "run.json").write_bytes(raw)
    try:
        data = read_manifest_dict(str(out))
    except ManifestError as e:
        assert str(e)
        event("run.json refused")
    else:
        assert isinstance(data, dict)
        event("run.json read")


def test_read_manifest_dict_on_deeply_nested_json(tmp_path) -> None:
    (tmp_path / "run.json").write_bytes(b'{"model": ' + _deep(100_000) + b"}")
    with pytest.raises(ManifestError):
        read_manifest_dict(str(tmp_path))


MAPPING_FIELDS = st.fixed_dictionaries(
    {"i": st.integers(-3, 10**20) | JSON, "id": TEXT | JSON, "output": TEXT | JSON, "shard": TEXT | JSON}
)
GOOD_MAPPING_LINE = st.builds(
    lambda i, s: json.dumps({"i": i, "id": s, "output": "/o", "shard": f"shards/00/{s}.pt"}).encode() + b"\n",
    st.integers(0, 5),
    st.sampled_from(["a", "b", "c"]),
)
MAPPING_LINES = st.one_of(
    MAPPING_FIELDS.map(lambda d: json.dumps(d).encode() + b"\n"),
    GOOD_MAPPING_LINE,
    JSON.map(lambda v: json.dumps(v).encode() + b"\n"),
    st.binary(max_size=40),
    st.integers(1, 200_000).map(lambda n: _deep(n) + b"\n"),
)


@PROPERTY
@given(
    st.lists(MAPPING_LINES, max_size=8)
    | st.builds(lambda good, tail: [*good, *tail], st.lists(GOOD_MAPPING_LINE, max_size=6),
                st.lists(MAPPING_LINES.map(lambda b: b.rstrip(b"\n")), max_size=1))
)
def test_property_read_mapping_is_records_or_an_export_error(tmp_path_factory, lines) -> None:
    dest = tmp_path_factory.mktemp("v")
    (dest / ev.MAPPING_NAME).write_bytes(b"".join(lines))
    try:
        records, torn = read_mapping(str(dest))
    except ExportError as e:
        assert "mapping" in str(e)
        event("mapping refused")
        return
    assert isinstance(torn, bool)
    event(f"mapping read: {min(len(records), 2)}{'+' if len(records) >= 2 else ''} records, torn {torn}")
    ids = set()
    for i, rec in records.items():
        assert type(rec.i) is int and rec.i == i and rec.i >= 0
        assert all(type(v) is str for v in (rec.sample_id, rec.output, rec.shard))
        assert rec.sample_id not in ids
        ids.add(rec.sample_id)
