"""Fidelity of the dump patch's targets against the real SGLang releases (issue #49 item 2), by AST.

For every release in SUPPORTED_VERSIONS x every target in hsx.sglang_patch.TARGETS (a release or a
target added there is checked at once), from the release's own model files (tests/sglang_wheels.py
KEEP: deepseek_v2.py, llama.py, qwen2.py, qwen3.py, kimi_k25.py):

1. The anchors: each matches exactly one line of the target's file, inside its model class
   (PATCH_FILES' model_class): the init anchor in __init__, the forward anchor at the top level of
   forward.
2. The state at the forward anchor: on every path that reaches it, `hidden_states` was last bound
   by the final norm (`self.norm(...)`, or `residual_batch.final_norm(..., self.norm, ...)` from
   0.5.22), or is a batch of zero rows left as it was - the hook's contract is the final normed
   state (HF hidden_states[-1]) plus the aux states.
3. The inserted lines in place: the patched file parses and compiles; the forward line's names are
   bound where it sits (forward_batch a parameter, aux_hidden_states assigned before it,
   hidden_states by 2); the init lines' `self` is __init__'s first parameter and `__class__` is a
   free variable of the compiled __init__ (the class cell, so it is the model class).
4. The class a target runs is the patched class, or (qwen3) a subclass that runs the patched
   __init__ (super().__init__) and, where the target is accepted, no forward of its own - exactly in
   the releases hsx.sglang_versions.target_problem accepts (TARGET_REFUSED_FROM is derived here).
5. Each architecture a target claims is in SGLang's registry (a kept file's EntryClass) and builds
   the target's model class (`self.model = X(...)`, `_init_model`, a base class, or Kimi-K2.5's
   `self.language_model = DeepseekV3ForCausalLM(...)`).
6. What the hook reads from the model (derived from extraction/sglang/hook.py: `model.X`,
   `self.model.X`, getattr(model, "X", default)) is bound in the model class's __init__ before the
   init anchor, or read with a default: no DeepSeek-only attribute.
"""

from __future__ import annotations

import ast
import functools
import sys
import types
from pathlib import Path

import pytest

from hsx import patching, sglang_patch
from hsx.sglang_versions import SUPPORTED_VERSIONS, TARGET_REFUSED_FROM, target_file, target_problem

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sglang_wheels  # noqa: E402
from sglang_release_ast import ROOT, dotted_name, find_class, find_function  # noqa: E402

HOOK = ROOT / "extraction" / "sglang" / "hook.py"
INIT_ANCHOR = "self.layers_to_capture = []"
FORWARD_ANCHOR = "if len(aux_hidden_states) == 0:"
MODEL_FILES = ("deepseek_v2", "llama", "qwen2", "qwen3", "kimi_k25")
FINAL_NORM, ZERO_ROWS, IDLE = "the final norm", "zero rows", "an idle pass"
# Neither kind is ever dumped: no rows, or not a prefill pass (the hook dumps EXTEND and MIXED only).
NOT_DUMPED = {"hidden_states.shape[0] != 0": ZERO_ROWS, "not forward_batch.forward_mode.is_idle()": IDLE}
# Calls that give the rows of the state they are passed back in order (so a final norm's stays one):
# DeepSeek's context-parallel prefill gathers each rank's rows back into the batch's order.
ROWS_REGATHERED = {"cp_all_gather_rerange_output"}
CASES = [(v, t) for v in SUPPORTED_VERSIONS for t in sglang_patch.TARGETS]


@functools.cache
def source(version: str, name: str) -> str:
    return (sglang_wheels.require(version) / f"{name}.py").read_text()


@functools.cache
def tree(version: str, name: str) -> ast.Module:
    return ast.parse(source(version, name), f"{version}/{name}.py")


def _stem(target: str) -> str:
    return Path(target_file(target)["file"]).stem


# ---------------------------------------------------------------------------- 1 and 2


def _method_at(module: ast.Module, line: int) -> str:
    for cls in module.body:
        if isinstance(cls, ast.ClassDef):
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.lineno <= line <= (fn.end_lineno or 0):
                    return f"{cls.name}.{fn.name}"
    return "(outside any method)"


