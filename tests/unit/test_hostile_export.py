"""Files we did not write are data, not truth (issue #30, items 1, 5, 12a-c): an export view's mapping.jsonl and export.json.

export-view follows the index, not the mapping: a tampered mapping line is reported and never followed,
a damaged export.json is refused; the property test reads generated mapping lines (hostile_strategies.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from hostile_strategies import JSON, TEXT, deep_nesting
from hsx_run_helpers import (
    SharedBackend,
    make_cfg,
    one_thread,  # noqa: F401  (autouse)
    run,
)
from hypothesis import event, given
from hypothesis import strategies as st
from property_settings import PROPERTY

from extraction.cli import main
from extraction.export import view as ev
from extraction.export.mapping import ExportError, read_mapping
from extraction.testbed.tiny import write_tiny_dataset
from hsx.exitcodes import EXIT_OK
from hsx.index import load_index

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
    st.integers(1, 200_000).map(lambda n: deep_nesting(n) + b"\n"),
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
