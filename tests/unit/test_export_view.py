"""`hsx export-view` on real tiny-model extractions: links SpecForge reads, stable numbers, safety."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hsx_run_helpers import (
    SharedBackend,
    make_cfg,
    one_thread,  # noqa: F401  (autouse)
    run,
)

from extraction.backends.hf import HFBackend
from extraction.cli import main
from extraction.export import links as export_links
from extraction.export import view as ev
from extraction.shards.verify import verify_output
from extraction.testbed.tiny import write_tiny_dataset
from hsx.exitcodes import EXIT_OK
from hsx.index import load_index
from hsx.layout import MANIFEST_NAME, QUARANTINE_DIR, SHARD_KEYS
from hsx.manifest import read_manifest_dict
from hsx.verify.check import Expect, check_shard

N = 12


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_dataset(tmp_path_factory.mktemp("ds") / "d.jsonl", N, seed=11)


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> SharedBackend:
    return SharedBackend(HFBackend(tiny_model_dir, [1, 3, 4], dtype="fp32"))


@pytest.fixture(scope="module")
def half(tiny_model_dir, dataset, backend, tmp_path_factory) -> Path:
    """A run that has finished 7 of the 12 samples (read-only: copy before changing)."""
    out = tmp_path_factory.mktemp("half") / "out"
    assert run(make_cfg(tiny_model_dir, dataset, out, limit=7), backend) == EXIT_OK
    return out


@pytest.fixture(scope="module")
def finished(half, tiny_model_dir, dataset, backend, tmp_path_factory) -> Path:
    """The same run resumed to all 12 samples (read-only)."""
    out = tmp_path_factory.mktemp("finished") / "out"
    shutil.copytree(half, out)
    assert run(make_cfg(tiny_model_dir, dataset, out), backend) == EXIT_OK
    return out


@pytest.fixture(scope="module")
def nodes(tiny_model_dir, dataset, backend, tmp_path_factory) -> list[Path]:
    """The run split over two nodes by sample-id hash (read-only)."""
    root = tmp_path_factory.mktemp("nodes")
    outs = []
    for i in range(2):
        out = root / f"node{i}"
        assert run(make_cfg(tiny_model_dir, dataset, out, shard_index=i, num_shards=2), backend) == EXIT_OK
        outs.append(out)
    return outs


def copy(src: Path, tmp_path: Path, name: str = "out") -> Path:
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def export(capsys, *args: object) -> tuple[int, dict]:
    capsys.readouterr()
    rc = main(["export-view", *map(str, args), "--layout", "specforge", "--json", "--workers", "1"])
    out = capsys.readouterr().out
    return rc, (json.loads(out) if out.strip() else {})


def walk_like_specforge(dest: Path) -> list[str]:
    """SpecForge's `list_local_files`: os.walk, keep names ending in .ckpt/.ckpt.gz, sorted."""
    found = [
        os.path.join(root, f)
        for root, _d, files in os.walk(dest)
        for f in files
        if f.endswith((".ckpt", ".ckpt.gz"))
    ]
    return sorted(found)


def mapping(dest: Path) -> dict[int, dict]:
    lines = (dest / ev.MAPPING_NAME).read_text().splitlines()
    return {r["i"]: r for r in map(json.loads, lines)}


def links(dest: Path) -> dict[int, str]:
    """number -> relative link path of every data_i.ckpt in the view."""
    return {int(Path(p).stem.split("_")[1]): os.path.relpath(p, dest) for p in walk_like_specforge(dest)}


def test_every_link_is_a_full_verified_shard_specforge_can_load(finished, tmp_path, capsys) -> None:
    out = copy(finished, tmp_path)
    dest = tmp_path / "view"
    rc, rep = export(capsys, out, dest)
    assert rc == 0 and rep["added"] == N and rep["linked"] == N and rep["left_out_bad"] == 0
    index = load_index(str(out))
    expect = Expect.from_manifest(read_manifest_dict(str(out)))
    m = mapping(dest)
    assert sorted(m) == list(range(N)) and {r["id"] for r in m.values()} == set(index)
    files = walk_like_specforge(dest)
    assert len(files) == N
    for f in files:
        i = int(Path(f).stem.split("_")[1])
        assert os.path.relpath(f, dest) == f"rows_0-2000/data_{i}.ckpt"
        target = os.readlink(f)
        assert os.path.isabs(target) and target == os.path.join(os.path.realpath(out), m[i]["shard"])
        entry = index[m[i]["id"]]
        assert m[i]["shard"] == entry.path and m[i]["output"] == os.path.realpath(out)
        check_shard(target, expect, "full", entry)  # raises ShardBad on any damage
        data = torch.load(f, mmap=True, weights_only=True)
        assert set(data) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        # SpecForge's OfflineEagle3Dataset.process_data, including its in-place write into the
        # mmap'd loss mask: the file must not change (torch maps it private, copy-on-write).
        hidden = data["aux_hidden_state"].squeeze(0)[:2048][None, :]
        target_t = data["hidden_state"].squeeze(0)[:2048][None, :]
        loss_mask = data["loss_mask"][:2048][None, :]
        loss_mask[0, -1] = 0
        length = data["input_ids"].numel()
        assert hidden.shape == (1, length, 3 * target_t.shape[-1]) and target_t.shape[1] == length
    report = verify_output(str(out), "full")
    assert (report.ok, report.bad) == (N, [])

    inodes = {i: os.lstat(dest / p).st_ino for i, p in links(dest).items()}
    rc, rep = export(capsys, out, dest)  # idempotent: nothing added, nothing touched
    assert rc == 0 and (rep["added"], rep["relinked"], rep["linked"]) == (0, 0, N)
    assert {i: os.lstat(dest / p).st_ino for i, p in links(dest).items()} == inodes
    assert len((dest / ev.MAPPING_NAME).read_text().splitlines()) == N


