"""Files we did not write are data, not truth (issue #30, items 1, 5, 12a-c): dataset rows.

The job runs as root under systemd and reads files that a crash, a bug or another user may have
written. Each test feeds one of them something hostile and checks that it becomes a verdict (here: a
row error with its line), never a crash. The same for status.json and run.json: test_hostile_status.py;
an export view's mapping: test_hostile_export.py; the files a patch changes: test_hostile_patching.py.
The property tests at the end do the same over generated inputs (hostile_strategies.py): 200 examples
each in `make test`, more with HYPOTHESIS_PROFILE=long.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hostile_strategies import JSON, LONE, TEXT, deep_nesting
from hsx_run_helpers import (
    LAYERS,
    one_thread,  # noqa: F401  (autouse)
    )
from hypothesis import event, given
from hypothesis import strategies as st
from property_settings import PROPERTY

from extraction.cli import main
from extraction.inputs.dataset import RowError, content_id, parse_line, scan_dataset
from extraction.runner.plan import assigned_to
from extraction.testbed.tiny import write_tiny_dataset
from hsx.exitcodes import EXIT_OK
from hsx.index import load_index
from hsx.status import ERRORS_NAME, read_status

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



LINES = st.one_of(
    GOOD_ROWS.map(lambda r: json.dumps(r).encode()),
    GOOD_ROWS.map(lambda r: json.dumps(r, ensure_ascii=False).encode("utf-8", "surrogatepass")),
    ROWS.map(lambda r: json.dumps(r).encode()),  # ensure_ascii: lone surrogates as \udXXX escapes
    ROWS.map(lambda r: json.dumps(r, ensure_ascii=False).encode("utf-8", "surrogatepass")),  # raw CESU
    JSON.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b" ")),
    st.integers(1, 200_000).map(deep_nesting),
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
