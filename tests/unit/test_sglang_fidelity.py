"""Fidelity against the real SGLang releases, without a GPU (issue #29 item 4).

For every release in hsx.sglang_versions.SUPPORTED_VERSIONS (one added there is checked at once):

1. The server command line roles/sglang_server renders parses with THAT release's own server
   arguments: every flag exists and takes a value or not as we pass it (a flag with a value vs
   store_true), a value given for choices is one of them (after the release's type parser, where it
   is a self-contained function), an int flag gets an int. The --config file the role renders (the
   API key: issue #30 item 10) is turned into arguments the way SGLang's ConfigArgumentMerger does
3. The client's side: the release's HTTP server has the routes the client uses (GET /health,
   GET /model_info, POST /generate), /model_info and /generate are behind --api-key, /health is not,
   and the key is an `Authorization: Bearer` token; GET /server_info (the radix-cache preflight,
   behind the key) spreads the server arguments, disable_radix_cache among them, at the top level.

A release failing any of these must not be in SUPPORTED_VERSIONS (hsx.sglang_versions.support_problem,
which the sglang_patch role and `hsx patch` consult, then refuses it): this test is what guards the
list. The refused example (UNSUPPORTED_EXAMPLE) is shown to fail (2).


Why by AST: importing sglang.srt.server_args or forward_batch_info needs the release's heavy
dependencies (torch, msgspec, triton, ...), which neither CI nor a control node has. The release
files come from tests/sglang_wheels.py (`pip download --no-deps`, cached; an unreachable registry
FAILS these tests) and are parsed with `ast` (what is read, and how: tests/unit/sglang_server_args.py).

The command line is rendered the way Ansible renders it, in-process with Ansible's own Templar
(ansible-core from the venv, ~1 s for every release; ansible-playbook per release would take minutes):
roles/hsx's defaults, the role's defaults and vars, the set_fact expressions of tasks/preflight.yml
("Note the SGLang version", "Build the command line"), then templates/hsx-sglang-server.service.j2,
whose ExecStart line is split back into arguments as systemd splits it, and
templates/hsx-sglang-server.yaml.j2 (the --config file).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
import yaml

from hsx.sglang_versions import SUPPORTED_VERSIONS, support_problem

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_release_ast import dotted_name, find_class, find_function, release_source
from sglang_server_args import check_command_line, server_flags
from sglang_server_role import EXAMPLE_EXTRA_ARGS, render_server, server_problems

# ---------------------------------------------------------------------------- HTTP server and auth


def _routes(server: ast.Module) -> dict[tuple[str, str], list[str]]:
    """(method, path) -> the decorators of the function the release's FastAPI app routes it to."""
    routes: dict[tuple[str, str], list[str]] = {}
    for node in server.body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        decorators = [ast.unparse(d) for d in node.decorator_list]
        for d in node.decorator_list:
            if not (
                isinstance(d, ast.Call)
                and isinstance(d.func, ast.Attribute)
                and dotted_name(d.func.value) == "app"
            ):
                continue
            if not (d.args and isinstance(d.args[0], ast.Constant)):
                continue
            kw = {k.arg: k.value for k in d.keywords}
            methods = (
                [d.func.attr.upper()]
                if d.func.attr in ("get", "post", "put")
                else ast.literal_eval(kw["methods"])
                if "methods" in kw
                else ["GET"]
            )
            for method in methods:
                routes[(method, d.args[0].value)] = decorators + [ast.unparse(node)]
    return routes


def http_problems(version: str) -> list[str]:
    """What the client assumes of the release's HTTP server that it does not hold."""
    src = release_source(version)
    server = src.module("sglang.srt.entrypoints.http_server")
    auth = src.module("sglang.srt.utils.auth")
    assert server is not None and auth is not None, f"{version}: http_server.py or utils/auth.py not kept"
    routes = _routes(server)
    problems = []
    for route in (("GET", "/health"), ("GET", "/model_info"), ("POST", "/generate")):
        if route not in routes:
            problems.append(f"no route {route[0]} {route[1]}")
        elif route[1] != "/health" and any(d.startswith("auth_level(") for d in routes[route]):
            problems.append(f"{route[1]} has an auth level other than NORMAL (what --api-key protects)")
    decide = ast.unparse(find_function(auth.body, "decide_request_auth"))
    if "path.startswith('/health')" not in decide:
        problems.append("/health is not exempt from the API key (the client's health wait would need it)")
    if (
        "parts[0].lower() != 'bearer'" not in decide
        or "secrets.compare_digest(parts[1], expected_token)" not in decide
    ):
        problems.append("the key is not an 'Authorization: Bearer <key>' token")
    return problems + server_info_problems(version, routes)


