"""Index lines are data, not truth (issue #30 item 4, and the safe-name part of item 12).

A line whose CRC checks out was written by someone, not necessarily by our writer for this
sample: two entries naming one shard, an entry naming a path that is not its sample's own
shard path, a JSON body nested deeply enough to exhaust the parser's recursion, numbers that do
not convert. Each line gets one verdict, and nothing that reads the index raises.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path

import pytest
from ansible_modules import load_module
from hypothesis import event, given
from hypothesis import strategies as st
from property_settings import PROPERTY
from shard_helpers import make_run, manifest

from extraction.export.view import export_view
from extraction.runner.resume import verified_done
from extraction.shards.verify import verify_output
from hsx.index import (
    IndexEntry,
    append_index,
    decode_index_line,
    encode_index_line,
    entry_problems,
    index_record,
    index_rows,
    load_index,
    read_index,
    replay_index,
    tombstone_record,
)
from hsx.layout import INDEX_NAME, SHARD_RELPATH_RE, bucket_of, safe_name, shard_relpath


def resume_done(root: Path, wanted: set[str]) -> tuple[set[str], int, list[dict]]:
    recorded: list[dict] = []
    done, bad = verified_done(str(root), manifest(), wanted, recorded.append)
    return done, bad, recorded


def raw_line(body: bytes) -> bytes:
    """An index line around any body, its CRC valid."""
    return body + b"\t%08x\n" % zlib.crc32(body)


def append_raw(root: Path, *lines: bytes) -> None:
    with open(root / INDEX_NAME, "ab") as f:
        f.write(b"".join(lines))


def links(dest: Path) -> dict[str, str]:
    """data_i name -> the shard it links to, for every link of an exported view."""
    return {p.name: os.path.realpath(p) for p in dest.rglob("data_*.ckpt")}


# --- (a) two entries naming one shard ------------------------------------------------------------
def test_two_entries_naming_one_shard_hide_no_lost_sample(tmp_path):
    out = tmp_path / "out"
    _, entries = make_run(out, n=3)
    s0, s1, s2 = entries
    (out / s1.path).unlink()  # s001's shard is lost ...
    append_index(str(out), [{**index_record(s0), "id": s1.sample_id}])  # ... and its line names s000's
    for level in ("quick", "full"):
        r = verify_output(str(out), level)
        bad = sorted((b.sample_id, b.path) for b in r.bad)
        assert bad == [(s0.sample_id, s0.path), (s1.sample_id, s0.path)], (level, r.to_dict())
        for b in r.bad:
            assert "s000" in b.reason and "s001" in b.reason and b.reason.endswith("(not touched)")
        assert r.exit_code == 1 and r.unindexed == [s0.path]
    done, bad_count, recorded = resume_done(out, {e.sample_id for e in entries})
    assert done == {s2.sample_id} and bad_count == 2
    assert sorted(x["sample_id"] for x in recorded) == ["s000", "s001"]
    report = export_view([str(out)], str(tmp_path / "view"), level="quick")
    linked = links(tmp_path / "view")
    assert len(set(linked.values())) == len(linked) == report.added == 1
    assert list(linked.values()) == [os.path.realpath(out / s2.path)]
    # quarantine tombstones both lines and moves nothing: the shard's owner is redone
    r = verify_output(str(out), "quick", quarantine=True)
    assert r.quarantined == [] and (out / s0.path).exists()
    assert set(load_index(str(out))) == {s2.sample_id}


# --- (b) paths that are not the sample's own shard path ------------------------------------------
def _elsewhere(out: Path, s0) -> dict[str, str]:
    """Entries for sample "s001" naming a copy of s000's good shard somewhere else."""
    outside = out.parent / "other" / "shards" / bucket_of("s001") / "s001.pt"
    outside.parent.mkdir(parents=True)
    shutil.copy(out / s0.path, outside)
    other_bucket = next(f"{b:02x}" for b in range(256) if f"{b:02x}" != bucket_of("s001"))
    wrong_bucket = out / "shards" / other_bucket / "s001.pt"
    wrong_bucket.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(out / s0.path, wrong_bucket)
    return {
        "outside": f"../other/shards/{bucket_of('s001')}/s001.pt",
        "absolute": str(outside),
        "dotdot inside": f"shards/{bucket_of('s001')}/../{bucket_of('s001')}/s001.pt",
        "wrong bucket": f"shards/{other_bucket}/s001.pt",
        "another sample's shard": s0.path,
    }


