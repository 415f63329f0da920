"""`hsx canary` (extraction/canary/): a real extraction of a few tiny samples (hf backend, CPU), then the
canary on it - each sample re-run in its original batch (OUTPUT/batches.jsonl) -> bit-equal, passed at
tolerance 0; the model's weights perturbed -> mismatch naming the samples and the error; without a
batch log (older shards) each sample alone within the dtype's bound, and the bound's edge; a fresh
output -> skipped; a chosen shard missing or corrupt, or a dataset without the sample -> an error,
never a pass; and the output left as it was, but for canary.json. The batch log's own tests:
test_canary_batch.py."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from hsx_run_helpers import make_cfg, one_thread, run  # noqa: F401 - one_thread: one torch thread here

from extraction.canary.check import run_canary
from extraction.canary.pick import canary_rank, pick_samples
from extraction.canary.result import CANARY_NAME
from extraction.cli import main
from extraction.runner.batchlog import BATCHES_NAME
from extraction.testbed.tiny import write_tiny_dataset
from hsx.buckets import bucket_of
from hsx.exitcodes import EXIT_CANARY_MISMATCH, EXIT_FAILED, EXIT_OK, EXIT_USAGE
from hsx.index import append_index, read_index, tombstone_record
from hsx.manifest import manifest_fingerprint, read_manifest_dict

SAMPLES = 8
BUCKETS = 2  # a few samples a bucket: a bucket can be unfinished while some of its samples are done


def perturb_weights(model_dir: Path, scale: float = 0.01, seed: int = 1) -> None:
    """Every weight of the model's safetensors files times (1 + scale x N(0,1)), in place: same file
    names, sizes, config and tokenizer (so the same run.json fingerprint), other values. What the lab
    scenario "a node that comes back computing differently" does to a node's model."""
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(f)
        out = {
            k: (t.float() * (1 + scale * torch.randn(t.shape, generator=gen))).to(t.dtype)
            for k, t in tensors.items()
        }
        save_file(out, f, metadata={"format": "pt"})


