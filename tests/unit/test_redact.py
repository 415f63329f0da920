"""Issue #30 item 8: secrets out of what is reported. hsx.redact is the one rule (docs/security.md):
flags and variables named like key/token/secret/password/passwd/credential lose their values, in
the `--flag value`, `--flag=value` and `NAME=value` forms, in argv lists and in command-line text;
credentials in URLs and bearer tokens too. Anything else is left as it was."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hsx.procfs import ProcTable
from hsx.redact import REDACTED, is_secret_name, redact_argv, redact_env, redact_text, redact_tree

R = REDACTED


@pytest.mark.parametrize("name", [
    "api-key", "api_key", "API_KEY", "OPENAI_API_KEY", "hf-token", "HF_TOKEN", "apiKey", "hfToken",
    "secret", "client-secret", "AWS_SECRET_ACCESS_KEY", "password", "db.password", "PGPASSWORD", "passwd",
    "credential", "aws-credentials", "ssl-keyfile-password", "api-keys", "model.api_key",
])
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("name", [
    "tokenizer", "tokenizer-path", "max-total-tokens", "num_tokens", "model-path", "port", "host",
    "keyfile", "trust-remote-code", "PATH", "PWD", "HSX_DUMP_DIR", "",
])
def test_not_secret_names(name):
    assert not is_secret_name(name)


# ---------------------------------------------------------------- argv (what /proc/PID/cmdline holds)
def test_flag_then_value():
    argv = ["vllm", "serve", "/m", "--api-key", "s3cret", "--port", "8000"]
    assert redact_argv(argv) == ["vllm", "serve", "/m", "--api-key", R, "--port", "8000"]


def test_flag_equals_value():
    assert redact_argv(["x", "--hf-token=hf_abc", "--tp=8"]) == ["x", f"--hf-token={R}", "--tp=8"]
    assert redact_argv(["x", "--api-key=a b c"]) == ["x", f"--api-key={R}"]  # one argument with spaces


def test_single_dash_long_flags_and_case():
    assert redact_argv(["x", "-password", "pw", "-Token=t"]) == ["x", "-password", R, f"-Token={R}"]


def test_name_equals_value_assignments():
    argv = ["env", "HF_TOKEN=hf_abc", "OPENAI_API_KEY=sk-1", "CUDA_VISIBLE_DEVICES=0,1", "python", "-m", "x"]
    assert redact_argv(argv) == ["env", f"HF_TOKEN={R}", f"OPENAI_API_KEY={R}", "CUDA_VISIBLE_DEVICES=0,1",
                                 "python", "-m", "x"]
    assert redact_argv(["app", "model.api_key=abc"]) == ["app", f"model.api_key={R}"]


def test_flag_without_value_at_the_end_or_before_another_long_flag():
    assert redact_argv(["x", "--api-key"]) == ["x", "--api-key"]
    assert redact_argv(["x", "--api-key", "--port", "1"]) == ["x", "--api-key", "--port", "1"]


def test_others_are_left_alone():
    argv = ["python3", "-m", "sglang.launch_server", "--model-path", "/data/models/K2.5", "--tokenizer", "/t",
            "--max-total-tokens", "8192", "--tp-size", "8", "--trust-remote-code"]
    assert redact_argv(argv) == argv


def test_url_credentials_and_bearer_tokens():
    argv = ["curl", "-H", "Authorization: Bearer abc.def", "https://user:pw@example.invalid/x", "http://h:80/y"]
    assert redact_argv(argv) == ["curl", "-H", f"Authorization: Bearer {R}",
                                 f"https://user:{R}@example.invalid/x", "http://h:80/y"]


def test_a_command_inside_one_argument():
    argv = ["/bin/sh", "-c", "exec vllm serve /m --api-key 's3 cret' --port 1 HF_TOKEN=x"]
    assert redact_argv(argv) == ["/bin/sh", "-c", f"exec vllm serve /m --api-key {R} --port 1 HF_TOKEN={R}"]


# ---------------------------------------------------------------- text (a command line already joined)
@pytest.mark.parametrize("text, shown", [
    ("vllm serve /m --api-key s3cret --port 1", f"vllm serve /m --api-key {R} --port 1"),
    ("vllm serve /m --api-key=s3cret", f"vllm serve /m --api-key={R}"),
    ('x --password "a b" --y 1', f"x --password {R} --y 1"),
    ("HF_TOKEN=abc python -m x", f"HF_TOKEN={R} python -m x"),
    ("x --api-key --hf-token t", f"x --api-key --hf-token {R}"),
    ("pip install --index-url https://u:p4ss@pypi.invalid/simple x",
     f"pip install --index-url https://u:{R}@pypi.invalid/simple x"),
    ("no secrets --tokenizer /t here", "no secrets --tokenizer /t here"),
    ("  spacing\tkept  --key k ", f"  spacing\tkept  --key {R} "),
])
def test_text(text, shown):
    assert redact_text(text) == shown


def test_environment_and_nested_results():
    assert redact_env({"HF_TOKEN": "x", "PYTHONUNBUFFERED": "1", "ARGS": "--api-key k"}) == {
        "HF_TOKEN": R, "PYTHONUNBUFFERED": "1", "ARGS": f"--api-key {R}"}
    result = {
        "command": ["/v/bin/python", "-m", "sglang.launch_server", "--api-key", "k1", "--port", "30000"],
        "environment": {"SGLANG_API_KEY": "k2", "HSX_DUMP_DIR": "/data/hsx/dumps"},
        "processes": [{"pid": 7, "cmdline": "vllm serve --api-key k3", "unit": "vllm.service"}],
        "msg": "pid 7 (vllm serve --hf-token=k4) still alive",
        "api_key_set": True, "num_tokens": 12, "done": 3, "none": None,
    }
    shown = redact_tree(result)
    assert all(k not in repr(shown) for k in ("k1", "k2", "k3", "k4"))
    assert shown["command"][-2:] == ["--port", "30000"] and shown["environment"]["HSX_DUMP_DIR"] == "/data/hsx/dumps"
    assert shown["api_key_set"] is True and shown["num_tokens"] == 12 and shown["none"] is None
    assert result["environment"]["SGLANG_API_KEY"] == "k2"  # a copy: the input is not changed


# ---------------------------------------------------------------- where command lines are read
def test_proc_table_reports_a_real_process_redacted():
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; print('ready', flush=True); time.sleep(60)",
                              "--api-key", "s3cret-1", "--hf-token=s3cret-2", "HF_TOKEN=s3cret-3", "--port", "8"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        cmdline = ProcTable().info(child.pid).cmdline
    finally:
        child.kill()
        child.wait()
    assert "s3cret" not in cmdline
    assert cmdline.endswith(f"--api-key {R} --hf-token={R} HF_TOKEN={R} --port 8")
