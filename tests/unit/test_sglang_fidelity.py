"""Fidelity against the real SGLang releases, without a GPU (issue #29 item 4).

For every release in hsx.sglang_versions.SUPPORTED_VERSIONS (one added there is checked at once):

1. The server command line roles/sglang_server renders parses with THAT release's own server
   arguments: every flag exists and takes a value or not as we pass it (a flag with a value vs
   store_true), a value given for choices is one of them (after the release's type parser, where it
   is a self-contained function), an int flag gets an int. The --config file the role renders (the
   API key: issue #30 item 10) is turned into arguments the way SGLang's ConfigArgumentMerger does
   (`api-key: K` -> `--api-key K`, prepended) and checked the same way.
2. Every ForwardBatch field and ForwardMode member the dump hook reads exists in the release's
   sglang/srt/model_executor/forward_batch_info.py. The names are derived from the hook's own source
   (AST over extraction/sglang/hook.py): a field the hook starts reading is checked at once.
3. The client's side: the release's HTTP server has the routes the client uses (GET /health,
   GET /model_info, POST /generate), /model_info and /generate are behind --api-key, /health is not,
   and the key is an `Authorization: Bearer` token.

A release failing any of these must not be in SUPPORTED_VERSIONS (hsx.sglang_versions.support_problem,
which the sglang_patch role and `hsx patch` consult, then refuses it): this test is what guards the
list. The refused example (UNSUPPORTED_EXAMPLE) is shown to fail (2).

Why by AST: importing sglang.srt.server_args or forward_batch_info needs the release's heavy
dependencies (torch, msgspec, triton, ...), which neither CI nor a control node has. The release
files come from tests/sglang_wheels.py (`pip download --no-deps`, cached; an unreachable registry
FAILS these tests) and are parsed with `ast`:
- the `add_argument(...)` calls of ServerArgs.add_cli_args (0.5.10-0.5.13: all of them);
- 0.5.14+ also the fields SGLang turns into arguments with
  arg_groups/arg_utils.add_cli_args_from_dataclass (`A[T, "help"]` / `A[T, Arg(...)]` fields of
  ServerArgs; 0.5.20+ collected from the namespaces in arg_groups/fields/). Its rules are re-done here
  (_dataclass_flag); the test pins that function's source by digest, so a release that changes it
  fails until the emulation is checked against it.
Names (choices=CONSTANT, Backend.ALL, custom argparse actions, type parsers) are resolved through the
module's imports into the other kept files; what cannot be resolved for a flag we pass fails the
test instead of passing unchecked. A type parser is run (compiled alone, with argparse/json/re only).

The command line is rendered the way Ansible renders it, in-process with Ansible's own Templar
(ansible-core from the venv, ~1 s for every release; ansible-playbook per release would take minutes):
roles/hsx's defaults, the role's defaults and vars, the set_fact expressions of tasks/preflight.yml
("Note the SGLang version", "Build the command line"), then templates/hsx-sglang-server.service.j2,
whose ExecStart line is split back into arguments as systemd splits it, and
templates/hsx-sglang-server.yaml.j2 (the --config file).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import functools
import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from hsx.sglang_versions import SUPPORTED_VERSIONS, UNSUPPORTED_EXAMPLE, support_problem

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sglang_wheels  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "extraction" / "sglang" / "hook.py"
ROLE = ROOT / "roles" / "sglang_server"
SERVER_ARGS = "sglang.srt.server_args"
FORWARD_BATCH_INFO = "sglang.srt.model_executor.forward_batch_info"

# Read by the hook with a default, and optional by design: only releases that reuse one aux buffer
# across passes (0.5.22+) have it, and without it there is nothing to copy. Every other name the hook
# reads is required. (Checked below to be read only with a default.)
OPTIONAL_BATCH_FIELDS = {"aux_hidden_states_buffer"}

# add_cli_args_from_dataclass as _dataclass_flag re-does it: the digest of its source (annotations,
# docstring and 0.5.20's two respellings left out: _function_digest), the same in 0.5.14-0.5.23. A new
# digest: read the release's function, bring _dataclass_flag in line, add the digest.
KNOWN_DATACLASS_CLI = {"03a299ef35b6"}
# The Arg fields _dataclass_flag knows (what the others mean for the command line, if anything).
KNOWN_ARG_FIELDS = {
    "help", "choices", "aliases", "cli_name", "type_parser", "nargs", "required", "action",
    "action_kwargs", "const", "no_cli", "resolvable", "fallback",
}  # fmt: skip


class Unresolved(Exception):
    """A name or value of the release that the AST reading cannot follow."""


# ---------------------------------------------------------------------------- release sources


class Source:
    """The kept files of one release (tests/sglang_wheels.py KEEP_SRC), parsed on demand, with the
    module-level names resolved through `from sglang... import` into the other kept files."""

    def __init__(self, root: Path):
        self.root = root
        self._trees: dict[str, ast.Module | None] = {}

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._trees:
            base = self.root / dotted.replace(".", "/")
            path = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.exists()), None)
            self._trees[dotted] = ast.parse(path.read_text(), str(path)) if path else None
        return self._trees[dotted]

    def lookup(self, dotted: str, name: str, depth: int = 0) -> tuple[str, ast.AST]:
        """(module, node) of what `name` is bound to at the top level of module `dotted`: a class or
        function definition, an assigned value, or (followed) what an import brings in."""
        tree = self.module(dotted)
        if tree is None or depth > 8:
            raise Unresolved(f"{name}: module {dotted} is not kept")
        found: tuple[str, Any] | None = None
        for node in tree.body:  # the last binding wins, as at run time
            if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name == name:
                found = (dotted, node)
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets
            ):
                found = (dotted, node.value)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if node.target.id == name and node.value is not None:
                    found = (dotted, node.value)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        found = ("import", (node.module, alias.name))
        if found is None:
            raise Unresolved(f"{name}: not defined at the top of {dotted}")
        if found[0] == "import":
            module, original = found[1]
            if not module.startswith("sglang."):
                raise Unresolved(f"{name}: imported from {module}")
            return self.lookup(module, original, depth + 1)
        return found

    def literal(self, dotted: str, node: ast.AST, scope: dict[str, ast.AST] | None = None) -> Any:
        """The value of a constant expression: literals, names of module constants, Class.ATTR,
        + of sequences, list()/tuple()/sorted() of one; Unresolved for anything else."""
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.List | ast.Tuple | ast.Set):
            return [self.literal(dotted, e, scope) for e in node.elts]
        if isinstance(node, ast.Name):
            if scope and node.id in scope:
                return self.literal(dotted, scope[node.id], scope)
            module, value = self.lookup(dotted, node.id)
            return self.literal(module, value)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module, cls = self.lookup(dotted, node.value.id)
            if isinstance(cls, ast.ClassDef):
                attrs = class_assigns(cls)
                if node.attr in attrs:
                    return self.literal(module, attrs[node.attr], attrs)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return list(self.literal(dotted, node.left, scope)) + list(
                self.literal(dotted, node.right, scope)
            )
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("list", "tuple", "sorted", "set")
            and len(node.args) == 1
            and not node.keywords
        ):
            return (
                sorted(self.literal(dotted, node.args[0], scope))
                if node.func.id == "sorted"
                else list(self.literal(dotted, node.args[0], scope))
            )
        raise Unresolved(f"{ast.unparse(node)} (in {dotted})")


@functools.cache
def release_source(version: str) -> Source:
    """The kept files of `version` (fetched once, parsed once per session)."""
    return Source(sglang_wheels.release_src(version))


def class_assigns(cls: ast.ClassDef) -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = {}
    for stmt in cls.body:
        if isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = stmt.value
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            out[stmt.target.id] = stmt.value
    return out


def find_class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"class {name} not found")


def find_function(body: list[ast.stmt], name: str) -> ast.FunctionDef:
    for node in body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"function {name} not found")


def dotted_name(node: ast.AST) -> str:
    return ast.unparse(node) if isinstance(node, ast.Name | ast.Attribute) else ""


# ---------------------------------------------------------------------------- server arguments

VALUE = None  # Flag.nargs of a flag that takes exactly one value (argparse's nargs=None)
ZERO_ARG_ACTIONS = {"store_true", "store_false", "store_const", "count", "append_const", "help", "version"}
ZERO_ARG_BASES = {f"argparse.{n}" for n in ("_StoreTrueAction", "_StoreFalseAction", "_StoreConstAction",
                                             "_CountAction", "_AppendConstAction", "BooleanOptionalAction")}  # fmt: skip


@dataclass
class Flag:
    """What argparse does with one option, as far as the command line is concerned."""

    names: list[str]
    nargs: Any = VALUE  # 0: takes no value; VALUE: one; "?", "*", "+" or an int as in argparse
    choices: list | None = None
    type: tuple[str, ast.AST] | str | None = None  # "int", "float", "str" or (module, node) of a function
    unsure: str = ""  # why this flag could not be read (only an error when we pass it)
    origin: str = ""


def _action_nargs(src: Source, module: str, action: ast.AST, explicit: Any) -> tuple[Any, bool]:
    """(nargs, adds --no-X) of a custom argparse action class; `explicit` = the call's nargs (or ...)."""
    name = dotted_name(action)
    if name in ("argparse.BooleanOptionalAction", "BooleanOptionalAction"):
        return 0, True
    if name in ZERO_ARG_BASES:
        return 0, False
    if name.startswith("argparse."):
        return (VALUE if explicit is ... else explicit), False
    mod, cls = src.lookup(module, name)
    if not isinstance(cls, ast.ClassDef):
        raise Unresolved(f"action {name} is not a class")
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if explicit is not ...:
        return explicit, False
    if init is not None:
        args = init.args
        params = args.posonlyargs + args.args
        defaults = dict(
            zip([a.arg for a in params][len(params) - len(args.defaults) :], args.defaults, strict=True)
        )
        defaults.update(
            {a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None}
        )
        if "nargs" in defaults:
            return src.literal(mod, defaults["nargs"]), False
    for base in cls.bases:  # no nargs of its own: what its base does
        if dotted_name(base) in ZERO_ARG_BASES:
            return 0, dotted_name(base).endswith("BooleanOptionalAction")
        if dotted_name(base) not in ("argparse.Action", "Action"):
            return _action_nargs(src, mod, base, explicit)
    return VALUE, False


