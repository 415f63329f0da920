"""The product's own SGLang path against the RELEASED SGLang server, on this machine's CPU: what
the lab does not run (the Qwen2 target, `hsx patch` without Ansible).

The tiny Llama target runs in `make test`, in a lab host, through the roles (the molecule scenario
sglang_server: the patch deployed, the server the role's unit, `hsx extract --backend sglang` equal
to the hf backend, chunked prefill, the radix-cache preflight). This module, outside `make test` (a
server start is 20-90 s of CPU-bound imports; tests/run_all.sh says why), runs the same server on
the local machine for the tiny Qwen2 target (extraction/testbed/tiny_dense.py). No stand-in server:
sglang 0.5.23 from the venv of tests/sglang_cpu/install.py (`make sglang-cpu`), seen through an
overlayfs of this test's own (the cached venv is shared with the lab's hosts and never written),
started by tests/sglang_cpu/server.py with the `sgl_kernel` stand-in (a kernel library whose only
wheel is a CUDA build; its docstring says why). What is checked:
- `hsx patch apply --model M` deploys the patch and hook into the installed SGLang (qwen2.py, which
  the model's architecture chooses); at the end `hsx patch revert` gives back the released file
  (its SHA-256 in the wheel's RECORD);
- `hsx extract --backend sglang` over a tiny dataset, chunked prefill forced on
  (--chunked-prefill-size CHUNK): the shards verify deep and equal the hf backend's shards of the
  same model (compare_shards: input_ids and loss_mask bit-equal, the states within
  compare_shards.BF16_TOL; how many states came out bit-equal is printed), and one long request's
  dump, kept, is seen in pieces at the chunk boundaries;
- nothing is left in the dump directory once the client is done.
A missing venv FAILS the test, naming the install command. Figures (server start, samples/s of
both backends) are printed by the last test (`-s`). Needs root (the overlay mount).

    .venv/bin/pytest tests/integration/test_sglang_cpu.py -q -s -p no:cacheprovider
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "sglang_cpu"))

import compare_shards  # noqa: E402
from server import CPUServer, venv_problem  # noqa: E402

from extraction.testbed.tiny import write_tiny_dataset  # noqa: E402
from extraction.testbed.tiny_dense import CAPTURE_LAYERS, build_tiny_dense  # noqa: E402

HSX = str(REPO / ".venv" / "bin" / "hsx")
LAYERS = ",".join(map(str, CAPTURE_LAYERS))
SAMPLES = 24
CHUNK = 64  # --chunked-prefill-size: most tiny samples are longer
ARCHS = ("qwen2",)  # the tiny Llama runs in the lab (tests/molecule/sglang_server)
pytestmark = pytest.mark.slow
FIGURES: dict[str, object] = {}


def hsx(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run([HSX, *args], capture_output=True, text=True, env=env)
    if check and done.returncode != 0:
        pytest.fail(
            f"hsx {' '.join(args)}: rc {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return done


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """The cached venv seen through an overlayfs of this module's own: the patch writes to the
    upper layer, the cached venv (the lab hosts' lower layer too) is never written."""
    problem = venv_problem()
    if problem:
        pytest.fail(problem)  # not a skip: this test exists to run the real server
    from install import default_venv

    base = tmp_path_factory.mktemp("venv-overlay")
    view = base / "venv"
    for d in ("upper", "work", "venv"):
        (base / d).mkdir(exist_ok=True)
    opts = f"lowerdir={default_venv()},upperdir={base / 'upper'},workdir={base / 'work'}"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(view)], check=True)
    try:
        yield view
    finally:
        subprocess.run(["umount", str(view)], check=False)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("sglang-cpu")
    base.chmod(0o700)
    (base / "api-key").write_text("hsx-test-key\n")
    (base / "api-key").chmod(0o600)
    write_tiny_dataset(base / "tiny.jsonl", SAMPLES, seed=5)
    return base


@pytest.fixture(scope="module")
def models(work) -> dict[str, Path]:
    return {arch: build_tiny_dense(arch, work / f"tiny-{arch}") for arch in ARCHS}


def released(venv: Path, relpath: str) -> bool:
    """Whether sglang/<relpath> in the venv is the file the wheel installed (its RECORD's SHA-256)."""
    site = next((venv / "lib").glob("python3*/site-packages"))
    record = next(site.glob("sglang-*.dist-info")) / "RECORD"
    for line in record.read_text().splitlines():
        path, digest, _size = line.rsplit(",", 2)
        if path == f"sglang/{relpath}":
            got = base64.urlsafe_b64encode(hashlib.sha256((site / path).read_bytes()).digest()).rstrip(b"=")
            return digest == "sha256=" + got.decode()
    raise AssertionError(f"sglang/{relpath} is not in {record}")


@pytest.fixture(scope="module")
def patched(venv, models):
    """The patch in the installed SGLang for the targets (no backups left); reverted at the end,
    the released files back byte for byte."""
    files = {arch: f"srt/models/{arch}.py" for arch in models}
    for model in models.values():  # what an interrupted run left (nothing, usually)
        hsx("patch", "revert", "--sglang", str(venv), "--model", str(model), "--no-backup")
    assert all(released(venv, f) for f in files.values()), "the cached venv's SGLang is not as released"
    try:
        for model in models.values():
            hsx("patch", "apply", "--sglang", str(venv), "--model", str(model), "--no-backup")
            done = hsx("patch", "status", "--sglang", str(venv), "--model", str(model), "--json")
            assert json.loads(done.stdout)["ok"], done.stdout
        yield
    finally:
        for model in models.values():
            hsx("patch", "revert", "--sglang", str(venv), "--model", str(model), "--no-backup")
    assert all(released(venv, f) for f in files.values()), "hsx patch revert left the files changed"
    assert not list((venv / "lib").glob("python3*/site-packages/sglang/hsx_*.py")), "hook files left"