def test_rerun_after_more_samples_keeps_old_numbers(
    half, tiny_model_dir, dataset, backend, tmp_path, capsys
) -> None:
    out = copy(half, tmp_path)
    dest = tmp_path / "view"
    rc, rep = export(capsys, out, dest, "--group-size", "5")
    assert rc == 0 and rep["added"] == 7
    before = mapping(dest)
    old_links = {i: (p, os.lstat(dest / p).st_ino) for i, p in links(dest).items()}
    assert sorted(p for p, _ in old_links.values())[:2] == ["rows_0-5/data_0.ckpt", "rows_0-5/data_1.ckpt"]

    assert run(make_cfg(tiny_model_dir, dataset, out), backend) == EXIT_OK  # the run finishes
    rc, rep = export(capsys, out, dest)  # group size comes from the view
    assert rc == 0 and (rep["added"], rep["relinked"], rep["linked"]) == (5, 0, N)
    after = mapping(dest)
    assert {i: after[i]["id"] for i in before} == {i: r["id"] for i, r in before.items()}
    assert sorted(after) == list(range(N))
    assert set(links(dest).values()) >= {"rows_10-15/data_10.ckpt", "rows_5-10/data_9.ckpt"}
    assert {i: (p, os.lstat(dest / p).st_ino) for i, p in links(dest).items() if i < 7} == old_links

    rc, _ = export(capsys, out, dest, "--group-size", "2000")
    assert rc == 2  # a different grouping would move every link: refused


@pytest.mark.parametrize("mode", ["symlink", "hardlink"])
def test_quarantined_shard_is_never_linked(finished, tmp_path, capsys, mode) -> None:
    out = copy(finished, tmp_path)
    dest = tmp_path / "view"
    assert export(capsys, out, dest, "--link", mode)[0] == 0
    m = mapping(dest)
    victim = m[3]
    shard = out / victim["shard"]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensor data: only the CRC level sees it
    shard.write_bytes(bytes(data))
    assert verify_output(str(out), "full", quarantine=True).quarantined

    rc, rep = export(capsys, out, dest)
    assert rc == 0 and rep["linked"] == N - 1
    assert [u["i"] for u in rep["unlinked"]] == [3] and "quarantined" in rep["unlinked"][0]["reason"]
    assert 3 not in links(dest) and mapping(dest)[3]["id"] == victim["id"]  # the number stays reserved
    for f in walk_like_specforge(dest):
        real = os.path.realpath(f) if mode == "symlink" else None
        assert real is None or "/shards/" in real
    if mode == "hardlink":  # no link keeps the damaged inode alive
        quarantined = next((out / QUARANTINE_DIR).rglob("*.pt"))
        assert os.stat(quarantined).st_nlink == 1

    fresh = tmp_path / "fresh"
    rc, rep = export(capsys, out, fresh)
    assert rc == 0 and rep["linked"] == N - 1
    assert victim["id"] not in {r["id"] for r in mapping(fresh).values()}


def test_truncated_shard_is_left_out_and_counted(finished, tmp_path, capsys) -> None:
    out = copy(finished, tmp_path)
    dest = tmp_path / "view"
    assert export(capsys, out, dest)[0] == 0
    victim = mapping(dest)[5]
    shard = out / victim["shard"]
    os.truncate(shard, shard.stat().st_size - 100)

    rc, rep = export(capsys, out, dest)
    assert rc == 1 and rep["left_out_bad"] == 1 and rep["linked"] == N - 1
    assert rep["outputs"][0]["bad"][0]["path"] == victim["shard"]
    assert [u["i"] for u in rep["unlinked"]] == [5] and rep["unlinked"][0]["reason"].startswith("failed full")
    assert 5 not in links(dest)
    rc, rep = export(capsys, out, tmp_path / "fresh")
    assert rc == 1 and rep["left_out_bad"] == 1 and rep["linked"] == N - 1 and rep["added"] == N - 1