def _type_of(src: Source, module: str, node: ast.AST | None) -> tuple[str, ast.AST] | str | None:
    name = dotted_name(node) if node is not None else ""
    if node is None or name == "str":
        return None
    if name in ("int", "float"):
        return name
    return (module, node)


def flags_of_add_argument(src: Source, module: str, call: ast.Call) -> Flag:
    names = [src.literal(module, a) for a in call.args]
    kw = {k.arg: k.value for k in call.keywords if k.arg}
    flag = Flag(names=names, origin=f"add_argument in {module}")
    explicit = src.literal(module, kw["nargs"]) if "nargs" in kw else ...
    action = kw.get("action")
    try:
        if action is None or (
            isinstance(action, ast.Constant) and action.value in ("store", "append", "extend")
        ):
            flag.nargs = VALUE if explicit is ... else explicit
        elif isinstance(action, ast.Constant):
            flag.nargs = 0 if action.value in ZERO_ARG_ACTIONS else flag.nargs
            if action.value not in ZERO_ARG_ACTIONS:
                flag.unsure = f"action {action.value!r} not known to this test"
        else:
            flag.nargs, negated = _action_nargs(src, module, action, explicit)
            if negated:
                flag.names += ["--no-" + n[2:] for n in names if n.startswith("--")]
    except Unresolved as exc:
        flag.unsure = f"its action: {exc}"
    if "choices" in kw:
        try:
            flag.choices = list(src.literal(module, kw["choices"]))
        except Unresolved as exc:
            flag.unsure = flag.unsure or f"its choices: {exc}"
    flag.type = _type_of(src, module, kw.get("type"))
    return flag


