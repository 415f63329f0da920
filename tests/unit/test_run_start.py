"""`hsx extract`'s start: mistakes reported before torch is imported, nothing written in the
output until the run can start, and a finished output left before the model loads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hsx_run_helpers import SharedBackend, make_cfg, one_thread, run  # noqa: F401  (one_thread: autouse)

from extraction.backends.hf import HFBackend
from extraction.testbed.tiny import write_tiny_dataset
from hsx.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from hsx.layout import MANIFEST_NAME

ROOT = Path(__file__).resolve().parents[2]
# The CLI in a child, which says afterwards whether torch was imported: mistakes must be reported
# before it is (it takes seconds to import), so a test need not time anything.
WRAP = (
    "import sys; from extraction.cli import main; rc = main(sys.argv[1:]); "
    "print('torch imported:', 'torch' in sys.modules); sys.exit(rc)"
)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_dataset(tmp_path_factory.mktemp("ds") / "d.jsonl", 6, seed=3)


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> SharedBackend:
    return SharedBackend(HFBackend(tiny_model_dir, [1, 3, 4], dtype="fp32"))


def _hsx(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'module_utils'}"}
    return subprocess.run(
        [sys.executable, "-c", WRAP, *args], capture_output=True, text=True, env=env, timeout=120, check=False
    )


def _case(name: str, tmp: Path, model: Path, dataset: Path) -> tuple[list[str], str]:
    """(extra arguments, the message expected) for one mistake, its files made under tmp."""
    if name == "no model":
        return ["--model", str(tmp / "nomodel")], f"--model {tmp / 'nomodel'}: no such directory"
    if name in ("no config", "no weights"):
        partial = tmp / "partial"
        shutil.copytree(model, partial)
        (partial / ("config.json" if name == "no config" else "model.safetensors")).unlink()
        if name == "no config":
            return ["--model", str(partial)], f"{partial / 'config.json'}: cannot read model config"
        return ["--model", str(partial)], f"--model {partial}: no weights (*.safetensors, *.bin)"
    if name == "no dataset":
        return ["--dataset", str(tmp / "none.jsonl")], f"--dataset {tmp / 'none.jsonl'}: No such file or directory"
    if name == "dataset a fifo":
        os.mkfifo(tmp / "fifo")
        return ["--dataset", str(tmp / "fifo")], f"--dataset {tmp / 'fifo'}: not a regular file"
    if name == "dataset unreadable":
        return ["--dataset", str(tmp)], f"--dataset {tmp}: not a regular file"
    if name == "bad layers":
        return ["--layers", "2,99"], "--layers: "
    assert name == "output a file"
    (tmp / "out").write_text("x")
    return [], f"--output {tmp / 'out'}: exists and is not a directory"


@pytest.mark.parametrize(
    "name",
    [
        "no model",
        "no config",
        "no weights",
        "no dataset",
        "dataset a fifo",
        "dataset unreadable",
        "bad layers",
        "output a file",
    ],
)
def test_mistakes_are_reported_before_torch_is_imported(tmp_path, tiny_model_dir, dataset, name) -> None:
    extra, says = _case(name, tmp_path, tiny_model_dir, dataset)
    base = {"--model": str(tiny_model_dir), "--dataset": str(dataset), "--output": str(tmp_path / "out")}
    args = dict(zip(extra[::2], extra[1::2], strict=True))
    argv = ["extract", *[x for kv in {**base, **args}.items() for x in kv], "--progress", "off"]
    res = _hsx(*argv)
    assert res.returncode == EXIT_USAGE, (res.stdout, res.stderr)
    assert says in res.stderr, res.stderr
    assert "torch imported: False" in res.stdout, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    if name != "output a file":
        assert not (tmp_path / "out").exists()  # nothing written for a mistake


def test_a_failed_start_writes_no_run_json_and_the_corrected_command_runs(
    tiny_model_dir, dataset, backend, tmp_path
) -> None:
    out = tmp_path / "out"

    def broken(_cfg, _ids):
        raise OSError("model.safetensors: header too large")  # weights that do not load

    logs: list[str] = []
    assert run(make_cfg(tiny_model_dir, dataset, out), logs=logs, backend_factory=broken) == EXIT_FAILED
    assert any("cannot start the hf backend" in m for m in logs), logs
    assert not (out / MANIFEST_NAME).exists() and not (out / "shards").exists()
    assert run(make_cfg(tiny_model_dir, dataset, out), backend) == EXIT_OK
    assert json.loads((out / MANIFEST_NAME).read_text())["layer_ids"] == [1, 3, 4]


def test_a_finished_output_exits_before_the_model_loads(tiny_model_dir, dataset, backend, tmp_path) -> None:
    out = tmp_path / "out"
    assert run(make_cfg(tiny_model_dir, dataset, out), backend) == EXIT_OK

    def must_not_load(_cfg, _ids):
        raise AssertionError("the model was loaded for a finished output")

    logs: list[str] = []
    assert run(make_cfg(tiny_model_dir, dataset, out), logs=logs, backend_factory=must_not_load) == EXIT_OK
    assert f"already complete: 6/6 samples in {out}; nothing to do (the model was not loaded)" in logs, logs


def test_refusing_to_resume_says_what_to_do_next(tiny_model_dir, dataset, backend, tmp_path) -> None:
    out = tmp_path / "out"
    assert run(make_cfg(tiny_model_dir, dataset, out, limit=1), backend) == EXIT_OK
    logs: list[str] = []
    assert run(make_cfg(tiny_model_dir, dataset, out, layers="1,2,4"), backend, logs) == EXIT_USAGE
    (line,) = [m for m in logs if "refusing to resume" in m]
    assert line.endswith(
        "to extract with these options, use another --output; to go on with this run, use the options "
        f"its {out / MANIFEST_NAME} records"
    ), line


def test_a_fifo_at_the_index_is_refused_with_its_name_not_waited_on(tiny_model_dir, dataset, backend, tmp_path) -> None:
    out = tmp_path / "out"
    assert run(make_cfg(tiny_model_dir, dataset, out, limit=1), backend) == EXIT_OK
    (out / "index.jsonl").unlink()
    os.mkfifo(out / "index.jsonl")
    logs: list[str] = []
    assert run(make_cfg(tiny_model_dir, dataset, out), backend, logs) == EXIT_USAGE
    assert any(f"{out / 'index.jsonl'} is not a regular file" in m for m in logs), logs
