"""Fidelity of the dump hook against the real SGLang releases, without a GPU (issue #29 item 4, 2).

Every ForwardBatch field and ForwardMode member the dump hook reads exists in the release's
sglang/srt/model_executor/forward_batch_info.py. The names are derived from the hook's own source
(AST over extraction/sglang/hook.py and the dump format it imports, hsx_dump_format.py: both are
deployed into SGLang, install.DEPLOYED): a field either starts reading is checked at once. The refused
example (UNSUPPORTED_EXAMPLE) is shown to fail. How the releases are read: sglang_release_ast.py.
"""

from __future__ import annotations

import ast
import functools
import itertools
import sys
from pathlib import Path

import pytest
import yaml

from extraction.sglang import hook, install
from hsx import sglang_patch
from hsx.sglang_versions import SUPPORTED_VERSIONS, UNSUPPORTED_EXAMPLE, support_problem

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_release_ast import ROOT, class_assigns, dotted_name, find_class, find_function, release_source
from sglang_server_role import server_problems

HOOK = ROOT / "extraction" / "sglang" / "hook.py"
FORMAT = ROOT / "extraction" / "sglang" / "hsx_dump_format.py"  # deployed beside it; the hook imports it
FORWARD_BATCH_INFO = "sglang.srt.model_executor.forward_batch_info"

# Read by the hook with a default, and optional by design: only releases that reuse one aux buffer
# across passes (0.5.22+) have it, and without it there is nothing to copy. Every other name the hook
# reads is required. (Checked below to be read only with a default.)
OPTIONAL_BATCH_FIELDS = {"aux_hidden_states_buffer"}


# ---------------------------------------------------------------------------- the hook's reads


@functools.cache
def hook_reads(path: Path = HOOK, format_path: Path = FORMAT) -> tuple[frozenset[str], frozenset[str], tuple[str, ...]]:
    """(ForwardBatch fields the hook reads as forward_batch.X, fields it reads with
    getattr(forward_batch, "X", default), the ForwardMode names it compares forward_mode.name to),
    all from the hook's source and the dump format's it imports (both run inside SGLang)."""
    tree = ast.parse(path.read_text(), str(path))
    direct, defaulted = set(), set()
    for node in itertools.chain(ast.walk(tree), ast.walk(ast.parse(format_path.read_text(), str(format_path)))):
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



@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_hook_reads_exist_in_the_release(version):
    assert batch_problems(version) == [], f"the dump hook reads what SGLang {version}'s ForwardBatch lacks"



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


def test_the_files_checked_are_the_files_deployed():
    """What install.DEPLOYED (hsx patch) and the sglang_patch role put into SGLang is what these
    checks read; both import only the standard library at module level (torch lazily: the
    patched model imports the hook before torch is needed), and the hook finds the format under
    the name it is deployed as."""
    assert set(install.DEPLOYED.values()) == {HOOK, FORMAT}
    assert hook.FORMAT_MODULE + ".py" == sglang_patch.FORMAT_FILENAME
    role_vars = yaml.safe_load((ROOT / "roles" / "sglang_patch" / "vars" / "main.yml").read_text())
    assert [d["name"] for d in role_vars["_sglang_patch_deployed"]] == [
        sglang_patch.FORMAT_FILENAME,
        "{{ _sglang_patch_hook_name }}",
    ] and role_vars["_sglang_patch_hook_name"] == sglang_patch.HOOK_FILENAME
    for name, source in install.DEPLOYED.items():  # the role ships the same files (links to them)
        assert (ROOT / "roles" / "sglang_patch" / "files" / name).resolve() == source.resolve()
    for path in (HOOK, FORMAT):
        top = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.Import | ast.ImportFrom)]
        modules = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        modules += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert [m for m in modules if m.split(".")[0] not in sys.stdlib_module_names] == [], path