def _unwrap_optional(node: ast.AST) -> ast.AST:
    if isinstance(node, ast.Subscript) and dotted_name(node.value) in ("Optional", "typing.Optional"):
        return node.slice
    if isinstance(node, ast.Subscript) and dotted_name(node.value) in ("Union", "typing.Union"):
        parts = [e for e in getattr(node.slice, "elts", [node.slice]) if ast.unparse(e) != "None"]
        return parts[0] if len(parts) == 1 else node
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        parts = [p for p in (node.left, node.right) if ast.unparse(p) != "None"]
        return parts[0] if len(parts) == 1 else node
    return node


def _dataclass_flag(
    src: Source, module: str, name: str, annotation: ast.AST, arg_fields: list[str]
) -> Flag | None:
    """What add_cli_args_from_dataclass registers for one field (None: no argument), re-done on the
    AST: `A[T, "help"]` / `A[T, Arg(...)]`; Arg's action, else Literal -> choices, List -> nargs '+',
    bool -> store_true, anything else one value (type_parser or the type)."""
    if not (
        isinstance(annotation, ast.Subscript)
        and dotted_name(annotation.value) in ("A", "Annotated", "typing.Annotated")
    ):
        return None
    parts = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
    meta: dict[str, ast.AST] | None = None
    for part in parts[1:]:  # the first Arg or str, as _unwrap_annotated takes it
        if isinstance(part, ast.Call) and dotted_name(part.func) == "Arg":
            meta = dict(zip(arg_fields, part.args, strict=False))
            meta.update({k.arg: k.value for k in part.keywords if k.arg})
            break
        if isinstance(part, ast.Constant) and isinstance(part.value, str):
            meta = {}
            break
        if isinstance(part, ast.Name):
            try:
                if isinstance(src.literal(module, part), str):
                    meta = {}
                    break
            except Unresolved:
                pass
    if meta is None:
        return None

    def value(key: str) -> Any:
        node = meta.get(key)
        return None if node is None else src.literal(module, node)

    if value("no_cli"):
        return None
    cli_name = value("cli_name") or "--" + name.replace("_", "-")
    flag = Flag(names=[cli_name, *(value("aliases") or [])], origin=f"field {name} in {module}")
    if meta.get("action") is not None and ast.unparse(meta["action"]) != "None":
        action_kwargs = value("action_kwargs") or {}
        explicit = action_kwargs.get("nargs", ...) if isinstance(action_kwargs, dict) else ...
        try:
            if isinstance(meta["action"], ast.Constant):
                flag.nargs = (
                    0
                    if meta["action"].value in ZERO_ARG_ACTIONS
                    else (VALUE if explicit is ... else explicit)
                )
            else:
                flag.nargs, negated = _action_nargs(src, module, meta["action"], explicit)
                if negated:
                    flag.names += ["--no-" + n[2:] for n in flag.names if n.startswith("--")]
        except Unresolved as exc:
            flag.unsure = f"its action: {exc}"
        return flag
    inner = _unwrap_optional(parts[0])
    for _ in range(4):  # a module-level alias of a type: what it names
        if isinstance(inner, ast.Name) and inner.id not in ("str", "int", "float", "bool"):
            try:
                mod, target = src.lookup(module, inner.id)
            except Unresolved:
                break
            if isinstance(target, ast.ClassDef | ast.FunctionDef):
                break
            module, inner = mod, _unwrap_optional(target)
        else:
            break
    type_parser = meta.get("type_parser")
    try:
        meta_choices = value("choices")
    except Unresolved as exc:
        meta_choices, flag.unsure = None, f"its choices: {exc}"
    if isinstance(inner, ast.Subscript) and dotted_name(inner.value) in ("Literal", "typing.Literal"):
        literal_values = [src.literal(module, e) for e in getattr(inner.slice, "elts", [inner.slice])]
        flag.choices = list(meta_choices) if meta_choices else literal_values
        first = type(literal_values[0]).__name__ if literal_values else "str"
        flag.type = (
            _type_of(src, module, type_parser)
            if type_parser is not None
            else (first if first in ("int", "float") else None)
        )
        return flag
    is_list = isinstance(inner, ast.Subscript) and dotted_name(inner.value) in ("List", "list", "typing.List")
    if is_list and type_parser is None:
        flag.nargs = value("nargs") or "+"
        flag.choices = list(meta_choices) if meta_choices else None
        elem = dotted_name(inner.slice)
        flag.type = elem if elem in ("int", "float") else None
        return flag
    if dotted_name(inner) == "bool":
        flag.nargs = 0
        return flag
    flag.nargs = value("nargs") or VALUE
    flag.choices = list(meta_choices) if meta_choices else None
    if type_parser is not None:
        flag.type = _type_of(src, module, type_parser)
    elif dotted_name(inner) in ("str", "int", "float"):
        flag.type = _type_of(src, module, inner)
    elif not isinstance(inner, ast.Name):
        flag.unsure = f"type {ast.unparse(inner)} not known to this test"
    return flag


