"""Files we did not write are data, not truth (issue #30, items 1, 5, 12a-c): status.json, run.json, the recovery facts.

A malformed status.json is a verdict (the module's, the CLI's, the report's), never a crash; odd pids;
the report counts what was quarantined, not a capped list; the property tests read generated status
and run.json documents (hostile_strategies.py).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time

import pytest
from ansible_modules import load_module
from hostile_strategies import JSON, TEXT, deep_nesting
from hsx_run_helpers import (
    one_thread,  # noqa: F401  (autouse)
    )
from hypothesis import event, given
from hypothesis import strategies as st
from property_settings import PROPERTY

from extraction.cli import main
from extraction.fleet.report import host_report
from hsx.exitcodes import EXIT_USAGE
from hsx.manifest import ManifestError, read_manifest_dict
from hsx.status import describe, now_iso, pid_alive, process_gone, read_status, summarize


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
    st.integers(1, 200_000).map(deep_nesting),
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
    (tmp_path / "run.json").write_bytes(b'{"model": ' + deep_nesting(100_000) + b"}")
    with pytest.raises(ManifestError):
        read_manifest_dict(str(tmp_path))