def anchor_problems(version: str, target: str) -> list[str]:
    stem, cls = _stem(target), target_file(target)["model_class"]
    lines = source(version, stem).split("\n")
    problems = []
    for anchor, method in ((INIT_ANCHOR, "__init__"), (FORWARD_ANCHOR, "forward")):
        hits = [i + 1 for i, line in enumerate(lines) if line.strip() == anchor]
        where = [_method_at(tree(version, stem), h) for h in hits]
        if where != [f"{cls}.{method}"]:
            problems.append(f"{stem}.py: {anchor!r} at {where or 'nowhere'}, wanted once in {cls}.{method}")
    return problems


def _label(value: ast.expr) -> str:
    """What a binding of hidden_states is: the final norm (`self.norm(...)`, or SGLang's residual
    helpers given it from 0.5.21: `residual_batch.norm/final_norm(..., self.norm, ...)`), or the
    expression."""
    if isinstance(value, ast.Call):
        func = dotted_name(value.func)
        args = [dotted_name(a) for a in value.args]
        if func == "self.norm" or (func.startswith("residual_batch.") and "self.norm" in args):
            return FINAL_NORM
    return ast.unparse(value)


def _binds(stmt: ast.stmt, name: str) -> ast.expr | None:
    targets = (
        stmt.targets
        if isinstance(stmt, ast.Assign)
        else [stmt.target]
        if isinstance(stmt, ast.AnnAssign)
        else []
    )
    for t in targets:
        if dotted_name(t) == name or (isinstance(t, ast.Tuple) and t.elts and dotted_name(t.elts[0]) == name):
            return stmt.value  # type: ignore[return-value]
    return None


def reaching(stmts: list[ast.stmt], defs: frozenset[str]) -> frozenset[str]:
    """The bindings of hidden_states that reach the end of `stmts` on the paths falling through it."""
    for st in stmts:
        if isinstance(st, ast.Return | ast.Raise):
            return frozenset()
        if isinstance(st, ast.If):
            skipped = NOT_DUMPED.get(ast.unparse(st.test))  # its else: a pass the hook never dumps
            defs = reaching(st.body, defs) | reaching(st.orelse, frozenset({skipped}) if skipped else defs)
        elif isinstance(st, ast.For | ast.While):
            defs = defs | reaching(st.body, defs)
        elif isinstance(st, ast.With):
            defs = reaching(st.body, defs)
        elif isinstance(st, ast.Try):
            raise AssertionError(f"line {st.lineno}: a try block before the anchor (not read here)")
        elif (value := _binds(st, "hidden_states")) is not None:
            kept = isinstance(value, ast.Call) and dotted_name(value.func) in ROWS_REGATHERED
            defs = (
                defs if kept and dotted_name(value.args[0]) == "hidden_states" else frozenset({_label(value)})
            )
    return defs


def forward_state_problems(version: str, target: str, text: str | None = None) -> list[str]:
    """What is wrong at the forward anchor of the target's file (`text`: in place of the release's)."""
    stem, cls = _stem(target), target_file(target)["model_class"]
    module = tree(version, stem) if text is None else ast.parse(text)
    fwd = find_function(find_class(module, cls).body, "forward")
    at = next(
        i
        for i, st in enumerate(fwd.body)
        if isinstance(st, ast.If) and f"if {ast.unparse(st.test)}:" == FORWARD_ANCHOR
    )
    before = fwd.body[:at]
    states = reaching(before, frozenset({"unbound"}))
    problems = []
    if FINAL_NORM not in states or states - {FINAL_NORM, ZERO_ROWS, IDLE}:
        problems.append(
            f"{cls}.forward: hidden_states at the anchor is {sorted(states)}, not the final norm's"
        )
    if "forward_batch" not in [a.arg for a in fwd.args.args]:
        problems.append(f"{cls}.forward has no parameter forward_batch")
    if not any(_binds(st, "aux_hidden_states") is not None for st in before):
        problems.append(f"{cls}.forward binds no aux_hidden_states before the anchor")
    return problems


# ---------------------------------------------------------------------------- 3


