"""The stdlib-only format (hsx): naming, index log, zip parsing, the restricted pickle reader."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from shard_helpers import expect, read_record, replace_record, save, shard_dict

import hsx
from hsx.crc import crc32_combine
from hsx.errors import ShardBad
from hsx.index import IndexEntry, append_index, index_record, load_index, read_index, tombstone_record
from hsx.layout import (
    BUCKET_HEX_CHARS,
    INDEX_NAME,
    SHARD_RELPATH_RE,
    SHARDS_DIR,
    is_shard_name,
    is_temp_name,
    safe_name,
    shard_relpath,
    temp_name,
)
from hsx.torchpickle import read_tensor_pickle
from hsx.verify.check import check_shard, inspect_shard

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "module_utils" / "hsx"
# The modules that were the one format module (extraction/shards/format.py) before the core split.
FORMAT_MODULES = [
    "layout.py",
    "index.py",
    "fsutil.py",
    "errors.py",
    "ziprecords.py",
    "torchpickle.py",
    "crc.py",
    "cores.py",
    *(f"verify/{p.name}" for p in sorted((CORE / "verify").glob("*.py"))),
]


@pytest.mark.parametrize("name", [*FORMAT_MODULES, "manifest.py"])
def test_format_modules_import_only_the_standard_library(name):
    src = (CORE / name).read_text()
    imports = {
        line.split()[1].split(".")[0]
        for line in src.splitlines()
        if line.startswith(("import ", "from "))
        and not line.startswith(("from __future__", "from ."))  # relative: the core's own modules
    }
    # manifest.py was extraction/shards/manifest.py (stdlib-only too): run.json's created_at
    extra = {"datetime"} if name == "manifest.py" else set()
    assert imports <= {
        "errno",
        "hashlib",
        "importlib",
        "io",
        "itertools",
        "json",
        "math",
        "operator",
        "os",
        "re",
        "stat",
        "struct",
        "threading",
        "time",
        "zlib",
        "dataclasses",
        "typing",
        "collections",
        *extra,
    }


def test_module_utils_holds_the_one_source_and_no_links():
    assert Path(hsx.__file__).resolve().parent == CORE  # the package `hsx` imports is module_utils/hsx
    assert not [p for p in (ROOT / "module_utils").rglob("*") if p.is_symlink()]


@pytest.mark.parametrize(
    "sample_id",
    ["conv-001", "a.b_c", "with space", "../../etc/passwd", "ünïcode", ".hidden", "x" * 300, "a/b", "a~b"],
)
def test_shard_relpath_is_safe_and_stable(sample_id):
    rel = shard_relpath(sample_id)
    assert rel == shard_relpath(sample_id)
    parts = rel.split("/")
    assert parts[0] == SHARDS_DIR and len(parts) == 3 and len(parts[1]) == BUCKET_HEX_CHARS
    assert parts[2].endswith(".pt") and not parts[2].startswith(".") and ".." not in parts
    assert len(parts[2]) < 200 and SHARD_RELPATH_RE.match(rel)


def test_safe_names_never_collide():
    ids = ["a b", "a_b", "a/b", "a~b", "a_b~0", "A_B"]
    names = [safe_name(i) for i in ids]
    assert len(set(names)) == len(ids)
    assert safe_name("a_b") == "a_b"  # safe ids keep their name


def test_temp_names_are_never_shards():
    t = temp_name("x.pt")
    assert is_temp_name(t) and not is_shard_name(t) and not t.endswith(".pt")


def test_index_tolerates_torn_tail_and_damaged_lines(tmp_path):
    e1 = IndexEntry("a", "shards/00/a.pt", 10, "crc32:00000001", 3)
    e2 = IndexEntry("b", "shards/00/b.pt", 11, "crc32:00000002", 4)
    append_index(str(tmp_path), [index_record(e1), index_record(e2)])
    idx = tmp_path / INDEX_NAME
    lines = idx.read_bytes().splitlines(keepends=True)
    damaged = lines[0].replace(b'"a"', b'"z"')  # CRC no longer matches
    idx.write_bytes(damaged + lines[1] + lines[1][:20])  # + a torn last line
    state = read_index(str(tmp_path))
    assert set(state.entries) == {"b"} and state.bad_lines == 1 and state.torn_tail
    assert load_index(str(tmp_path))["b"] == e2


def test_index_later_lines_win_and_tombstones_remove(tmp_path):
    e = IndexEntry("a", "shards/00/a.pt", 10, "crc32:00000001", 3)
    append_index(str(tmp_path), [index_record(e), tombstone_record("a", "bad")])
    assert load_index(str(tmp_path)) == {}
    append_index(str(tmp_path), [index_record(e)])
    assert load_index(str(tmp_path)) == {"a": e}
    assert load_index(str(tmp_path / "nowhere")) == {}


def test_crc32_combine_matches_zlib():
    for a_len, b_len in [(0, 0), (1, 0), (0, 7), (13, 1), (1000, 65536 + 3)]:
        a, b = os.urandom(a_len), os.urandom(b_len)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_restricted_reader_matches_torch(tmp_path):
    d = shard_dict(length=7)
    path = save(tmp_path / "s.pt", d)
    meta = read_tensor_pickle(read_record(path, "data.pkl"))
    for key, t in d.items():
        m = meta[key]
        assert m.shape == tuple(t.shape) and m.stride == tuple(t.stride()) and m.offset == 0
        assert m.storage.dtype == str(t.dtype).removeprefix("torch.") and m.storage.numel == t.numel()


def test_restricted_reader_reads_protocol_4_stack_globals(tmp_path):
    # torch.save(pickle_protocol=4) uses SHORT_BINUNICODE, MEMOIZE, FRAME, STACK_GLOBAL.
    path = tmp_path / "p4.pt"
    torch.save(shard_dict(), path, pickle_protocol=4)
    meta = read_tensor_pickle(read_record(path, "data.pkl"))
    assert meta["hidden_state"].shape == (1, 5, 8)


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol", [2, 4])
def test_code_payload_is_refused_without_running_it(tmp_path, protocol):
    live = tmp_path / "live"
    pickle.loads(pickle.dumps(_Payload(live), protocol=protocol))
    assert live.exists(), "the payload must be a real one"
    marker = tmp_path / "pwned"
    with pytest.raises(ShardBad, match="refused, nothing executed"):
        read_tensor_pickle(pickle.dumps({"input_ids": _Payload(marker)}, protocol=protocol))
    assert not marker.exists()


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "truncated"),
        (b"\x80\x02}q\x00", "truncated"),
        (b"\x80\x02]q\x00.", "opcode 0x5d"),  # EMPTY_LIST: not something torch writes for a shard
        (b"\x80\x02cbuiltins\neval\n.", "builtins.eval"),
        (b"\x80\x02h\x05.", "unknown memo"),
        (b"\x80\x02}q\x00X\x01\x00\x00\x00aK\x01s.", "not a dict of tensors"),
        (b"\x80\x02}.junk", "after STOP"),
        (b"\x80\x02X\xff\xff\xff\x7fab", "truncated"),
    ],
)
def test_restricted_reader_rejects_malformed_pickles(data, reason):
    with pytest.raises(ShardBad, match=reason):
        read_tensor_pickle(data)


def test_storage_on_a_gpu_is_reported(tmp_path):
    path = save(tmp_path / "s.pt", shard_dict())
    pkl = read_record(path, "data.pkl").replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
    replace_record(path, "data.pkl", pkl)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ShardBad, match="cuda:0"):
            inspect_shard(fd, expect())
    finally:
        os.close(fd)


def test_zip64_and_plain_end_records_are_both_read(tmp_path):
    # torch writes zip64 end records; Python's zipfile writes plain ones for small archives.
    path = save(tmp_path / "s.pt", shard_dict())
    replace_record(path, "data.pkl", read_record(path, "data.pkl"))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert inspect_shard(fd, expect()).num_tokens == 5
    finally:
        os.close(fd)


def _with_version(path: Path, version: bytes, data_version: bytes | None = None) -> None:
    """Rewrite a torch.save zip with its `version` record's bytes replaced, and with a
    `.data/version` record (which torch reads instead of `version`) when given."""
    src = zipfile.ZipFile(path)
    buf = io.BytesIO()
    stem = src.namelist()[0].split("/", 1)[0]
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as out:
        for info in src.infolist():
            out.writestr(info.filename, version if info.filename == f"{stem}/version" else src.read(info))
        if data_version is not None:
            out.writestr(f"{stem}/.data/version", data_version)
    path.write_bytes(buf.getvalue())


def _torch_loads(path: Path) -> bool:
    try:
        torch.load(path, weights_only=True)
    except Exception:  # torch raises RuntimeError and others for a file it cannot read
        return False
    return True


@pytest.mark.parametrize(
    ("version", "data_version"),
    [
        (b"3\n", None),
        (b"+3 trailing", None),
        (b"x\n", None),
        (b"", None),
        (b"0\n", None),
        (b"11\n", None),
        (b"-3\n", None),
        (b"99999999999999999999999\n", None),
        (b"00000000000000000000000003\n", None),
        (b"\x0b\t 3", None),
        (b"3\n", b"3\n"),
        (b"3\n", b"x\n"),
        (b"x\n", b"3\n"),
    ],
)
@pytest.mark.parametrize("level", ["quick", "full"])
def test_the_version_record_passes_exactly_when_torch_can_parse_it(tmp_path, version, data_version, level):
    path = save(tmp_path / "v.pt", shard_dict())
    _with_version(path, version, data_version)
    loads = _torch_loads(path)
    try:
        check_shard(str(path), expect(), level)
        passed, reason = True, ""
    except ShardBad as e:
        passed, reason = False, str(e)
    assert passed == loads, f"torch.load {'reads' if loads else 'refuses'} it, {level} said {reason or 'ok'}"
    if not passed:
        assert "version record" in reason
