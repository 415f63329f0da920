"""The GPU health gate's active check, DCGM's diagnostic (module_utils/hsx/dcgm.py and the module's
dcgm_diag settings), against the TEST-ONLY recorded `dcgmi` (tests/fakes/dcgm/dcgmi, NOT DCGM: there
is no DCGM here; its recordings are in the format DCGM's own source writes, its header says how)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_gpu_health import HEALTHY, module, run_module

from hsx import dcgm

FAKES = Path(__file__).resolve().parents[1] / "fakes" / "dcgm"
DCGMI = str(FAKES / "dcgmi")


def recorded(name: str) -> str:
    return (FAKES / name).read_text()


def test_dcgm4_json_passing_and_failing():
    tests, error = dcgm.parse(recorded("diag_r1_pass.json"))
    assert error is None and [(t.category, t.name, t.status, t.entities, t.failed) for t in tests] == [
        ("Deployment", "software", "Pass", ["GPU0: Pass"], False)]
    tests, _ = dcgm.parse(recorded("diag_r1_fail.json"))
    assert [(t.name, t.failed, t.messages) for t in tests] == [
        ("software", True, ["GPU 0 had memory errors and row remappings are pending"])]
    tests, _ = dcgm.parse(recorded("diag_r2_fail.json"))
    assert [(t.category, t.name, t.failed) for t in tests] == [
        ("Deployment", "software", False), ("Hardware", "memory", True), ("Integration", "pcie", False)]


def test_dcgm3_json_and_the_table_without_j():
    tests, _ = dcgm.parse(recorded("diag_v3_r1_fail.json"))
    assert [t.name for t in tests if t.failed] == ["Page Retirement/Row Remap"] and len(tests) == 9
    assert tests[6].entities == ["GPU0: Fail"] and "row remappings are pending" in tests[6].messages[0]
    tests, _ = dcgm.parse(recorded("diag_r1_fail.txt"))
    assert [(t.category, t.name, t.entities, t.messages) for t in tests] == [
        ("Deployment", "software", ["GPU0: Fail"], ["GPU 0 had memory errors and row remappings are pending"])]
    assert not dcgm.parse(recorded("diag_r1_pass.txt"))[0][0].failed


def test_a_runtime_error_and_unreadable_output():
    assert dcgm.parse(recorded("diag_runtime_error.json")) == (
        [], "Error: Diagnostic could not be run while DCGM is paused.")
    with pytest.raises(ValueError):
        dcgm.parse("Error: unable to establish a connection to the specified host: localhost")


@pytest.mark.parametrize("text,rc,state,words", [
    ("diag_r1_pass.json", 0, "passed", "dcgmi diag -r 1 passed (1 tests"),
    ("diag_r1_fail.json", 226, "failed", "failed: software (GPU0: Fail): GPU 0 had memory errors"),
    ("diag_r1_fail.json", 0, "failed", "failed: software"),  # a test that says Fail fails, whatever the exit
    ("diag_r1_pass.json", 226, "failed", "exited 226 with no test failed"),  # an exit that says fail fails
    ("diag_runtime_error.json", 202, "failed", "could not run: Error: Diagnostic could not be run while DCGM is paused"),
])
def test_the_verdict_takes_both_the_exit_and_every_test(text, rc, state, words):
    r = dcgm.judge(1, rc, recorded(text))
    assert r.state == state and words in r.message, r.message


@pytest.mark.parametrize("answer,failed", [("pass", []), ("fail", ["software"]), ("fail2", ["memory"]),
                                          ("v3fail", ["Page Retirement/Row Remap"]), ("runtime_error", []),
                                          ("garbage", [])])
def test_run_diag_runs_dcgmi_diag_r_level_j(monkeypatch, tmp_path, answer, failed):
    monkeypatch.setenv("HSX_FAKE_DCGMI", answer)
    monkeypatch.setenv("HSX_FAKE_DCGMI_LOG", str(tmp_path / "calls"))
    r = dcgm.run_diag(DCGMI, 2, 30)
    assert (tmp_path / "calls").read_text() == "diag -r 2 -j\n"
    assert r.failed_tests == failed and r.state == ("passed" if answer == "pass" else "failed"), r.message


def test_a_hung_diag_is_stopped_at_its_timeout_and_fails(monkeypatch):
    monkeypatch.setenv("HSX_FAKE_DCGMI", "hang")
    started = time.monotonic()
    r = dcgm.run_diag(DCGMI, 1, 1)
    assert r.state == "failed" and "did not finish within 1 s" in r.message and time.monotonic() - started < 15


# ---------------------------------------------------------------- the module's settings
def gate(capsys, monkeypatch, tmp_path, gpus=HEALTHY, log=(), **args) -> dict:
    return run_module(capsys, monkeypatch, tmp_path, gpus, log, **args)


def on_path(monkeypatch, present: bool) -> None:
    monkeypatch.setattr(module.AnsibleModule, "get_bin_path",
                        lambda self, name, *a, **k: DCGMI if name == "dcgmi" and present else None)


def test_auto_runs_the_diag_where_dcgmi_is_and_a_failing_diag_fails_the_gate_naming_the_test(
        capsys, monkeypatch, tmp_path):
    on_path(monkeypatch, True)
    out = gate(capsys, monkeypatch, tmp_path, dcgm_diag="auto")
    assert out["passed"] and out["dcgm"]["state"] == "passed" and out["dcgm"]["rc"] == 0
    assert out["msg"].startswith("2 GPUs healthy; dcgmi diag -r 1 passed")
    monkeypatch.setenv("HSX_FAKE_DCGMI", "fail2")
    out = gate(capsys, monkeypatch, tmp_path, dcgm_diag="auto", dcgm_diag_level=2)
    assert out["failed"] and out["dcgm"]["failed_tests"] == ["memory"] and out["dcgm"]["level"] == 2
    assert "dcgmi diag -r 2 failed: memory (GPU0: Fail): Found 4 faulty memory elements on GPU 0" in out["msg"]


def test_without_dcgmi_auto_says_so_and_required_fails(capsys, monkeypatch, tmp_path):
    on_path(monkeypatch, False)
    out = gate(capsys, monkeypatch, tmp_path, dcgm_diag="auto")
    assert out["passed"] and out["dcgm"]["state"] == "absent" and "dcgmi not found" in out["msg"]
    out = gate(capsys, monkeypatch, tmp_path, dcgm_diag="required")
    assert out["failed"] and "dcgmi not found (DCGM is not installed)" in out["msg"] and "required" in out["msg"]


def test_a_configured_dcgmi_path_off_and_a_gate_already_failing(capsys, monkeypatch, tmp_path):
    on_path(monkeypatch, False)
    monkeypatch.setenv("HSX_FAKE_DCGMI", "fail")
    out = gate(capsys, monkeypatch, tmp_path, dcgm_diag="auto", dcgmi_path=DCGMI)
    assert out["failed"] and out["dcgm"]["failed_tests"] == ["software"]
    out = gate(capsys, monkeypatch, tmp_path, dcgm_diag="off", dcgmi_path=DCGMI)
    assert out["passed"] and out["dcgm"]["state"] == "off"
    monkeypatch.setenv("HSX_FAKE_DCGMI_LOG", str(tmp_path / "calls"))
    out = gate(capsys, monkeypatch, tmp_path, [{"bus": "18", "width": 8}], dcgm_diag="auto", dcgmi_path=DCGMI)
    assert out["failed"] and out["dcgm"]["state"] == "skipped" and not (tmp_path / "calls").exists()


def test_the_timeout_setting_is_checked_and_used(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HSX_FAKE_DCGMI", "hang")
    out = gate(capsys, monkeypatch, tmp_path, dcgm_diag="auto", dcgmi_path=DCGMI, dcgm_diag_timeout=1)
    assert out["failed"] and "did not finish within 1 s" in out["msg"]
    out = gate(capsys, monkeypatch, tmp_path, dcgm_diag="auto", dcgmi_path=DCGMI, dcgm_diag_timeout=0)
    assert out["failed"] and out["msg"] == "dcgm_diag_timeout must be >= 1 second, not 0"