def patched_problems(version: str, target: str) -> list[str]:
    """The target file's patch applied: it parses and compiles, and the init lines see the class cell."""
    info = target_file(target)
    patch = patching.Patch.from_dict(sglang_patch.NAMED_PATCHES[info["patch"]])
    text, _ins = patching.plan(source(version, _stem(target)), patch)
    code = compile(text, f"{version}/{_stem(target)}.py (patched)", "exec")
    init = next(
        c
        for k in code.co_consts
        if isinstance(k, types.CodeType) and k.co_name == info["model_class"]
        for c in k.co_consts
        if isinstance(c, types.CodeType) and c.co_name == "__init__"
    )
    problems = []
    if init.co_varnames[:1] != ("self",):
        problems.append(f"{info['model_class']}.__init__'s first parameter is not self")
    uses_class = any("__class__" in line for b in patch.blocks for line in b.code)
    if uses_class and "__class__" not in init.co_freevars:
        problems.append(f"{info['model_class']}.__init__ (patched) has no __class__ cell")
    cls = find_class(ast.parse(text), info["model_class"])
    init_src = ast.unparse(find_function(cls.body, "__init__"))
    fwd_src = ast.unparse(find_function(cls.body, "forward"))
    if "self._hsx_dump = " not in init_src or init_src.index("self._hsx_dump = ") < init_src.index(
        INIT_ANCHOR
    ):
        problems.append("the attach line is not after the init anchor in __init__")
    if fwd_src.index("self._hsx_dump.after_forward") > fwd_src.index(FORWARD_ANCHOR.rstrip(":")):
        problems.append("the after_forward line is not before the forward anchor")
    return problems


# ---------------------------------------------------------------------------- 4 and 5


def runs_problem(version: str, target: str) -> str | None:
    """Why the target's model class would not run the patched __init__ and forward, or None."""
    info = target_file(target)
    want = sglang_patch.TARGETS[target]["model_class"]
    if want == info["model_class"]:
        return None
    owner = next(
        n
        for n in MODEL_FILES
        if any(isinstance(c, ast.ClassDef) and c.name == want for c in tree(version, n).body)
    )
    cls = find_class(tree(version, owner), want)
    if info["model_class"] not in [dotted_name(b) for b in cls.bases]:
        return f"{want} does not subclass {info['model_class']}"
    methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
    if "__init__" in methods and "super().__init__" not in ast.unparse(methods["__init__"]):
        return f"{want}.__init__ does not run {info['model_class']}.__init__"
    if "forward" in methods:
        return f"{want} ({owner}.py) has a forward of its own"
    return None


def _entry_classes(version: str) -> dict[str, str]:
    out = {}
    for name in MODEL_FILES:
        for node in tree(version, name).body:
            if isinstance(node, ast.Assign) and [dotted_name(t) for t in node.targets] == ["EntryClass"]:
                names = node.value.elts if isinstance(node.value, ast.List | ast.Tuple) else [node.value]
                out.update({dotted_name(n): name for n in names})
    return out


def builds(version: str, cls_name: str, depth: int = 0) -> str:
    """The model class an architecture's class builds (as self.model)."""
    owner = next(
        (
            n
            for n in MODEL_FILES
            if any(isinstance(c, ast.ClassDef) and c.name == cls_name for c in tree(version, n).body)
        ),
        None,
    )
    if owner is None or depth > 5:
        return f"? ({cls_name} not in the kept files)"
    cls = find_class(tree(version, owner), cls_name)
    methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
    for node in ast.walk(methods["__init__"]) if "__init__" in methods else ():
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            target, func = dotted_name(node.targets[0]), dotted_name(node.value.func)
            if target == "self.model" and func == "self._init_model":
                ret = next(n for n in ast.walk(methods["_init_model"]) if isinstance(n, ast.Return))
                return dotted_name(ret.value.func)  # type: ignore[union-attr]
            if target == "self.model":
                return func
            if target == "self.language_model":
                return builds(version, func, depth + 1)
    for base in cls.bases:
        got = builds(version, dotted_name(base), depth + 1)
        if not got.startswith("?"):
            return got
    return f"? ({cls_name} builds no model)"


# ---------------------------------------------------------------------------- 6


@functools.cache
def hook_model_reads(path: Path = HOOK) -> tuple[frozenset[str], frozenset[str]]:
    """(attributes the hook reads from the model directly, those it reads with a default)."""
    direct, defaulted = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and dotted_name(node.value) in ("model", "self.model"):
            direct.add(node.attr)
        if isinstance(node, ast.Call) and dotted_name(node.func) in ("getattr", "hasattr") and node.args:
            if dotted_name(node.args[0]) in ("model", "self.model"):
                (defaulted if len(node.args) > 2 else direct).add(node.args[1].value)  # type: ignore[attr-defined]
    assert "layers_to_capture" in direct, direct  # the derivation still sees the hook's reads
    return frozenset(direct), frozenset(defaulted)