def _class_fields(src: Source, module: str, cls: ast.ClassDef) -> list[tuple[str, str, ast.AST]]:
    """(module, name, annotation) of a class's annotated fields, its kept bases' first."""
    out: list[tuple[str, str, ast.AST]] = []
    for base in cls.bases:
        if dotted_name(base) in ("msgspec.Struct", "object", "Struct"):
            continue
        try:
            mod, node = src.lookup(module, dotted_name(base))
        except Unresolved as exc:
            raise AssertionError(f"base {dotted_name(base)} of {cls.name}: {exc}") from None
        out += _class_fields(src, mod, node)
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            out.append((module, stmt.target.id, stmt.annotation))
    return out


def _function_digest(fn: ast.FunctionDef) -> str:
    """A function's source without annotations and docstring: what the rules are, not their spelling."""
    fn = ast.parse(ast.unparse(fn)).body[0]
    for node in ast.walk(fn):
        if isinstance(node, ast.arg):
            node.annotation = None
        if isinstance(node, ast.FunctionDef):
            node.returns = None
            if (
                node.body
                and isinstance(node.body[0], ast.Expr)
                and isinstance(node.body[0].value, ast.Constant)
            ):
                node.body = node.body[1:] or [ast.Pass()]
    text = ast.unparse(fn)
    # 0.5.20 reads fields with record_fields() (dataclass or msgspec Struct) and drops typing.List: same rules.
    text = text.replace("dataclasses.fields(cls)", "record_fields(cls)")
    text = text.replace("(origin is list or origin is List)", "origin is list")
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def dataclass_flags(src: Source, call: ast.Call) -> list[Flag]:
    """The flags of `add_cli_args_from_dataclass(parser, ServerArgs[, fields=...])`."""
    utils = "sglang.srt.arg_groups.arg_utils"
    tree = src.module(utils)
    assert tree is not None, "add_cli_args_from_dataclass is called, but arg_groups/arg_utils.py is not kept"
    digest = _function_digest(find_function(tree.body, "add_cli_args_from_dataclass"))
    assert digest in KNOWN_DATACLASS_CLI, (
        f"arg_utils.add_cli_args_from_dataclass changed (digest {digest}): check _dataclass_flag against "
        "it, then add the digest to KNOWN_DATACLASS_CLI"
    )
    arg_fields = [
        s.target.id
        for s in find_class(tree, "Arg").body
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
    ]
    assert set(arg_fields) <= KNOWN_ARG_FIELDS, (
        f"Arg has fields this test does not know: {set(arg_fields) - KNOWN_ARG_FIELDS}"
    )
    target = dotted_name(call.args[1])
    server_args = src.module(SERVER_ARGS)
    assert target == "ServerArgs", f"add_cli_args_from_dataclass(parser, {target}): only ServerArgs is known"
    fields_: list[tuple[str, str, ast.AST]] = []
    for node in server_args.body:  # 0.5.20+: the namespaces collect_input_fields() assembles
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            if dotted_name(node.value.func) == "collect_input_fields":
                names = node.value.args[0]
                if isinstance(names, ast.Name):
                    names = src.lookup(SERVER_ARGS, names.id)[1]
                for ns in names.elts:
                    mod, cls = src.lookup(SERVER_ARGS, dotted_name(ns))
                    fields_ += _class_fields(src, mod, cls)
    fields_ += _class_fields(src, SERVER_ARGS, find_class(server_args, "ServerArgs"))
    only = {k.arg: k.value for k in call.keywords}.get("fields")
    wanted = set(src.literal(SERVER_ARGS, only)) if only is not None else None
    flags = []
    for module, name, annotation in fields_:
        if wanted is not None and name not in wanted:
            continue
        try:
            flag = _dataclass_flag(src, module, name, annotation, arg_fields)
        except Unresolved as exc:
            flag = Flag(
                names=["--" + name.replace("_", "-")], unsure=str(exc), origin=f"field {name} in {module}"
            )
        if flag is not None:
            flags.append(flag)
    return flags