def tree(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under `root`: (size, mtime_ns, sha256)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


@pytest.fixture(scope="module")
def extracted(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, backend) -> dict[str, Path]:
    """SAMPLES tiny samples extracted for real (fp32, batch 4, BUCKETS buckets) into an output kept as it is."""
    root = tmp_path_factory.mktemp("canary")
    data = write_tiny_dataset(root / "d.jsonl", SAMPLES, seed=11)
    out = root / "out"
    assert run(make_cfg(tiny_model_dir, data, out, buckets=BUCKETS), backend) == EXIT_OK
    assert len(read_index(str(out)).entries) == SAMPLES
    return {"dataset": data, "output": out, "model": tiny_model_dir}


@pytest.fixture
def job(extracted: dict[str, Path], tmp_path: Path) -> dict[str, Path]:
    """A copy of the extracted output for one test, and the job's config file for it."""
    out = tmp_path / "out"
    shutil.copytree(extracted["output"], out)
    config = tmp_path / "job.yml"
    cfg = make_cfg(extracted["model"], extracted["dataset"], out)
    keys = ("model", "dataset", "output", "layers", "dtype", "max_length", "batch_size", "progress")
    config.write_text(yaml.safe_dump({k: getattr(cfg, k) for k in keys}))
    return {**extracted, "output": out, "config": config, "cfg": cfg}


def canary_cli(config: Path, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(["canary", "--config", str(config), "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def test_equal_states_pass_and_the_output_is_left_as_it_was(job, capsys) -> None:
    before = tree(job["output"])
    code, res = canary_cli(job["config"], capsys=capsys)
    assert (code, res["state"], res["checked"], res["mismatched"]) == (EXIT_OK, "passed", 2, []), res
    assert res["dtype"] == "float32" and res["tolerance"] == 0 and res["fallback_tolerance"] == 1e-4
    for s in res["samples"]:  # in its original batch (of 4), rebuilt: the shard's own bits
        assert s["tokens_equal"] and s["ok"] and s["mode"] == "batch" and s["rows"] == 4, s
        assert s["max_rel_error"] == 0 and all(s["bit_equal"].values()), s
    assert res["bit_equal"] == 2 and res["rebuilt_batches"] in (1, 2)
    assert res["forwarded"] == 4 * res["rebuilt_batches"]  # whole batches, not 2 samples
    assert f"{res['forwarded']} sample(s) forwarded" in res["message"]
    assert res["seconds"] > 0 and res["model_load_seconds"] > 0 and res["forward_seconds"] > 0
    after = tree(job["output"])
    assert after.pop(CANARY_NAME)[0] > 0  # the record, and nothing else changed
    assert after == before
    record = json.loads((job["output"] / CANARY_NAME).read_text())
    assert (record["state"], [s["id"] for s in record["samples"]]) == ("passed", [s["id"] for s in res["samples"]])


def test_the_samples_are_chosen_by_a_stable_hash_from_finished_buckets(job) -> None:
    out = str(job["output"])
    state = read_index(out)
    fp = manifest_fingerprint(read_manifest_dict(out))
    first = pick_samples(out, state, fp, 2)
    assert [e.sample_id for e in first.entries] == sorted(state.entries, key=canary_rank)[:2]
    assert (first.source, first.candidates) == ("finished buckets (2)", SAMPLES)
    # Another sample of the top-ranked one's bucket is redone (tombstoned): that bucket is no longer
    # finished, so its samples, still indexed, give way to the finished bucket's.
    top = first.entries[0].sample_id
    bucket = bucket_of(top, BUCKETS)
    sibling = next(s for s in state.entries if s != top and bucket_of(s, BUCKETS) == bucket)
    append_index(out, [tombstone_record(sibling, "redo")])
    again = pick_samples(out, read_index(out), fp, 2)
    others = sorted((s for s in state.entries if bucket_of(s, BUCKETS) != bucket), key=canary_rank)
    assert [e.sample_id for e in again.entries] == others[:2]
    assert again.source == "finished buckets (1)"
    # No finished bucket at all: every indexed sample is a candidate.
    append_index(out, [tombstone_record(others[-1], "redo")])
    last = pick_samples(out, read_index(out), fp, 2)
    assert last.source == "every indexed sample" and last.entries[0].sample_id == top


def test_perturbed_weights_are_a_mismatch_naming_samples_and_error(job, tmp_path, capsys) -> None:
    model = tmp_path / "perturbed" / job["model"].name  # the same name: the same run.json fingerprint
    shutil.copytree(job["model"], model)
    perturb_weights(model)
    config = yaml.safe_load(job["config"].read_text())
    config["model"] = str(model)
    job["config"].write_text(yaml.safe_dump(config))
    before = tree(job["output"])
    code, res = canary_cli(job["config"], capsys=capsys)
    assert (code, res["state"]) == (EXIT_CANARY_MISMATCH, "mismatch"), res
    assert res["mismatched"] == [s["id"] for s in res["samples"]] and len(res["mismatched"]) == 2
    assert res["max_rel_error"] > 1e-2  # 1% weight noise: far past the float32 bound
    for s in res["samples"]:
        assert s["tokens_equal"] and not s["ok"] and s["id"] in res["message"]
        assert f"relative error {s['rel_error']['hidden_state']:.3g} > tolerance 0" in s["why"]
    after = tree(job["output"])
    assert json.loads((job["output"] / CANARY_NAME).read_text())["state"] == "mismatch"
    del after[CANARY_NAME]
    assert after == before  # nothing written to the output but the record


def test_without_a_batch_log_each_sample_runs_alone_within_the_bound(job, backend) -> None:
    (job["output"] / BATCHES_NAME).unlink()  # an output written before batch membership was recorded
    factory = lambda _cfg, _ids: backend  # noqa: E731 - the shared real hf backend (same layers, fp32)
    first = run_canary(job["cfg"], 2, backend_factory=factory)
    worst = first.max_rel_error
    assert first.state == "passed" and worst is not None and worst > 0  # fp32: alone vs in a batch of 4
    assert first.forwarded == 2 and first.tolerance == 1e-4 and "alone" in first.message
    assert {s.mode for s in first.samples} == {"alone"} and f"no {BATCHES_NAME}" in first.samples[0].why_alone
    at = run_canary(job["cfg"], 2, worst, backend_factory=factory)
    assert (at.state, at.max_rel_error) == ("passed", worst)
    under = run_canary(job["cfg"], 2, math.nextafter(worst, 0), backend_factory=factory)
    assert under.state == "mismatch" and under.exit_code == EXIT_CANARY_MISMATCH
    assert under.to_dict()["mismatched"], under.message


def test_a_fresh_output_is_skipped_and_left_untouched(job, tmp_path, capsys) -> None:
    config = yaml.safe_load(job["config"].read_text())
    config["output"] = str(tmp_path / "fresh")
    job["config"].write_text(yaml.safe_dump(config))
    code, res = canary_cli(job["config"], capsys=capsys)
    assert (code, res["state"], res["checked"]) == (EXIT_OK, "skipped", 0), res
    assert "nothing to compare" in res["message"]
    assert not (tmp_path / "fresh").exists()
    # A run.json with no indexed shard yet (a run that stopped before its first one): skipped too.
    (tmp_path / "fresh").mkdir()
    shutil.copy(job["output"] / "run.json", tmp_path / "fresh" / "run.json")
    code, res = canary_cli(job["config"], capsys=capsys)
    assert (code, res["state"]) == (EXIT_OK, "skipped") and "no indexed shard" in res["message"]
    assert sorted(os.listdir(tmp_path / "fresh")) == ["run.json"]


def chosen(job) -> list[str]:
    out = str(job["output"])
    return [e.sample_id for e in pick_samples(out, read_index(out), manifest_fingerprint(read_manifest_dict(out)), 2).entries]


def shard_of(job, sample_id: str) -> Path:
    return job["output"] / read_index(str(job["output"])).entries[sample_id].path


def test_a_missing_shard_is_an_error_naming_it(job, capsys) -> None:
    sid = chosen(job)[1]
    shard_of(job, sid).unlink()
    code, res = canary_cli(job["config"], capsys=capsys)
    assert (code, res["state"], res["checked"]) == (EXIT_FAILED, "error", 0), res
    assert repr(sid) in res["message"] and "not good" in res["message"]


def test_a_corrupt_shard_is_an_error_naming_it(job, capsys) -> None:
    sid = chosen(job)[0]
    path = shard_of(job, sid)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit inside the tensors' bytes: only the CRC32 sees it
    path.write_bytes(bytes(data))
    code, res = canary_cli(job["config"], capsys=capsys)
    assert (code, res["state"]) == (EXIT_FAILED, "error"), res
    assert repr(sid) in res["message"] and "crc" in res["message"].lower()


def test_a_dataset_without_the_sample_is_an_error(job, tmp_path, capsys) -> None:
    sid = chosen(job)[0]
    rows = [r for r in job["dataset"].read_text().splitlines() if sid not in r]
    other = tmp_path / job["dataset"].name
    other.write_text("\n".join(rows) + "\n")
    config = yaml.safe_load(job["config"].read_text())
    config["dataset"] = str(other)
    job["config"].write_text(yaml.safe_dump(config))
    code, res = canary_cli(job["config"], capsys=capsys)
    assert (code, res["state"]) == (EXIT_USAGE, "error"), res
    assert repr(sid) in res["message"] and "not in the dataset" in res["message"]


@pytest.mark.parametrize("args", [["--samples", "0"], ["--tolerance", "-1"], ["--tolerance", "nan"]])
def test_bad_settings_are_usage_errors(job, args, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["canary", "--config", str(job["config"]), *args])
    assert e.value.code == EXIT_USAGE
    assert "must be" in capsys.readouterr().err