@pytest.mark.parametrize(
    "kind", ["outside", "absolute", "dotdot inside", "wrong bucket", "another sample's shard"]
)
def test_an_entry_counts_only_at_its_own_shard_path(tmp_path, kind):
    out = tmp_path / "out"
    _, (s0,) = make_run(out, n=1)
    path = _elsewhere(out, s0)[kind]
    if kind == "another sample's shard":
        append_index(str(out), [tombstone_record(s0.sample_id, "test")])  # s000's shard, unindexed
    append_index(str(out), [{**index_record(s0), "id": "s001", "path": path}])
    for level in ("quick", "full"):
        r = verify_output(str(out), level)
        assert [(b.sample_id, b.path) for b in r.bad] == [("s001", path)], (level, r.to_dict())
        assert r.bad[0].reason.endswith("(not touched)")
    done, bad, recorded = resume_done(out, {"s000", "s001"})
    assert "s001" not in done and recorded[-1]["sample_id"] == "s001"
    assert recorded[-1]["reason"] == "redo: " + r.bad[0].reason  # one rule: verify's and resume's


# --- (c) lines that do not parse into an entry ---------------------------------------------------
DEEP = 100_000


def _hostile_lines() -> dict[str, bytes]:
    nest = b"[" * DEEP + b"]" * DEEP
    return {
        "nested array": raw_line(nest),
        "nested in an entry": raw_line(
            b'{"id":"x","path":' + nest + b',"size":1,"checksum":"c","num_tokens":1}'
        ),
        "nested object": raw_line(b'{"a":' * DEEP + b"1" + b"}" * DEEP),
        "infinite size": encode_index_line(
            {"id": "x", "path": shard_relpath("x"), "size": float("inf"), "checksum": "c", "num_tokens": 1}
        ),
        "nan tokens": encode_index_line(
            {"id": "x", "path": shard_relpath("x"), "size": 1, "checksum": "c", "num_tokens": float("nan")}
        ),
        "empty id": encode_index_line(
            {"id": "", "path": "shards/00/.pt", "size": 1, "checksum": "c", "num_tokens": 1}
        ),
    }


@pytest.mark.parametrize("kind", list(_hostile_lines()))
def test_a_hostile_line_is_one_bad_line_for_every_reader(tmp_path, kind):
    out = tmp_path / "out"
    _, entries = make_run(out, n=2)
    line = _hostile_lines()[kind]
    append_raw(out, line, encode_index_line(index_record(entries[1])))  # the bad line is not the last
    state = read_index(str(out))
    assert set(state.entries) == {"s000", "s001"} and state.bad_lines == 1 and not state.torn_tail
    assert [n for n, _ in state.problems] == [3] and state.problems[0][1]
    assert state.records + len(state.problems) == 4  # one verdict per line
    for level in ("quick", "full"):
        r = verify_output(str(out), level)
        assert r.index_bad_lines == 1 and r.ok == 2 and r.bad == [] and r.exit_code == 0
    assert resume_done(out, {"s000", "s001"})[0] == {"s000", "s001"}
    status = load_module("extraction_status_info").ExtractionStatus(str(out), progress_window=60).read()
    assert status["done"] == 2 and status["index_bad_lines"] == 1
    assert export_view([str(out)], str(tmp_path / "view"), level="quick").added == 2
    append_raw(out, line.rstrip(b"\n"))  # as the last line, without its newline: a torn tail
    state = read_index(str(out))
    assert state.torn_tail and state.bad_lines == 1 and len(state.problems) == 2