def _mentions_parser(call: ast.Call) -> bool:
    values = [*call.args, *(k.value for k in call.keywords)]
    return any(isinstance(v, ast.Name) and v.id == "parser" for v in values)


@functools.cache
def server_flags(version: str) -> dict[str, Flag]:
    """Option string -> Flag: what `python -m sglang.launch_server` of `version` accepts
    (prepare_server_args: ServerArgs.add_cli_args(parser), then parse_args)."""
    src = release_source(version)
    tree = src.module(SERVER_ARGS)
    assert tree is not None, f"{version}: sglang/srt/server_args.py not in the wheel"
    prepare = ast.unparse(find_function(tree.body, "prepare_server_args"))
    assert "ServerArgs.add_cli_args(parser)" in prepare and ".parse_args(argv)" in prepare, prepare
    add_cli_args = find_function(find_class(tree, "ServerArgs").body, "add_cli_args")
    flags: list[Flag] = [
        flags_of_add_argument(src, SERVER_ARGS, node)
        for node in ast.walk(find_function(tree.body, "prepare_server_args"))
        if isinstance(node, ast.Call) and dotted_name(node.func).endswith(".add_argument")
    ]
    for node in ast.walk(add_cli_args):
        if not isinstance(node, ast.Call):
            continue
        callee = dotted_name(node.func)
        if callee.endswith(".add_argument"):
            flags.append(flags_of_add_argument(src, SERVER_ARGS, node))
        elif callee == "add_cli_args_from_dataclass":
            flags += dataclass_flags(src, node)
        elif _mentions_parser(node) and not callee.startswith("parser."):
            raise AssertionError(
                f"{version}: add_cli_args passes the parser to {callee}(), unknown to this test"
            )
    table: dict[str, Flag] = {}
    for flag in flags:
        for name in flag.names:
            table.setdefault(name, flag)  # argparse refuses a second definition; the first is kept
    return table


