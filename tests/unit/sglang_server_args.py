"""The server's command line checked against a release's own arguments, and roles/sglang_server
rendered (for test_sglang_fidelity.py; the reasons and the rules: its docstring).

- the `add_argument(...)` calls of ServerArgs.add_cli_args (0.5.10-0.5.13: all of them);
- 0.5.14+ also the fields SGLang turns into arguments with
  arg_groups/arg_utils.add_cli_args_from_dataclass (`A[T, "help"]` / `A[T, Arg(...)]` fields of
  ServerArgs; 0.5.20+ collected from the namespaces in arg_groups/fields/). Its rules are re-done here
  (_dataclass_flag); the test pins that function's source by digest, so a release that changes it
  fails until the emulation is checked against it.
Names (choices=CONSTANT, Backend.ALL, custom argparse actions, type parsers) are resolved through the
module's imports into the other kept files; what cannot be resolved for a flag we pass fails the
test instead of passing unchecked. A type parser is run (compiled alone, with argparse/json/re only).
The command line is rendered the way Ansible renders it, in-process with Ansible's own Templar.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_release_ast import (
    ROOT,
    Source,
    Unresolved,
    dotted_name,
    find_class,
    find_function,
    release_source,
)

ROLE = ROOT / "roles" / "sglang_server"
SERVER_ARGS = "sglang.srt.server_args"
# add_cli_args_from_dataclass as _dataclass_flag re-does it: the digest of its source (annotations,
# docstring and 0.5.20's two respellings left out: _function_digest), the same in 0.5.14-0.5.23. A new
# digest: read the release's function, bring _dataclass_flag in line, add the digest.
KNOWN_DATACLASS_CLI = {"03a299ef35b6"}
# The Arg fields _dataclass_flag knows (what the others mean for the command line, if anything).
KNOWN_ARG_FIELDS = {
    "help", "choices", "aliases", "cli_name", "type_parser", "nargs", "required", "action",
    "action_kwargs", "const", "no_cli", "resolvable", "fallback",
}  # fmt: skip



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