# The forms in which a release's GET /server_info spreads its server arguments (`{**form, ...}`) at
# the top level of the JSON object, read in each release: dataclasses.asdict of the ServerArgs
# dataclass (0.5.10-0.5.18; 0.5.17 passes it through tokenizer_manager.resolved_config_dict, which
# copies it and updates values: tokenizer_manager.py, not kept), server_args.resolved_dict()
# (0.5.19-0.5.21), build_server_info(server_args, ...) (0.5.22, 0.5.23: utils/common.py, not kept,
# returns server_args.resolved_dict() with more keys). resolved_dict is {name: value} over the
# record's fields (record_fields), the arg groups' included. Regexes over the spread's source.
SERVER_INFO_FORMS = {
    r"(\w+\.)*resolved_config_dict\(dataclasses\.asdict\((\w+\.)*server_args\)\)": "class field",
    r"dataclasses\.asdict\((\w+\.)*server_args\)": "class field",
    r"server_args\.resolved_dict\(\)": "record field",
    r"build_server_info\(server_args, .*\)": "record field",
}


def _spreads(route_source: str) -> list[str]:
    """The source of each `**x` in a dict display of the route's function."""
    return [
        ast.unparse(d.values[i])
        for d in ast.walk(ast.parse(route_source))
        if isinstance(d, ast.Dict)
        for i, key in enumerate(d.keys)
        if key is None
    ]