def _run_type_parser(src: Source, where: tuple[str, ast.AST], value: str) -> Any:
    """Run a release's argparse type function on `value`, compiled alone (argparse, json, re)."""
    module, node = where
    mod, fn = (
        src.lookup(module, dotted_name(node))
        if isinstance(node, ast.Name | ast.Attribute)
        else (module, node)
    )
    if not isinstance(fn, ast.FunctionDef):
        raise Unresolved(f"type {ast.unparse(node)} is not a function")
    scope: dict[str, Any] = {"argparse": argparse, "json": json, "re": re, "__builtins__": builtins}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), f"<{mod}.{fn.name}>", "exec"), scope)  # noqa: S102
    try:
        return scope[fn.name](value)
    except NameError as exc:
        raise Unresolved(f"type {fn.name} needs more than itself: {exc}") from None


def check_command_line(version: str, argv: list[str]) -> list[str]:
    """What `version`'s parser would refuse in argv (the arguments after the program): problems."""
    flags = server_flags(version)
    src = release_source(version)
    problems: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--"):
            problems.append(f"{token!r}: a value without a flag")
            continue
        name, eq, inline = token.partition("=")
        flag = flags.get(name)
        if flag is None:
            problems.append(f"{name}: no such flag")
            continue
        if flag.unsure:
            problems.append(f"{name}: cannot be checked ({flag.origin}: {flag.unsure})")
            continue
        if flag.nargs == 0:
            if eq:
                problems.append(f"{name} takes no value, given {inline!r}")
            continue
        if eq:
            values = [inline]
        else:
            most = {VALUE: 1, "?": 1}.get(
                flag.nargs, flag.nargs if isinstance(flag.nargs, int) else len(argv)
            )
            values = []
            while i < len(argv) and len(values) < most and not argv[i].startswith("--"):
                values.append(argv[i])
                i += 1
            least = {VALUE: 1, "+": 1}.get(flag.nargs, flag.nargs if isinstance(flag.nargs, int) else 0)
            if len(values) < least:
                problems.append(f"{name} needs {least} value(s), given {values}")
                continue
        for value in values:
            try:
                if flag.type in ("int", "float"):
                    converted = {"int": int, "float": float}[flag.type](value)
                elif isinstance(flag.type, tuple):
                    converted = _run_type_parser(src, flag.type, value)
                else:
                    converted = value
            except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
                problems.append(f"{name} {value!r}: refused by its type ({exc})")
                continue
            except Unresolved as exc:
                problems.append(f"{name} {value!r}: cannot be checked ({exc})")
                continue
            if flag.choices is not None and converted not in flag.choices:
                problems.append(f"{name} {value!r}: not one of {flag.choices}")
    return problems


