"""roles/sglang_server rendered as Ansible renders it, in-process with Ansible's own Templar
(ansible-core from the venv, ~1 s for every release; ansible-playbook per release would take minutes):
roles/hsx's defaults, the role's defaults and vars, the set_fact expressions of tasks/preflight.yml
("Note the SGLang version", "Build the command line"), then templates/hsx-sglang-server.service.j2,
whose ExecStart line is split back into arguments as systemd splits it, and
templates/hsx-sglang-server.yaml.j2 (the --config file); `server_problems` checks the result against
a release's arguments (sglang_server_args.py). For test_sglang_fidelity*.py.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_release_ast import ROOT
from sglang_server_args import VALUE, check_command_line, config_file_args, server_flags

from hsx.sglang_versions import MIN_VERSION, base_version

ROLE = ROOT / "roles" / "sglang_server"


# ---------------------------------------------------------------------------- the role, rendered


@functools.cache
def _role() -> tuple[Any, dict[str, Any], list[dict[str, Any]]]:
    from ansible.parsing.dataloader import DataLoader
    from ansible.plugins.loader import filter_loader

    # The project's filters (hsx_systemd in the unit template), wherever pytest runs from.
    if (ROOT / "filter_plugins").is_dir():
        filter_loader.add_directory(str(ROOT / "filter_plugins"))
    loader = DataLoader()

    def load(path: Path) -> Any:
        return loader.load_from_file(str(path), trusted_as_template=True)

    variables = {
        **load(ROOT / "roles" / "hsx" / "defaults" / "main.yml"),
        **load(ROLE / "defaults" / "main.yml"),
        **load(ROLE / "vars" / "main.yml"),
    }
    return loader, variables, load(ROLE / "tasks" / "preflight.yml")


def _set_fact(tasks: list[dict[str, Any]], name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    task = next((t for t in tasks if t.get("name") == name), None)
    assert task is not None, f"roles/sglang_server/tasks/preflight.yml has no task {name!r}"
    return task.get("vars", {}), task["ansible.builtin.set_fact"]


def render_server(version: str, **overrides: Any) -> tuple[list[str], str, str]:
    """(ExecStart as arguments, the unit file, the --config file) as the role writes them for a host
    running `version` (the model path and venv as an inventory would set them)."""
    from ansible.template import Templar, trust_as_template

    loader, defaults, tasks = _role()
    variables = {
        **defaults,
        "hsx_model_path": "/data/models/Kimi-K2",
        "hsx_sglang_venv": "/opt/sglang/venv",
        "sglang_server_version": version,
        # What the sglang_info module answers for a pinned sglang_server_version (nothing asked).
        "_sglang_server_version_found": {"release": base_version(version), "min_version": MIN_VERSION,
                                         "check_mode": False, "error": None},
        "ansible_managed": "Ansible managed",
        "_sglang_server_api_key": "0123456789abcdef" * 4,
        **overrides,
    }
    for name, keys in (
        ("Note the SGLang version", ["_sglang_server_release"]),
        ("Build the command line", ["_sglang_server_argv", "_sglang_server_env"]),
    ):
        task_vars, facts = _set_fact(tasks, name)
        templar = Templar(loader=loader, variables={**variables, **task_vars})
        for key in keys:
            variables[key] = templar.template(facts[key])
    templar = Templar(loader=loader, variables=variables)
    unit = templar.template(
        trust_as_template((ROLE / "templates" / "hsx-sglang-server.service.j2").read_text())
    )
    config = templar.template(
        trust_as_template((ROLE / "templates" / "hsx-sglang-server.yaml.j2").read_text())
    )
    (exec_start,) = re.findall(r"(?m)^ExecStart=(.*)$", unit)
    argv = systemd_split(exec_start)
    assert argv == list(variables["_sglang_server_argv"]), (argv, variables["_sglang_server_argv"])
    return argv, unit, config


def systemd_split(line: str) -> list[str]:
    """An ExecStart= command line -> arguments, as systemd splits it (quotes, backslash escapes,
    %% and $$); a specifier or a variable reference fails (the role writes none)."""
    words, word, quote, i, started = [], [], "", 0, False
    escapes = {"\\": "\\", '"': '"', "'": "'", "n": "\n", "t": "\t", "s": " "}
    while i < len(line):
        c = line[i]
        if c == "\\" and i + 1 < len(line):
            assert line[i + 1] in escapes, f"escape \\{line[i + 1]} in {line!r}"
            word.append(escapes[line[i + 1]])
            i, started = i + 2, True
            continue
        if c in "%$":
            assert line[i + 1 : i + 2] == c, f"{c}{line[i + 1 : i + 2]} (a specifier or variable) in {line!r}"
            word.append(c)
            i, started = i + 2, True
            continue
        if quote:
            if c == quote:
                quote = ""
            else:
                word.append(c)
        elif c in "\"'":
            quote, started = c, True
        elif c.isspace():
            if started:
                words.append("".join(word))
            word, started = [], False
        else:
            word.append(c)
            started = True
        i += 1
    assert not quote, f"unbalanced quote in {line!r}"
    if started:
        words.append("".join(word))
    return words


PROGRAM = ["/opt/sglang/venv/bin/python", "-m", "sglang.launch_server"]
# The extra arguments defaults/main.yml offers as its example.
EXAMPLE_EXTRA_ARGS = ["--trust-remote-code", "--mem-fraction-static", "0.85"]


def server_problems(version: str, **overrides: Any) -> list[str]:
    """What `version` would refuse in the command line and --config file the role writes."""
    argv, _unit, config_text = render_server(version, **overrides)
    assert argv[:3] == PROGRAM, argv
    args = argv[3:]
    problems = []
    # prepare_server_args merges the file only when the token "--config" is in argv (not --config=F),
    # and the merger takes the next argument as the file, which must end .yaml or .yml.
    assert args.count("--config") == 1, args
    path = args[args.index("--config") + 1]
    assert Path(path).suffix in (".yaml", ".yml"), path
    config = yaml.safe_load(config_text)
    assert isinstance(config, dict) and config, config_text
    flags = server_flags(version)
    for key in config:
        flag = flags.get(f"--{key}")
        if flag is None or flag.nargs is not VALUE:  # the merger refuses keys of other actions
            problems.append(
                f"config key {key!r}: {'no such flag' if flag is None else 'not a one-value flag'}"
            )
    # ConfigArgumentMerger.merge_config_with_args: the file's arguments first, --config F removed.
    i = args.index("--config")
    merged = config_file_args(config) + args[:i] + args[i + 2 :]
    problems += check_command_line(version, args)  # --config itself, as the parser sees it first
    problems += check_command_line(version, merged)
    return sorted(set(problems))