def test_two_values_in_one_line_shift_no_other_line(tmp_path):
    """`{..},{..}` has a valid CRC but is not one JSON value: parsed with the other lines joined in
    one array, it gave two records and every later line took its predecessor's record (here: two
    tombstones applied, s002's own line lost)."""
    out = tmp_path / "out"
    _, entries = make_run(out, n=3)
    tombs = [json.dumps(tombstone_record(e.sample_id, "x"), sort_keys=True).encode() for e in entries[:2]]
    append_raw(out, raw_line(b",".join(tombs)), encode_index_line(index_record(entries[2])))
    state = read_index(str(out))
    assert set(state.entries) == {"s000", "s001", "s002"} and state.bad_lines == 1
    assert state.problems[0][0] == 4 and "not JSON" in state.problems[0][1]
    assert verify_output(str(out), "quick").ok == 3
    assert resume_done(out, {"s000", "s001", "s002"})[0] == {"s000", "s001", "s002"}


def test_deep_nesting_reason_says_so(tmp_path):
    tombstone = encode_index_line(tombstone_record("y", "test"))
    (tmp_path / INDEX_NAME).write_bytes(_hostile_lines()["nested array"] + tombstone)
    state = read_index(str(tmp_path))
    assert state.bad_lines == 1 and "nested" in state.problems[0][1]


# --- item 12: names ------------------------------------------------------------------------------
@pytest.mark.parametrize("sample_id", ["a\n", "conv-1\n", "x" * 10 + "\n"])
def test_a_trailing_newline_is_not_a_safe_name(sample_id):
    name = safe_name(sample_id)
    assert "\n" not in name and "~" in name
    rel = shard_relpath(sample_id)
    assert "\n" not in rel and SHARD_RELPATH_RE.fullmatch(rel)
    assert safe_name(sample_id.rstrip("\n")) != name  # still injective


def test_shard_relpath_pattern_rejects_a_trailing_newline():
    rel = shard_relpath("s000")
    assert SHARD_RELPATH_RE.match(rel) and not SHARD_RELPATH_RE.match(rel + "\n")


def test_an_entry_path_with_a_trailing_newline_is_not_counted(tmp_path):
    out = tmp_path / "out"
    _, (s0,) = make_run(out, n=1)
    append_index(str(out), [{**index_record(s0), "path": s0.path + "\n"}])
    r = verify_output(str(out), "quick")
    assert [b.sample_id for b in r.bad] == ["s000"] and r.unindexed == [s0.path]
    assert resume_done(out, {"s000"})[0] == set()


def test_json_line_encoding_is_what_the_crc_covers():
    line = encode_index_line({"id": "a", "n": 1})
    body, crc = line[:-1].split(b"\t")
    assert json.loads(body) == {"id": "a", "n": 1} and int(crc, 16) == zlib.crc32(body)


# --- property: any index line gets one verdict, and nothing that reads the index raises ----------


@pytest.fixture(scope="module")
def run3(tmp_path_factory) -> tuple[Path, list, bytes]:
    """A run of three good shards, its index as written (read-only: tests rewrite a copy's index)."""
    root = tmp_path_factory.mktemp("run3")
    _, entries = make_run(root, n=3)
    return root, entries, (root / INDEX_NAME).read_bytes()


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _json_line(value) -> bytes:
    return raw_line(json.dumps(value).encode("ascii"))