def config_file_args(config: dict[str, Any]) -> list[str]:
    """ConfigArgumentMerger._convert_config_to_args (0.5.10-0.5.23): YAML keys -> arguments."""
    args: list[str] = []
    for key, value in config.items():
        if isinstance(value, bool):
            args += [f"--{key}"] if value else []  # store_true flags; the role writes none
        elif isinstance(value, list):
            args += [f"--{key}", *map(str, value)] if value else []
        elif isinstance(value, dict):
            args += [f"--{key}", json.dumps(value)]
        else:
            args += [f"--{key}", str(value)]
    return args


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


# ---------------------------------------------------------------------------- the hook's reads


@functools.cache
def hook_reads(path: Path = HOOK) -> tuple[frozenset[str], frozenset[str], tuple[str, ...]]:
    """(ForwardBatch fields the hook reads as forward_batch.X, fields it reads with
    getattr(forward_batch, "X", default), the ForwardMode names it compares forward_mode.name to),
    all from the hook's source."""
    tree = ast.parse(path.read_text(), str(path))
    direct, defaulted = set(), set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign | ast.AnnAssign | ast.NamedExpr)
            and dotted_name(node.value or ast.Pass()) == "forward_batch"
        ):
            raise AssertionError("the hook aliases forward_batch: its reads would escape this test")
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "forward_batch"
        ):
            direct.add(node.attr)
        if isinstance(node, ast.Call) and dotted_name(node.func) in ("getattr", "hasattr"):
            if node.args and dotted_name(node.args[0]) == "forward_batch":
                assert isinstance(node.args[1], ast.Constant), ast.unparse(node)
                optional = len(node.args) > 2 or dotted_name(node.func) == "hasattr"
                (defaulted if optional else direct).add(node.args[1].value)
    assert {"forward_mode", "input_ids"} <= direct, direct  # the derivation still sees the hook's reads
    modes = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and [dotted_name(t) for t in node.targets] == ["PREFILL_MODES"]:
            modes = tuple(ast.literal_eval(node.value))
    assert modes, "hook.PREFILL_MODES not found"
    dumps_on = ast.unparse(find_function(find_class(tree, "DumpHook").body, "_should_dump"))
    assert "forward_batch.forward_mode" in dumps_on and "not in PREFILL_MODES" in dumps_on, dumps_on
    return frozenset(direct), frozenset(defaulted), modes


