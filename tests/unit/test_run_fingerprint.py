"""Index lines carry run.json's fingerprint; verify and resume refuse data written under another
run.json (issue #38: run.json's layers edited from [2,4,5] to [2,4,6] relabelled old data as new).

Outputs written before the fingerprint (index lines without one) verify and resume as before.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from shard_helpers import make_run, manifest

from extraction.runner.lifecycle import RunError
from extraction.runner.resume import verified_done
from extraction.shards.verify import verify_output
from hsx.index import (
    IndexEntry,
    encode_index_line,
    index_record,
    index_rows,
    load_index,
    read_index_lines,
    replay_index,
)
from hsx.layout import INDEX_NAME, MANIFEST_NAME
from hsx.manifest import FINGERPRINT_FIELDS, ManifestError, RunManifest, manifest_fingerprint


def edit_run_json(out: Path, **changes: object) -> None:
    data = json.loads((out / MANIFEST_NAME).read_text())
    data.update(changes)
    (out / MANIFEST_NAME).write_text(json.dumps(data))


def verify(out: Path, level: str):
    return verify_output(str(out), level, workers=1)


def test_every_index_line_carries_the_fingerprint_of_run_json(tmp_path):
    make_run(tmp_path, n=2)
    want = manifest_fingerprint(json.loads((tmp_path / MANIFEST_NAME).read_text()))
    assert {e.fingerprint for e in load_index(str(tmp_path)).values()} == {want}


def test_the_fingerprint_covers_what_a_shard_holds_and_not_the_rest():
    base = manifest()
    assert manifest_fingerprint(base.to_dict()) == manifest_fingerprint(
        manifest(created_at="2000-01-01T00:00:00+00:00", extra={"max_length": 512}, dataset_hash="other").to_dict()
    )
    for name, value in [("layer_ids", [1, 3, 5]), ("dtype", "float16"), ("hidden_size", 16), ("model", "m2")]:
        assert name in FINGERPRINT_FIELDS
        assert manifest_fingerprint(manifest(**{name: value}).to_dict()) != manifest_fingerprint(base.to_dict())


def test_a_run_json_missing_defaulted_fields_has_the_fingerprint_of_its_defaults(tmp_path):
    full = manifest().to_dict()
    sparse = {k: v for k, v in full.items() if k not in ("final_normed", "format_version", "revision")}
    sparse["revision"] = full["revision"]
    assert manifest_fingerprint(sparse) == manifest_fingerprint(RunManifest.from_dict(sparse).to_dict())


@pytest.mark.parametrize("level", ["quick", "full", "deep"])
def test_verify_refuses_shards_relabelled_by_an_edited_run_json(tmp_path, level):
    make_run(tmp_path, n=3)
    edit_run_json(tmp_path, layer_ids=[1, 3, 5])  # same count: every shard's shapes still fit
    with pytest.raises(ManifestError) as e:
        verify(tmp_path, level)
    msg = str(e.value)
    assert str(tmp_path / INDEX_NAME) in msg and str(tmp_path / MANIFEST_NAME) in msg
    assert "3 of 3 entries" in msg and "layer_ids" in msg and "restore run.json" in msg


def test_hsx_verify_says_so_and_moves_nothing(tmp_path, capsys):
    from extraction.cli import main

    make_run(tmp_path, n=2)
    edit_run_json(tmp_path, layer_ids=[1, 3, 5])
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(["verify", str(tmp_path), "--quarantine", "--workers", "1"]) == 2
    assert "written under another run.json" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_resume_refuses_shards_relabelled_by_an_edited_run_json(tmp_path):
    make_run(tmp_path, n=2)
    edit_run_json(tmp_path, layer_ids=[1, 3, 5])
    wanted = manifest(layer_ids=[1, 3, 5])
    with pytest.raises(RunError, match=r"refusing to resume: .*written under another run\.json"):
        verified_done(str(tmp_path), wanted, {"s000", "s001"}, lambda _r: None)


def strip_fingerprints(out: Path) -> None:
    """index.jsonl as a release before the fingerprint wrote it."""
    records = [json.loads(line.rpartition(b"\t")[0]) for line in read_index_lines(str(out))]
    for r in records:
        assert r.pop("run_fp")
    (out / INDEX_NAME).write_bytes(b"".join(encode_index_line(r) for r in records))


@pytest.mark.parametrize("level", ["quick", "full"])
def test_an_old_index_without_fingerprints_verifies_as_before(tmp_path, level):
    make_run(tmp_path, n=2)
    strip_fingerprints(tmp_path)
    report = verify(tmp_path, level)
    assert (report.ok, report.bad, report.exit_code) == (2, [], 0)


def test_an_old_index_without_fingerprints_resumes_as_before(tmp_path):
    make_run(tmp_path, n=2)
    strip_fingerprints(tmp_path)
    done, bad = verified_done(str(tmp_path), manifest(), {"s000", "s001"}, lambda _r: None)
    assert (done, bad) == ({"s000", "s001"}, 0)


def test_old_and_new_lines_mixed_verify_and_a_foreign_one_is_refused(tmp_path):
    _, entries = make_run(tmp_path, n=2)
    strip_fingerprints(tmp_path)  # an old output resumed by this release: new lines have one
    with open(tmp_path / INDEX_NAME, "ab") as f:
        f.write(encode_index_line(index_record(entries[1])))
    assert verify(tmp_path, "quick").ok == 2
    foreign = dict(index_record(entries[1]), run_fp="0123456789abcdef")
    with open(tmp_path / INDEX_NAME, "ab") as f:
        f.write(encode_index_line(foreign))
    with pytest.raises(ManifestError, match="1 of 2 entries"):
        verify(tmp_path, "quick")


def test_a_fingerprint_that_is_not_a_string_is_a_bad_line(tmp_path):
    _, entries = make_run(tmp_path, n=1)
    with open(tmp_path / INDEX_NAME, "ab") as f:
        f.write(encode_index_line(dict(index_record(entries[0]), id="s9", run_fp=[1])))
    report = verify(tmp_path, "quick")
    assert report.index_bad_lines == 1 and report.ok == 1


def test_an_index_of_fingerprinted_lines_takes_the_fast_path(tmp_path):
    make_run(tmp_path, n=3)
    lines = read_index_lines(str(tmp_path))
    rows = index_rows(lines)
    assert rows is not None
    assert {sid: IndexEntry(*row) for sid, row in rows.items()} == replay_index(lines).entries


def test_the_bucket_count_is_in_the_fingerprint_and_a_run_json_without_one_keeps_its_own() -> None:
    """Issue #39: run.json's bucket count changes the fingerprint (a run of 512 buckets is not one
    of 1024); a run.json made before buckets has the fingerprint it always had (its shards stay
    its own); what a node is assigned is not a run.json field at all."""
    import hashlib

    old = {k: v for k, v in manifest().to_dict().items() if k != "buckets"}
    legacy_fields = [name for name in FINGERPRINT_FIELDS if name != "buckets"]
    body = json.dumps({n: old[n] for n in legacy_fields}, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    assert manifest_fingerprint(old) == hashlib.sha256(body.encode()).hexdigest()[:16]
    assert manifest_fingerprint({**old, "buckets": None}) == manifest_fingerprint(old)
    fps = {manifest_fingerprint({**old, "buckets": n}) for n in (512, 1024)}
    assert len(fps) == 2 and manifest_fingerprint(old) not in fps
    assert "assign" not in {f.name for f in dataclasses.fields(RunManifest)}