@st.composite
def index_lines(draw, entries: list) -> list[bytes]:
    """Index lines as anyone may have written them: real ones, entries with any field (ids and
    paths of the run's samples mixed up, paths outside, numbers that do not convert), tombstones,
    any JSON, two values in one line, nesting past the parser's recursion, raw bytes with and
    without a valid CRC, and a torn last line."""
    real = [encode_index_line(index_record(e)) for e in entries]
    ids = (
        st.sampled_from([e.sample_id for e in entries] + ["x", "", "a\n", "../e"])
        | st.text(max_size=10)
        | _JSON
    )
    paths = (
        st.sampled_from(
            [e.path for e in entries] + ["../x.pt", "/abs/x.pt", "shards/00/s000.pt", "shards/ab/..pt"]
        )
        | st.builds(shard_relpath, st.text(min_size=1, max_size=10))
        | st.text(max_size=20)
        | _JSON
    )
    numbers = st.integers() | st.floats() | st.sampled_from([entries[0].size, entries[0].num_tokens]) | _JSON
    entry = st.fixed_dictionaries(
        {
            "id": ids,
            "path": paths,
            "size": numbers,
            "checksum": st.text(max_size=14) | _JSON,
            "num_tokens": numbers,
        },
        optional={"removed": _JSON, "reason": st.text(max_size=8)},
    )
    one = st.one_of(
        st.sampled_from(real),
        entry.map(_json_line),
        _JSON.map(_json_line),
        st.tuples(entry, entry).map(
            lambda ab: raw_line(json.dumps(ab[0]).encode() + b"," + json.dumps(ab[1]).encode())
        ),
        st.integers(1, 150_000).map(lambda n: raw_line(b"[" * n + b"]" * n)),
        st.integers(1, 50_000).map(lambda n: raw_line(b'{"id":' * n + b"1" + b"}" * n)),
        st.binary(max_size=60).map(lambda b: raw_line(b.replace(b"\n", b""))),
        st.binary(max_size=60).map(lambda b: b.replace(b"\n", b"") + b"\n"),
    )
    lines = draw(st.lists(one, max_size=10))
    if draw(st.booleans()):
        lines.append(draw(st.binary(max_size=40)).replace(b"\n", b""))  # torn: no newline
    return lines


def _one_verdict_per_line(lines: list[bytes]):
    state = replay_index(lines)
    assert state.records + len(state.problems) == len(lines)
    assert state.bad_lines + state.torn_tail == len(state.problems)
    numbers = [n for n, _ in state.problems]
    assert numbers == sorted(set(numbers)) and all(why for _, why in state.problems)
    for line in lines:
        decode_index_line(line)  # never raises
    rows = index_rows(lines)
    if rows is not None:  # the fast path agrees with the replay
        assert {sid: IndexEntry(*row) for sid, row in rows.items()} == state.entries
    return state


@PROPERTY
@given(data=st.data())
def test_any_index_lines_get_one_verdict_each(run3, data):
    _, entries, _ = run3
    lines = data.draw(index_lines(entries), label="lines")
    state = _one_verdict_per_line(lines)
    problems = entry_problems((sid, e.path) for sid, e in state.entries.items())
    assert all(why.endswith("(not touched)") for why in problems.values())
    paths = [e.path for e in state.entries.values()]
    for sid, e in state.entries.items():  # an entry counts only at its own shard path, alone there
        assert (sid in problems) == (e.path != shard_relpath(sid) or paths.count(e.path) > 1)
    event(f"bad lines: {bool(state.problems)}; untrusted entries: {bool(problems)}")


@pytest.fixture(scope="module")
def run3_copy(run3, tmp_path_factory) -> Path:
    """A copy of run3 whose index the examples rewrite."""
    root = tmp_path_factory.mktemp("run3copy") / "run"
    shutil.copytree(run3[0], root)
    return root


@PROPERTY
@given(data=st.data(), keep=st.integers(0, 3), level=st.sampled_from(["quick", "full"]))
def test_any_index_lines_in_a_run_verify_and_resume_agree(run3, run3_copy, data, keep, level):
    _, entries, good = run3
    root = run3_copy
    lines = data.draw(index_lines(entries), label="lines")
    (root / INDEX_NAME).write_bytes(b"".join(good.splitlines(keepends=True)[:keep] + lines))
    state = read_index(str(root))
    assert load_index(str(root)) == state.entries
    r = verify_output(str(root), level)
    assert r.index_bad_lines == state.bad_lines and not r.errors and r.exit_code in (0, 1)
    named = [b.sample_id for b in r.bad if b.sample_id is not None] + r.missing
    assert len(named) == len(set(named)) and set(named) <= set(state.entries)
    done, bad, recorded = resume_done(root, set(state.entries))
    # the same rule and the same check: resume's done set is what verify did not flag
    assert done == set(state.entries) - set(named), r.to_dict()
    assert bad == len(recorded) == len(state.entries) - len(done)
    event(f"{level}: entries {bool(state.entries)}, flagged {bool(named)}, done {bool(done)}")