def _class_names(tree: ast.Module, cls: ast.ClassDef) -> set[str]:
    """Fields, class attributes, properties and methods of a class and its bases in the same file."""
    names: set[str] = set()
    for base in cls.bases:
        local = next(
            (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == dotted_name(base)), None
        )
        if local is not None:
            names |= _class_names(tree, local)
    names |= set(class_assigns(cls))
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
        elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(stmt.name)
    return names


def batch_problems(version: str, hook: Path = HOOK) -> list[str]:
    """ForwardBatch fields and ForwardMode members the hook reads that `version` lacks."""
    tree = release_source(version).module(FORWARD_BATCH_INFO)
    assert tree is not None, f"{version}: forward_batch_info.py not in the wheel"
    direct, defaulted, modes = hook_reads(hook)
    fields_ = _class_names(tree, find_class(tree, "ForwardBatch"))
    mode_cls = find_class(tree, "ForwardMode")
    members = {n for n in class_assigns(mode_cls) if n.isupper()}
    problems = [
        f"ForwardBatch.{n} missing" for n in sorted((direct | defaulted) - OPTIONAL_BATCH_FIELDS - fields_)
    ]
    problems += [f"ForwardMode.{m} missing" for m in modes if m not in members]
    return problems


# ---------------------------------------------------------------------------- HTTP server and auth


def http_problems(version: str) -> list[str]:
    """What the client assumes of the release's HTTP server that it does not hold."""
    src = release_source(version)
    server = src.module("sglang.srt.entrypoints.http_server")
    auth = src.module("sglang.srt.utils.auth")
    assert server is not None and auth is not None, f"{version}: http_server.py or utils/auth.py not kept"
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
                routes[(method, d.args[0].value)] = decorators
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
    return problems


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_server_command_line_parses_with_the_release(version):
    assert support_problem(version) is None
    assert server_problems(version) == [], f"SGLang {version} would refuse the unit's command line"
    assert server_problems(version, sglang_server_extra_args=EXAMPLE_EXTRA_ARGS) == []


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_hook_reads_exist_in_the_release(version):
    assert batch_problems(version) == [], f"the dump hook reads what SGLang {version}'s ForwardBatch lacks"


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_client_routes_and_auth_in_the_release(version):
    assert http_problems(version) == []


def test_the_refused_example_fails_and_is_refused():
    """0.5.4 lacks ForwardBatch.rids and --disable-piecewise-cuda-graph (so does 0.5.9, the release
    before the floor): both checks fail, and the version check refuses it."""
    assert batch_problems(UNSUPPORTED_EXAMPLE) == ["ForwardBatch.rids missing"]
    assert server_problems(UNSUPPORTED_EXAMPLE) == ["--disable-piecewise-cuda-graph: no such flag"]
    assert support_problem(UNSUPPORTED_EXAMPLE) is not None


def test_optional_batch_fields_are_read_only_with_a_default():
    direct, defaulted, _modes = hook_reads()
    assert OPTIONAL_BATCH_FIELDS <= defaulted - direct, (
        "the hook reads a field of OPTIONAL_BATCH_FIELDS as forward_batch.X: it is required, drop it from the list"
    )


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


def test_a_field_the_hook_starts_reading_is_checked(tmp_path):
    """The list is the hook's source: a read added to it (as forward_batch.X or with getattr, or a
    ForwardMode name added to PREFILL_MODES) is looked for in every release."""
    source = HOOK.read_text()
    assert source.count('PREFILL_MODES = ("EXTEND", "MIXED")') == 1
    changed = source.replace(
        'PREFILL_MODES = ("EXTEND", "MIXED")', 'PREFILL_MODES = ("EXTEND", "MIXED", "HSX_NO_SUCH_MODE")'
    )
    changed += "\n\ndef _probe(forward_batch):\n    return forward_batch.hsx_no_such_field, getattr(forward_batch, 'hsx_other', None)\n"
    hook = tmp_path / "hook.py"
    hook.write_text(changed)
    assert batch_problems(SUPPORTED_VERSIONS[-1], hook) == [
        "ForwardBatch.hsx_no_such_field missing",
        "ForwardBatch.hsx_other missing",
        "ForwardMode.HSX_NO_SUCH_MODE missing",
    ]
