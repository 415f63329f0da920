"""Issue #30 item 9: the systemd unit templates with hostile operator-given values.

Both units (roles/extraction_job, roles/sglang_server) are rendered by Ansible's template module with
values holding spaces, quotes, backslashes, `%` (a systemd specifier), `$` (variable expansion in
Exec lines) and `;`, and read back by systemd's own parser: `systemd --test` (systemd 252 here) dumps
each unit as systemd loaded it: every Exec line's argv, every Environment= assignment, Description,
RequiresMountsFor. The values must come back exactly as given, with no warning. A newline (which would
start a directive of the operator's choosing) is refused, naming the variable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = Path("/lib/systemd/systemd")
ODD = "odd dir %n %% $HOME ${X} \"dq\" 'sq' \\ ;"  # every character systemd treats specially but \n
# systemd runs no executable whose path holds a quote or a backslash (and never expands $ there).
ODD_EXE = "odd dir %n %% ;"
EXTRACTION = {
    "extraction_job_unit": "hsx-extraction.service",
    "extraction_job_venv": f"/opt/hsx/{ODD_EXE}/venv",
    "extraction_job_config_path": f"/etc/hsx/{ODD}.yaml",
    "extraction_job_output_dir": f"/data/{ODD}/out",
    "extraction_job_backend": "sglang",
    "extraction_job_server_unit": "hsx-sglang-server.service",
    "extraction_job_restart_sec": 10,
    "extraction_job_stop_timeout_sec": 120,
    "extraction_job_stop_notice": f"/opt/hsx/{ODD_EXE}/libexec/hsx-job-stopped",
    "extraction_job_environment": {"HOSTILE": ODD, "EMPTY": "", "PLAIN": "1", "DOLLAR": "$PATH"},
    "extraction_job_dump_dir": f"/run/{ODD}/dumps",
    "extraction_job_user": "hsx",
    "extraction_job_group": "hsx",
    "extraction_job_hardening": True,
    "extraction_job_metrics_dir": f"/var/lib/{ODD}/textfile",
}
SGLANG_ARGV = [f"/opt/sglang/{ODD_EXE}/bin/python", "-m", "sglang.launch_server", "--model-path", f"/data/models/{ODD}",
               "--port", "30000", "--served-model-name", "a;b", "--chat-template", "", "--x", "%i$$"]
SGLANG = {
    "sglang_server_model_path": f"/data/models/{ODD}",
    "sglang_server_dump_dir": f"/data/hsx/{ODD}/dumps",
    "_sglang_server_argv": SGLANG_ARGV,
    "_sglang_server_env": {"HSX_DUMP_DIR": f"/data/hsx/{ODD}/dumps", "HSX_DUMP_LAYERS": "1,3,4", "ODD": ODD},
    "sglang_server_restart_sec": 30,
    "sglang_server_stop_timeout_sec": 120,
    "sglang_server_user": "hsx",
    "sglang_server_group": "hsx",
    "sglang_server_hardening": True,
    "sglang_server_device_allow": ["char-nvidia-frontend rw", "char-nvidia-uvm rw", "/dev/nvidia-caps/x%y r"],
}
TEMPLATES = {
    "extraction": ROOT / "roles/extraction_job/templates/hsx-extraction.service.j2",
    "sglang": ROOT / "roles/sglang_server/templates/hsx-sglang-server.service.j2",
}


def render(out: Path, cases: dict[str, tuple[str, dict]]) -> dict[str, dict]:
    """Render each case (template, vars) into out/<case>.service with ansible-playbook; the results."""
    tasks = [{"name": case, "ansible.builtin.template": {"src": str(TEMPLATES[tpl]), "dest": str(out / f"{case}.service"),
                                                         "mode": "0644"},
              "vars": variables, "ignore_errors": True, "register": f"r_{case}"}
             for case, (tpl, variables) in cases.items()]
    results = "{{ {" + ", ".join(f"'{c}': r_{c}" for c in cases) + "} | to_json }}"
    tasks.append({"name": "Results", "ansible.builtin.copy": {"content": results, "dest": str(out / "results.json"),
                                                              "mode": "0644"}})
    play = out / "play.yml"
    play.write_text(json.dumps([{"name": "Render", "hosts": "localhost", "gather_facts": False, "tasks": tasks}]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                           "-e", f"ansible_python_interpreter={sys.executable}", str(play)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert (out / "results.json").is_file(), proc.stdout[-4000:] + proc.stderr[-2000:]
    return json.loads((out / "results.json").read_text())


def systemd_view(unit_dir: Path, unit: str) -> tuple[dict[str, list], str]:
    """What systemd's parser made of unit_dir/unit: {field: [values]} from `systemd --test`'s dump
    (Exec lines as argv lists), and the warnings it printed about files in unit_dir."""
    drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(unit_dir), "SYSTEMD_UNIT_PATH": f"{unit_dir}:",
           "SYSTEMD_LOG_COLOR": "0"}
    proc = subprocess.run([*drop, str(SYSTEMD), "--test", "--system", f"--unit={unit}", "--no-pager"],
                          env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    warnings = "\n".join(line for line in out.splitlines() if str(unit_dir) in line and "Fragment Path" not in line)
    section = out.split(f"-> Unit {unit}:\n", 1)[1].split("\n\t-> Unit ", 1)[0]
    fields: dict[str, list] = {}
    current_exec = None
    for line in section.splitlines():
        m = re.match(r"\t\t-> (Exec\w+):$", line)
        if m:
            current_exec = m.group(1)
            continue
        m = re.match(r"\t\t\tCommand Line: (.*)$", line)
        if m and current_exec:
            fields.setdefault(current_exec, []).append(expand_exec(shell_words(m.group(1))))
            continue
        m = re.match(r"\t\t([A-Za-z ]+): (.*?)( \(origin-[a-z -]+\))?$", line)
        if m:
            fields.setdefault(m.group(1), []).append(m.group(2))
    return fields, warnings


def shell_words(line: str) -> list[str]:
    """Words of a POSIX shell line as systemd's quote_command_line() writes one: bare words with
    backslash escapes, "..." (backslash escapes $ ` " \\), '...' and $'...' (C escapes)."""
    words, i, n = [], 0, len(line)
    while i < n:
        while i < n and line[i] in " \t":
            i += 1
        if i >= n:
            break
        word = ""
        while i < n and line[i] not in " \t":
            c = line[i]
            if c == "\\":
                word, i = word + line[i + 1], i + 2
            elif c == '"':
                i += 1
                while line[i] != '"':
                    if line[i] == "\\" and line[i + 1] in '$`"\\\n':
                        i += 1
                    word, i = word + line[i], i + 1
                i += 1
            elif c == "'":
                end = line.index("'", i + 1)
                word, i = word + line[i + 1 : end], end + 1
            elif line.startswith("$'", i):
                end = i + 2
                while line[end] != "'":
                    end += 2 if line[end] == "\\" else 1
                word, i = word + line[i + 2 : end].encode().decode("unicode_escape"), end + 1
            else:
                word, i = word + c, i + 1
        words.append(word)
    return words


def expand_exec(argv: list[str]) -> list[str]:
    """An Exec line's argv as the process gets it: `$$` is `$`; a lone `$` would be a variable."""
    out = []
    for arg in argv:
        assert not re.search(r"(?<!\$)(\$\$)*\$(?!\$)", arg), f"unescaped $ (systemd would expand it): {arg!r}"
        out.append(arg.replace("$$", "$"))
    return out


needs_systemd = pytest.mark.skipif(not SYSTEMD.exists() or (os.geteuid() == 0 and not shutil.which("setpriv")),
                                   reason="needs systemd (its --test mode) on the control node")


@pytest.fixture(scope="module")
def rendered():
    out = Path(tempfile.mkdtemp(prefix="hsx-units-"))
    out.chmod(0o755)  # systemd --test runs as nobody
    try:
        results = render(out, {"hsx_extraction": ("extraction", EXTRACTION), "hsx_sglang_server": ("sglang", SGLANG)})
        for case, result in results.items():
            assert not result.get("failed"), (case, result.get("msg"))
        units = out / "units"
        units.mkdir()
        units.chmod(0o755)
        for name in ("hsx-extraction", "hsx-sglang-server"):
            (units / f"{name}.service").write_text((out / f"{name.replace('-', '_')}.service").read_text())
            (units / f"{name}.service").chmod(0o644)
        yield units
    finally:
        shutil.rmtree(out, ignore_errors=True)


@needs_systemd
def test_extraction_unit_reads_back_exactly_as_given(rendered):
    view, warnings = systemd_view(rendered, "hsx-extraction.service")
    assert warnings == ""
    v = EXTRACTION
    assert view["ExecStart"] == [[f"{v['extraction_job_venv']}/bin/hsx", "extract", "--config",
                                  v["extraction_job_config_path"]]]
    # The exit-75/2 notice: a script the role deploys, given the unit and the config as arguments.
    assert view["ExecStopPost"] == [[v["extraction_job_stop_notice"], v["extraction_job_unit"],
                                     v["extraction_job_config_path"]]]
    assert sorted(view["Environment"]) == sorted([*(f"{k}={x}" for k, x in v["extraction_job_environment"].items()),
                                                  "PYTHONPYCACHEPREFIX=/var/cache/hsx/pycache"])
    assert view["Description"] == [f"hsx hidden-state extraction ({v['extraction_job_output_dir']})"]
    # PrivateTmp= and CacheDirectory= add their own (systemd lists them in no fixed order).
    assert set(view["RequiresMountsFor"]) == {v["extraction_job_output_dir"], "/var/tmp", "/var/cache/hsx"}
    assert view["LimitNOFILE"] == ["65536"]  # a descriptor per dump piece kept until its shard is written


@needs_systemd
def test_extraction_unit_is_sandboxed_writing_only_what_the_job_writes(rendered):
    """Least privilege (#30 item 11): the account, and exactly OUTPUT, the dump and metrics directories
    writable (the metrics one may be absent: '-'); systemd dumps the list space-joined."""
    view, _ = systemd_view(rendered, "hsx-extraction.service")
    v = EXTRACTION
    assert view["User"] == ["hsx"] and view["Group"] == ["hsx"] and view["UMask"] == ["0027"]
    assert view["ReadWritePaths"] == [" ".join([v["extraction_job_output_dir"], v["extraction_job_dump_dir"],
                                                "-" + v["extraction_job_metrics_dir"]])]
    for name, value in [("ProtectSystem", "strict"), ("ProtectHome", "yes"), ("PrivateTmp", "yes"),
                        ("PrivateDevices", "yes"), ("RestrictSUIDSGID", "yes"),
                        ("ProtectKernelTunables", "yes"), ("ProtectKernelModules", "yes"),
                        ("ProtectControlGroups", "yes"), ("CapabilityBoundingSet", "")]:
        assert view.get(name) == [value], (name, view.get(name))
    assert "RemoveIPC" not in view or view["RemoveIPC"] == ["no"]  # the server shares the account's IPC


@needs_systemd
def test_sglang_unit_reads_back_exactly_as_given(rendered):
    view, warnings = systemd_view(rendered, "hsx-sglang-server.service")
    assert warnings == ""
    assert view["ExecStart"] == [SGLANG_ARGV]
    assert sorted(view["Environment"]) == sorted(f"{k}={x}" for k, x in SGLANG["_sglang_server_env"].items())
    assert view["Description"] == [f"SGLang server with the hsx dump hook ({SGLANG['sglang_server_model_path']})"]
    # PrivateTmp= and StateDirectory= add their own (systemd lists them in no fixed order).
    assert set(view["RequiresMountsFor"]) == {SGLANG["sglang_server_dump_dir"], SGLANG["sglang_server_model_path"],
                                              "/var/tmp", "/var/lib/hsx"}


@needs_systemd
def test_sglang_unit_is_sandboxed_with_only_the_gpu_devices(rendered):
    view, _ = systemd_view(rendered, "hsx-sglang-server.service")
    assert view["User"] == ["hsx"] and view["UMask"] == ["0077"]
    assert view["ReadWritePaths"] == [SGLANG["sglang_server_dump_dir"]]
    assert view["DevicePolicy"] == ["closed"]
    assert set(view["DeviceAllow"]) >= {"char-nvidia-frontend rw", "char-nvidia-uvm rw", "/dev/nvidia-caps/x%y r"}
    for name, value in [("ProtectSystem", "strict"), ("ProtectHome", "read-only"), ("PrivateTmp", "yes"),
                        ("PrivateDevices", "no"), ("RestrictSUIDSGID", "yes"),
                        ("StateDirectory", "hsx")]:
        assert view.get(name) == [value], (name, view.get(name))


def test_no_shell_string_interpolates_a_value():
    """No `sh -c '... {{ var }} ...'`: a value inside a shell script is code."""
    for path in TEMPLATES.values():
        text = path.read_text()
        assert not re.search(r"\bsh\b['\"]?\s+-c\b", text), path


REFUSED = [
    ("config", "extraction", {"extraction_job_config_path": "/etc/hsx/x.yaml\nExecStartPre=/bin/touch /pwned"},
     "extraction_job_config_path"),
    ("venv_cr", "extraction", {"extraction_job_venv": "/opt/hsx/venv\rX=1"}, "extraction_job_venv"),
    ("output", "extraction", {"extraction_job_output_dir": "/data/out\n[Service]\nUser=nobody"},
     "extraction_job_output_dir"),
    ("env", "extraction", {"extraction_job_environment": {"HF_HOME": "/x\nExecStartPre=/bin/sh -c evil"}},
     "extraction_job_environment.HF_HOME"),
    ("unit", "extraction", {"extraction_job_unit": "../../../etc/cron.d/evil"}, "extraction_job_unit"),
    ("exe", "extraction", {"extraction_job_venv": "/opt/$HOME/venv"}, "extraction_job_venv"),
    ("relative", "sglang", {"_sglang_server_argv": ["python3", "-m", "sglang.launch_server"]}, "sglang_server_command"),
    ("model", "sglang", {"sglang_server_model_path": "/m\nExecStartPre=/bin/evil"}, "sglang_server_model_path"),
    ("sgl_env", "sglang", {"_sglang_server_env": {"HSX_DUMP_DIR": "/d\nUser=nobody"}},
     "sglang_server_environment.HSX_DUMP_DIR"),
    ("extra_arg", "sglang", {"_sglang_server_argv": [*SGLANG_ARGV, "--mem-fraction-static", "0.8\nUser=nobody"]},
     "--mem-fraction-static"),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """Every refusal case rendered in one ansible-playbook run: {case: (result, out dir)}."""
    out = tmp_path_factory.mktemp("refused")
    cases = {case: (template, {**(EXTRACTION if template == "extraction" else SGLANG), **variables})
             for case, template, variables, _ in REFUSED}
    return render(out, cases), out


@pytest.mark.parametrize("case, name", [(c[0], c[3]) for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_a_newline_or_bad_value_is_refused_naming_the_variable(refused, case, name):
    results, out = refused
    result = results[case]
    assert result.get("failed"), result
    assert name in result["msg"], result["msg"]
    assert not (out / f"{case}.service").exists()
