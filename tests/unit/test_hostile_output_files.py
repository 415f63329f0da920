"""run.json, index.jsonl and status.json are data we did not necessarily write (issue #38).

A FIFO planted at one of them must not hang a reader (`hsx verify`, `hsx status`, and the
`shard_verify` and `extraction_status` modules, which run as root in recover.yml's assess
stage), and a symlink there must not be followed: each reader gives a clear error naming the
file. Every case runs under an alarm, so a reader that blocks fails the test instead of hanging.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from ansible.module_utils.testing import patch_module_args
from ansible_modules import load_module
from shard_helpers import make_run

from extraction.cli import main as hsx_main
from hsx.exitcodes import EXIT_USAGE
from hsx.layout import INDEX_NAME, MANIFEST_NAME
from hsx.status import STATUS_NAME, StatusReporter

shard_verify = load_module("shard_verify")
extraction_status = load_module("extraction_status_info")


# Every test here: a reader that blocks on a FIFO fails (conftest.no_hang), not a hung run.
pytestmark = pytest.mark.usefixtures("no_hang")


def plant(out: Path, name: str, kind: str, elsewhere: Path) -> Path:
    """A run in `out` (2 shards, status.json) whose `name` is replaced by a FIFO or a symlink to a
    good copy of itself outside the run (so only the refusal to follow can fail the reader)."""
    make_run(out, n=2)
    reporter = StatusReporter(str(out), 2, 2, 0)
    reporter.set_state("done")
    reporter.write()
    path = out / name
    if kind == "fifo":
        path.unlink()
        os.mkfifo(path)
    else:
        elsewhere.mkdir(exist_ok=True)
        target = elsewhere / name
        path.rename(target)
        path.symlink_to(target)
    return path


KINDS = ("fifo", "symlink")
FOUND = {"fifo": "is not a regular file", "symlink": "is a symlink"}


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = hsx_main(list(argv))
    return code, capsys.readouterr().err


def run_module(module: object, capsys: pytest.CaptureFixture[str], **args: object) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        module.main()  # type: ignore[attr-defined]
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", [MANIFEST_NAME, INDEX_NAME])
@pytest.mark.parametrize("level", ["quick", "full"])
def test_hsx_verify_refuses_a_planted_file(tmp_path, capsys, name, kind, level):
    path = plant(tmp_path / "out", name, kind, tmp_path / "elsewhere")
    code, err = cli(capsys, "verify", str(tmp_path / "out"), "--level", level, "--workers", "1")
    assert code == EXIT_USAGE
    assert f"hsx verify: {path} {FOUND[kind]}: refusing to read through it" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("kind", KINDS)
def test_hsx_status_refuses_a_planted_status_json(tmp_path, capsys, kind):
    path = plant(tmp_path / "out", STATUS_NAME, kind, tmp_path / "elsewhere")
    code, err = cli(capsys, "status", str(tmp_path / "out"))
    assert code == EXIT_USAGE
    assert f"{path} {FOUND[kind]}: refusing to read through it" in err


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", [MANIFEST_NAME, INDEX_NAME])
def test_shard_verify_module_fails_with_the_file_named(tmp_path, capsys, name, kind):
    path = plant(tmp_path / "out", name, kind, tmp_path / "elsewhere")
    result = run_module(shard_verify, capsys, path=str(tmp_path / "out"), level="full", workers=1)
    assert result["failed"] is True
    assert result["msg"].startswith(f"{path} {FOUND[kind]}: refusing to read through it")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", [MANIFEST_NAME, INDEX_NAME, STATUS_NAME])
def test_extraction_status_module_names_the_file(tmp_path, capsys, name, kind):
    path = plant(tmp_path / "out", name, kind, tmp_path / "elsewhere")
    result = run_module(extraction_status, capsys, path=str(tmp_path / "out"))
    assert "failed" not in result  # read-only facts: the assess stage records them and goes on
    if name == MANIFEST_NAME:
        assert result["has_manifest"] is False
        assert result["done"] == 2 and result["state"] == "done"
    else:
        assert f"{path} {FOUND[kind]}: refusing to read through it" in result["message"]