def server_info_problems(version: str, routes: dict[tuple[str, str], list[str]]) -> list[str]:
    """The client's radix-cache preflight (SGLangBackend.check_radix_cache) reads GET /server_info,
    with the key, for `disable_radix_cache` at the top level: the route must be there at NORMAL auth
    level, spread the server arguments in a known form, and the arguments must have that field."""
    route = routes.get(("GET", "/server_info"))
    if route is None:
        return ["no route GET /server_info (the client's radix-cache preflight)"]
    problems = []
    if any(d.startswith("auth_level(") for d in route[:-1]):
        problems.append("/server_info has an auth level other than NORMAL (what --api-key protects)")
    spreads = _spreads(route[-1])
    forms = [kind for x in spreads for form, kind in SERVER_INFO_FORMS.items() if re.fullmatch(form, x)]
    if not forms:
        return problems + [f"/server_info spreads its server arguments in no known form: {spreads}"]
    src = release_source(version)
    server_args = src.module("sglang.srt.server_args")
    assert server_args is not None, f"{version}: server_args.py not kept"
    if forms[0] == "class field":  # asdict: the dataclass's own fields
        cls = find_class(server_args, "ServerArgs")
        have = {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    else:  # resolved_dict: every field of the record, the arg groups' too (what the flags are made of)
        flag = server_flags(version).get("--disable-radix-cache")
        have = {flag.origin.split()[1]} if flag and flag.origin.startswith("field ") else set()
        methods = {f.name for f in find_class(server_args, "ServerArgs").body if isinstance(f, ast.FunctionDef)}
        if "resolved_dict" not in methods:
            problems.append("ServerArgs has no resolved_dict()")
    if "disable_radix_cache" not in have:
        problems.append(f"/server_info ({forms[0]}s) carries no disable_radix_cache")
    return problems



# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_server_command_line_parses_with_the_release(version):
    assert support_problem(version) is None
    assert server_problems(version) == [], f"SGLang {version} would refuse the unit's command line"
    assert server_problems(version, sglang_server_extra_args=EXAMPLE_EXTRA_ARGS) == []



@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_client_routes_and_auth_in_the_release(version):
    assert http_problems(version) == []



def test_the_checks_find_what_is_wrong():
    """The checker itself: a flag a release lacks, a value outside the choices, a value given to a
    store_true flag, a missing value, a wrong type; the prefill flag of the other era."""
    newest, oldest = SUPPORTED_VERSIONS[-1], SUPPORTED_VERSIONS[0]
    assert check_command_line(newest, ["--port", "30000", "--disable-radix-cache"]) == []
    assert check_command_line(newest, ["--no-such-flag"]) == ["--no-such-flag: no such flag"]
    assert check_command_line(newest, ["--cuda-graph-backend-prefill", "sometimes"]) == [
        "--cuda-graph-backend-prefill 'sometimes': not one of ['full', 'breakable', 'disabled']"
    ]
    assert check_command_line(newest, ["--cuda-graph-backend-prefill", "tc_piecewise"])[0].startswith(
        "--cuda-graph-backend-prefill 'tc_piecewise': refused by its type (tc_piecewise was removed"
    )
    assert check_command_line(newest, ["--disable-radix-cache=yes"]) == [
        "--disable-radix-cache takes no value, given 'yes'"
    ]
    assert check_command_line(newest, ["--port", "--disable-radix-cache"]) == [
        "--port needs 1 value(s), given []"
    ]
    assert check_command_line(newest, ["--port", "http"]) == [
        "--port 'http': refused by its type (invalid literal for int() with base 10: 'http')"
    ]
    assert check_command_line(oldest, ["--cuda-graph-backend-prefill", "disabled"]) == [
        "--cuda-graph-backend-prefill: no such flag",
        "'disabled': a value without a flag",
    ]
    assert check_command_line(newest, ["--disable-piecewise-cuda-graph"]) == [
        "--disable-piecewise-cuda-graph: no such flag"
    ]
    # The role picks the right one for each era.
    assert "--disable-piecewise-cuda-graph" in render_server(oldest)[0]
    assert "--cuda-graph-backend-prefill" in render_server(newest)[0]


def test_api_key_reaches_the_server_through_the_config_file_only():
    """The key is read from a 0600 --config file, never on the command line (any local user can read a
    process's arguments in /proc); SGLang reads no environment variable for it."""
    key = "f" * 64
    argv, unit, config = render_server(SUPPORTED_VERSIONS[-1], _sglang_server_api_key=key)
    assert key not in unit and key not in " ".join(argv)
    assert yaml.safe_load(config) == {"api-key": key}
    assert "--api-key" not in argv


def test_the_server_info_check_finds_what_is_wrong():
    """server_info_problems itself: a release without the route (the refused 0.5.4 has only
    /get_server_info), a route behind another auth level spreading nothing known, and a known form
    whose arguments lack the field (0.5.23's route read as if it spread the ServerArgs dataclass,
    whose fields moved to the arg groups)."""
    from hsx.sglang_versions import UNSUPPORTED_EXAMPLE

    old = release_source(UNSUPPORTED_EXAMPLE).module("sglang.srt.entrypoints.http_server")
    assert server_info_problems(UNSUPPORTED_EXAMPLE, _routes(old)) == [
        "no route GET /server_info (the client's radix-cache preflight)"
    ]
    odd = ast.parse(
        '@app.get("/server_info")\n@auth_level(AuthLevel.ADMIN_OPTIONAL)\n'
        "async def server_info():\n    return {**vars(args)}\n"
    )
    problems = server_info_problems(SUPPORTED_VERSIONS[-1], _routes(odd))
    assert problems[0] == "/server_info has an auth level other than NORMAL (what --api-key protects)"
    assert problems[1] == "/server_info spreads its server arguments in no known form: ['vars(args)']"
    moved = ast.parse(
        '@app.get("/server_info")\nasync def server_info():\n'
        "    return {**dataclasses.asdict(_global_state.tokenizer_manager.server_args)}\n"
    )
    assert server_info_problems(SUPPORTED_VERSIONS[-1], _routes(moved)) == [
        "/server_info (class fields) carries no disable_radix_cache"
    ]
