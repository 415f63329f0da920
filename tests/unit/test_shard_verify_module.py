"""library/shard_verify.py driven through AnsibleModule with patch_module_args."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from ansible.module_utils.testing import patch_module_args
from ansible_modules import register_module_utils
from shard_helpers import flip, make_run, tree

from hsx.index import append_index, index_record
from hsx.layout import INDEX_NAME, shard_relpath

ROOT = Path(__file__).resolve().parents[2]


def _load_module():
    """Load the module as Ansible would: the core as ansible.module_utils.hsx, from module_utils/."""
    register_module_utils()
    spec = importlib.util.spec_from_file_location("shard_verify_module", ROOT / "library" / "shard_verify.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


shard_verify = _load_module()


def run_module(capsys, **args) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        shard_verify.main()
    return json.loads(capsys.readouterr().out)


@pytest.fixture()
def mixed(tmp_path):
    _, entries = make_run(tmp_path, n=5)
    (tmp_path / entries[0].path).write_bytes(b"junk")
    flip(tmp_path / entries[1].path, 300)
    (tmp_path / entries[2].path).unlink()
    return tmp_path, entries


def test_report_only_changes_nothing(capsys, mixed):
    root, entries = mixed
    before = tree(root)
    r = run_module(capsys, path=str(root), level="full", workers=1)
    assert not r.get("failed") and r["changed"] is False and tree(root) == before
    assert (r["checked"], r["ok"], r["bad_count"], r["missing"]) == (4, 2, 2, ["s002"])


def test_check_mode_predicts_and_moves_nothing_then_real_then_idempotent(capsys, mixed):
    root, entries = mixed
    before = tree(root)
    args = dict(path=str(root), level="full", quarantine=True, workers=1)
    r = run_module(capsys, **args, _ansible_check_mode=True, _ansible_diff=True)
    assert r["changed"] is True and tree(root) == before
    predicted = sorted(r["quarantined"])
    assert len(predicted) == 2 and entries[0].path.split("/", 1)[1] in r["diff"]["after"]

    r = run_module(capsys, **args)
    assert r["changed"] is True and sorted(r["quarantined"]) == predicted
    assert all((root / q).exists() for q in predicted)

    r = run_module(capsys, **args)
    assert r["changed"] is False and r["bad_count"] == 0 and r["missing_count"] == 0 and r["ok"] == 2


def test_list_caps_keep_full_counts(capsys, tmp_path):
    _, entries = make_run(tmp_path, n=6)
    for e in entries:
        (tmp_path / e.path).write_bytes(b"x")
    r = run_module(capsys, path=str(tmp_path), level="quick", max_listed=2, workers=2)
    assert r["bad_count"] == 6 and len(r["bad"]) == 2
    # Quarantining: the list stops at max_listed, its count does not (the report reads the count).
    r = run_module(capsys, path=str(tmp_path), level="quick", max_listed=2, workers=2, quarantine=True)
    assert r["quarantined_count"] == 6 and len(r["quarantined"]) == 2


def test_not_a_run_fails_with_the_path(capsys, tmp_path):
    r = run_module(capsys, path=str(tmp_path / "nope"))
    assert r["failed"] and "nope" in r["msg"]


def test_hostile_files_and_lines_are_verdicts_not_exceptions(capsys, tmp_path, monkeypatch):
    """Issue #30: a sparse file declaring a 3 GiB central directory (MemoryError before), a line
    nested past the JSON parser's recursion (RecursionError before) and a second entry naming
    s000's shard (a lost sample hidden before): each a verdict in the module's result."""
    _, entries = make_run(tmp_path, n=2)
    sparse = tmp_path / shard_relpath("sparse")
    sparse.parent.mkdir(parents=True, exist_ok=True)
    size = 3 << 30
    with open(sparse, "wb") as f:
        f.truncate(size - 22)
        f.seek(0, os.SEEK_END)
        f.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, size - 22, 0, 0))
    sparse_entry = {**index_record(entries[1]), "id": "sparse", "path": shard_relpath("sparse"), "size": size}
    append_index(str(tmp_path), [sparse_entry, {**index_record(entries[0]), "id": "twin"}])
    nest = b"[" * 100_000 + b"]" * 100_000
    with open(tmp_path / INDEX_NAME, "ab") as f:
        f.write(nest + b"\t%08x\n" % zlib.crc32(nest))
    real = os.pread

    def pread(fd, n, offset):  # a host without the memory for a multi-gigabyte read
        if n > 64 << 20:
            raise MemoryError(f"a read of {n} bytes")
        return real(fd, n, offset)

    monkeypatch.setattr(os, "pread", pread)
    r = run_module(capsys, path=str(tmp_path), level="quick", workers=1)
    assert not r.get("failed"), r
    bad = {b["sample_id"]: b["reason"] for b in r["bad"]}
    assert set(bad) == {"s000", "twin", "sparse"} and r["bad_count"] == 3
    assert bad["sparse"].startswith("central directory of")
    assert "'s000', 'twin'" in bad["s000"] and bad["s000"] == bad["twin"]
    assert r["checked"] == 3 and r["ok"] == 2 and r["unindexed"] == [entries[0].path]


def test_deep_without_torch_is_a_clear_missing_lib(capsys, tmp_path, monkeypatch):
    make_run(tmp_path, n=1)
    monkeypatch.setattr(shard_verify, "deep_check", None)
    r = run_module(capsys, path=str(tmp_path), level="deep")
    assert r["failed"] and "hsx-extraction with torch" in r["msg"]


def test_deep_with_torch(capsys, tmp_path):
    make_run(tmp_path, n=2)
    r = run_module(capsys, path=str(tmp_path), level="deep", workers=1)
    assert r["ok"] == 2 and r["level"] == "deep"


def test_module_runs_on_a_host_without_torch_or_the_package(tmp_path):
    """quick/full through the module with only the stdlib + ansible importable (no torch, no extraction, no hsx)."""
    make_run(tmp_path, n=2)
    code = f"""
import sys, builtins
real = builtins.__import__
def guard(name, *a, **k):
    if name.split('.')[0] in ('torch', 'extraction', 'numpy', 'hsx'):
        raise ImportError('not on this host: ' + name)
    return real(name, *a, **k)
builtins.__import__ = guard
import importlib.util
import ansible.module_utils
ansible.module_utils.__path__.append({str(ROOT / "module_utils")!r})
spec = importlib.util.spec_from_file_location('sv', {str(ROOT / "library" / "shard_verify.py")!r})
sv = importlib.util.module_from_spec(spec); spec.loader.exec_module(sv)
assert sv.deep_check is None and 'torch' not in sys.modules and 'hsx' not in sys.modules
from ansible.module_utils.testing import patch_module_args
with patch_module_args({{'path': {str(tmp_path)!r}, 'level': 'full', 'workers': 2}}):
    sv.main()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    r = json.loads(out.stdout)
    assert r["ok"] == 2 and r["bad_count"] == 0, out.stderr


def test_ansible_doc_renders(module_doc):
    doc = module_doc("shard_verify")
    assert {"path", "level", "quarantine", "workers"} <= set(doc["doc"]["options"])
    assert doc["examples"] and "quarantined" in doc["return"]