def model_read_problems(version: str, target: str, hook: Path = HOOK) -> list[str]:
    info = target_file(target)
    stem = _stem(target)
    init = find_function(find_class(tree(version, stem), info["model_class"]).body, "__init__")
    anchor_line = next(
        i + 1 for i, line in enumerate(source(version, stem).split("\n")) if line.strip() == INIT_ANCHOR
    )
    bound = {
        t.attr
        for node in ast.walk(init)
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.lineno <= anchor_line
        for tgt in (node.targets if isinstance(node, ast.Assign) else [node.target])
        for t in ast.walk(tgt)
        if isinstance(t, ast.Attribute) and dotted_name(t.value) == "self"
    }
    direct, _defaulted = hook_model_reads(hook)
    return [f"{info['model_class']}.{a} is not bound before the init anchor" for a in sorted(direct - bound)]


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize(("version", "target"), CASES)
def test_target_is_patched_where_the_hook_contract_holds(version, target):
    runs, refused = runs_problem(version, target), target_problem(target, version)
    assert (runs is None) == (refused is None), (
        f"SGLang {version}, target {target}: its files say {runs!r}, hsx.sglang_versions says {refused!r}"
    )
    assert anchor_problems(version, target) == []
    assert forward_state_problems(version, target) == []
    assert patched_problems(version, target) == []
    assert model_read_problems(version, target) == []
    entries = _entry_classes(version)
    for arch in sglang_patch.TARGETS[target]["architectures"]:
        assert arch in entries, f"{version}: {arch} is in no kept file's EntryClass"
        assert builds(version, arch) == sglang_patch.TARGETS[target]["model_class"], (version, arch)


def test_refused_targets_are_derived_from_the_releases():
    """TARGET_REFUSED_FROM says from which release a target is refused: that release is the first
    one whose files fail the target, and every one before it passes."""
    for target, (first, _why) in TARGET_REFUSED_FROM.items():
        failing = [v for v in SUPPORTED_VERSIONS if runs_problem(v, target)]
        assert failing and failing[0] == first, (target, failing)
        assert all(target_problem(target, v) is not None for v in failing)
    assert target_problem("qwen3", "0.5.23") == (
        "target qwen3 is refused in SGLang 0.5.23 (from 0.5.21 on): its Qwen3Model (srt/models/qwen3.py)"
        " has a forward of its own, without the anchor `if len(aux_hidden_states) == 0:`"
    )
    assert target_problem("qwen3", "0.5.20") is None and target_problem("llama", "0.5.23") is None


def test_the_checks_find_what_is_wrong(tmp_path):
    """The checkers themselves: a state bound after the norm, a hook reading a DeepSeek-only
    attribute, a subclass with a forward of its own."""
    version = SUPPORTED_VERSIONS[-1]
    text = source(version, "llama")
    moved = text.replace(FORWARD_ANCHOR, "hidden_states = hidden_states * 2\n        " + FORWARD_ANCHOR, 1)
    assert forward_state_problems(version, "llama", moved) == [
        "LlamaModel.forward: hidden_states at the anchor is ['hidden_states * 2'], not the final norm's"
    ]
    oldest = source(SUPPORTED_VERSIONS[0], "qwen2")  # the norm on one branch only: the other unnormed
    one_branch = oldest.replace("hidden_states = self.norm(hidden_states)", "pass", 1)
    (problem,) = forward_state_problems(SUPPORTED_VERSIONS[0], "qwen2", one_branch)
    assert "'layer(positions, hidden_states, forward_batch, residual)'" in problem, problem
    mla = tmp_path / "hook.py"
    mla.write_text(HOOK.read_text() + "\n\ndef _probe(model):\n    return model.kv_lora_rank\n")
    assert model_read_problems(version, "llama", mla) == [
        "LlamaModel.kv_lora_rank is not bound before the init anchor"
    ]
    assert runs_problem(version, "qwen3") == "Qwen3Model (qwen3.py) has a forward of its own"
    assert runs_problem(SUPPORTED_VERSIONS[0], "qwen3") is None