def serve(model: Path, work: Path, name: str, venv: Path, **kwargs) -> CPUServer:
    dump_dir = work / f"dumps-{name}"
    dump_dir.mkdir(mode=0o700)
    srv = CPUServer(
        model,
        log_path=work / f"server-{name}.log",
        dump_dir=str(dump_dir),
        dump_layers=LAYERS,
        api_key="hsx-test-key",
        venv=venv,
        **kwargs,
    )
    srv.start()  # here, not in `with`: the start time is recorded before the test uses it
    FIGURES.setdefault("server_start_s", []).append(round(srv.start_seconds, 1))
    return srv


def extract(work: Path, model: Path, out: Path, srv: CPUServer | None = None, check: bool = True):
    args = [
        "extract",
        "--model",
        str(model),
        "--dataset",
        str(work / "tiny.jsonl"),
        "--output",
        str(out),
        "--layers",
        LAYERS,
        "--progress",
        "off",
        "--reserve-bytes",
        "16M",
    ]
    if srv is not None:
        args += [
            "--backend",
            "sglang",
            "--server-url",
            srv.url,
            "--dump-dir",
            srv.env["HSX_DUMP_DIR"],
            "--api-key-file",
            str(work / "api-key"),
            "--concurrency",
            "4",
        ]
    t0 = time.monotonic()
    done = hsx(*args, check=check)
    return done, time.monotonic() - t0


@pytest.fixture(scope="module")
def hf_shards(work, models) -> dict[str, Path]:
    out = {}
    for arch, model in models.items():
        out[arch] = work / f"hf-{arch}"
        _, seconds = extract(work, model, out[arch])
        FIGURES[f"hf_{arch}_samples_per_s"] = round(SAMPLES / seconds, 2)
    return out


def compare(got: Path, want: Path) -> dict:
    """compare_shards.compare (ids and mask bit-equal, states within BF16_TOL), every sample."""
    return compare_shards.compare(got, want, SAMPLES)


def verify_deep(out: Path) -> None:
    done = hsx("verify", str(out), "--level", "deep", "--json")
    assert json.loads(done.stdout)["ok"] == SAMPLES, done.stdout[-2000:]


@pytest.mark.parametrize("arch", ARCHS)
def test_real_server_shards_verify_deep_and_equal_hf(arch, venv, work, models, patched, hf_shards):
    out = work / f"sglang-{arch}"
    with serve(models[arch], work, arch, venv, chunked_prefill_size=CHUNK) as srv:
        _, seconds = extract(work, models[arch], out, srv)
        long_request_comes_in_pieces(srv, models[arch])
    FIGURES[f"sglang_{arch}_samples_per_s"] = round(SAMPLES / seconds, 2)
    verify_deep(out)
    FIGURES[f"bit_equal_{arch}"] = compare(out, hf_shards[arch])


def long_request_comes_in_pieces(srv: CPUServer, model: Path) -> None:
    """One request of 5.5 chunks, its dump kept: the hook wrote it in pieces at the chunk
    boundaries, and the client joined them (then its files are removed)."""
    from extraction.backends.base import Sample
    from extraction.backends.sglang import SGLangBackend

    dump_dir = srv.env["HSX_DUMP_DIR"]
    ids = (torch.arange(5 * CHUNK + CHUNK // 2) * 7) % 1000 + 7
    backend = SGLangBackend(
        srv.url,
        dump_dir,
        str(model),
        list(CAPTURE_LAYERS),
        keep_dumps=True,
        api_key="hsx-test-key",
        health_timeout=60,
    )
    try:
        (got,) = backend.extract([Sample("long", ids, torch.ones_like(ids))])
    finally:
        backend.close()
    mine = sorted(n for n in os.listdir(dump_dir) if n.startswith(backend.rid_prefix))
    assert [int(n.rsplit(".", 2)[1]) for n in mine] == list(range(0, len(ids), CHUNK)), mine
    assert torch.equal(got.input_ids, ids) and got.hidden_state.shape == (len(ids), 128)
    for name in mine:
        os.unlink(os.path.join(dump_dir, name))


@pytest.mark.parametrize("arch", ARCHS)
def test_nothing_is_left_in_the_dump_directory(arch, work):
    """After the run and the server's stop, every file the hook wrote has been read and removed."""
    dump_dir = work / f"dumps-{arch}"
    assert dump_dir.is_dir(), "the server test did not run"
    left = sorted(os.listdir(dump_dir))
    assert not left, (
        f"{len(left)} files left in {dump_dir} that no client will read or remove "
        f"(requests the client did not send were dumped): {left[:6]}"
    )


def test_zz_figures():
    """Not a check: prints what the runs above measured (pytest -s)."""
    print("\nSGLANG-CPU FIGURES " + json.dumps(FIGURES, sort_keys=True))