def test_hardlinks_on_the_same_filesystem(finished, tmp_path, capsys) -> None:
    out = copy(finished, tmp_path)
    dest = tmp_path / "view"
    rc, rep = export(capsys, out, dest, "--link", "hardlink")
    assert rc == 0 and rep["linked"] == N and rep["link"] == "hardlink"
    m = mapping(dest)
    for i, rel in links(dest).items():
        link_st, shard_st = os.lstat(dest / rel), os.stat(out / m[i]["shard"])
        assert not os.path.islink(dest / rel)
        assert (link_st.st_ino, link_st.st_nlink) == (shard_st.st_ino, 2)
    assert set(torch.load(dest / links(dest)[0], mmap=True, weights_only=True)) == set(SHARD_KEYS)
    rc, rep = export(capsys, out, dest)  # the view remembers its mode
    assert rc == 0 and (rep["added"], rep["relinked"], rep["link"]) == (0, 0, "hardlink")
    assert export(capsys, out, dest, "--link", "symlink")[0] == 2


def test_hardlinks_across_filesystems_fail_cleanly(finished, tmp_path, capsys) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        dest = mnt / "view"
        rc = main(["export-view", str(finished), str(dest), "--layout", "specforge", "--link", "hardlink"])
        err = capsys.readouterr().err
        assert rc == 2 and "EXDEV" in err and str(dest) in err and str(finished) in err
        assert not dest.exists()  # nothing half-done
        dest.mkdir()
        assert (
            main(["export-view", str(finished), str(dest), "--layout", "specforge", "--link", "hardlink"])
            == 2
        )
        assert list(dest.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_two_outputs_into_one_view(nodes, tmp_path, capsys) -> None:
    dest = tmp_path / "view"
    rc, rep = export(capsys, *nodes, dest)
    assert rc == 0 and rep["linked"] == N
    m = mapping(dest)
    by_output = {str(os.path.realpath(o)): set(load_index(str(o))) for o in nodes}
    assert all(len(ids) > 0 for ids in by_output.values())
    assert {r["id"] for r in m.values() if r["output"] == str(os.path.realpath(nodes[1]))} == by_output[
        str(os.path.realpath(nodes[1]))
    ]
    for i, rel in links(dest).items():
        assert os.readlink(dest / rel) == os.path.join(m[i]["output"], m[i]["shard"])
    rc, rep = export(capsys, *reversed(nodes), dest)  # order of outputs does not renumber
    assert rc == 0 and (rep["added"], rep["repointed"], rep["relinked"]) == (0, 0, 0) and mapping(dest) == m

    other = copy(nodes[0], tmp_path, "other-run")
    manifest = json.loads((other / MANIFEST_NAME).read_text())
    manifest["layer_ids"] = [1, 2, 4]
    (other / MANIFEST_NAME).write_text(json.dumps(manifest))
    before = sorted(p.name for p in dest.rglob("*"))
    assert export(capsys, other, dest)[0] == 2  # another run never joins this view
    assert export(capsys, nodes[0], other, tmp_path / "mixed")[0] == 2
    assert sorted(p.name for p in dest.rglob("*")) == before and not (tmp_path / "mixed").exists()


def test_refuses_a_dest_that_is_not_a_view(finished, tmp_path, capsys) -> None:
    dest = tmp_path / "busy"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    rc = main(["export-view", str(finished), str(dest), "--layout", "specforge"])
    assert rc == 2 and "not an export view" in capsys.readouterr().err
    assert sorted(p.name for p in dest.iterdir()) == ["notes.txt"]
    assert main(["export-view", str(finished), "--layout", "specforge"]) == 2  # no DEST


def test_crash_mid_export_leaves_a_view_the_next_run_completes(
    finished, tmp_path, capsys, monkeypatch
) -> None:
    out = copy(finished, tmp_path)
    dest = tmp_path / "view"
    real_make_link, made = export_links._make_link, []

    def dying_make_link(path, target, mode, **kw):
        if len(made) == 5:
            raise OSError(5, "Input/output error", path)
        made.append(path)
        real_make_link(path, target, mode, **kw)

    monkeypatch.setattr(export_links, "_make_link", dying_make_link)
    assert export(capsys, out, dest)[0] == 2
    monkeypatch.setattr(export_links, "_make_link", real_make_link)
    crashed = mapping(dest)
    assert len(crashed) == N and len(links(dest)) == 5  # numbers were logged before any link
    group = dest / "rows_0-2000"
    (group / ".data_7.ckpt.1.abcd.tmp").symlink_to("/nowhere")  # a link temp a crash left
    with open(dest / ev.MAPPING_NAME, "ab") as f:
        f.write(b'{"i": 99, "id": "torn')  # a torn last line

    rc, rep = export(capsys, out, dest)
    assert rc == 0 and rep["linked"] == N and rep["mapping_torn_tail"] and rep["relinked"] == N - 5
    assert mapping(dest) == crashed and ".data_7.ckpt.1.abcd.tmp" in " ".join(rep["leftovers_removed"])
    assert sorted(links(dest)) == list(range(N))
    os.symlink("/nowhere", group / "data_500.ckpt")  # a link with no number: never trained on
    rc, rep = export(capsys, out, dest)
    assert (
        rc == 0
        and rep["leftovers_removed"] == ["rows_0-2000/data_500.ckpt"]
        and sorted(links(dest)) == list(range(N))
    )
