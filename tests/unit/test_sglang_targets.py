"""The dump patch for targets beyond DeepSeek (issue #49 item 2), run as Python: the patch lines of
each model file applied by the patch core to a small model module shaped like SGLang's (a model
class whose __init__ ends in `self.layers_to_capture = []`, a forward with the anchor, a subclass
that inherits the forward and one with a forward of its own), executed with the hook deployed into a
package named sglang. What the released files hold around the anchors is checked by AST against
every release: tests/unit/test_sglang_fidelity_targets.py.
"""

from __future__ import annotations

import importlib
import logging
import sys
from types import SimpleNamespace

import pytest

from extraction.sglang import hook, install
from hsx import patching, sglang_patch

MODEL_MODULE = """
import types


class Model:
    def __init__(self, num_layers):
        super().__init__()
        self.config = types.SimpleNamespace(num_hidden_layers=num_layers)
        self.layers = list(range(num_layers))
        self.layers_to_capture = []

    def forward(self, forward_batch, hidden_states, aux):
        aux_hidden_states = aux
        if len(aux_hidden_states) == 0:
            return hidden_states
        return hidden_states, aux_hidden_states


class Inherits(Model):  # MiMoModel, Ministral3Model: the patched forward runs
    pass


class OwnForward(Model):  # Qwen3Model from 0.5.21, JetNemotronModel: it never calls the hook
    def forward(self, forward_batch, hidden_states, aux):
        return (hidden_states, aux) if aux else hidden_states
"""

DECODE = SimpleNamespace(forward_mode=SimpleNamespace(name="DECODE"))
OTHER_FILES = [name for name in sglang_patch.PATCH_FILES if name != "deepseek_v2"]


@pytest.fixture
def deployed(tmp_path, monkeypatch):
    """A package named sglang holding the deployed hook; HSX_DUMP_* set as the server unit sets them."""
    site = tmp_path / "site"
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("")
    install.deploy_files(site / "sglang")
    monkeypatch.syspath_prepend(str(site))
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    importlib.invalidate_caches()
    monkeypatch.setenv(hook.ENV_DIR, str(tmp_path / "dumps"))
    monkeypatch.setenv(hook.ENV_LAYERS, "1,3,4")
    return site


def _patched_module(name: str) -> dict:
    patch = patching.Patch.from_dict(sglang_patch.NAMED_PATCHES[sglang_patch.PATCH_FILES[name]["patch"]])
    text, _ = patching.plan(MODEL_MODULE, patch)
    namespace: dict = {"__name__": f"patched_{name}"}
    exec(compile(text, f"<{name} patched>", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("name", OTHER_FILES)
def test_the_hook_attaches_only_where_the_patched_forward_runs(name, deployed, caplog, monkeypatch):
    monkeypatch.setattr(hook, "_logged", set())
    mod = _patched_module(name)
    for cls in (mod["Model"], mod["Inherits"]):
        model = cls(6)
        assert type(model._hsx_dump).__module__ == sglang_patch.HOOK_MODULE, cls
        assert model.layers_to_capture == [1, 3, 4] and model._hsx_dump.owns_capture()
        assert model.forward(DECODE, "final", []) == "final"  # not a prefill batch: nothing dumped
    with caplog.at_level(logging.WARNING, logger="hsx_dump_hook"):
        other = mod["OwnForward"](6)
    # Claiming capture there would make the model return aux states its caller does not expect.
    assert other._hsx_dump is None and other.layers_to_capture == []
    assert other.forward(DECODE, "final", other.layers_to_capture) == "final"
    assert (
        "not attached" in caplog.text and "OwnForward.forward is not the patched Model.forward" in caplog.text
    )


def test_the_deepseek_patch_is_unchanged_and_attaches_as_before(deployed):
    """deepseek_v2.py's patch stays v2 (nodes hold it; no rollout for #49): no class line, no check."""
    patch = patching.Patch.from_dict(sglang_patch.SGLANG_DUMP_PATCH)
    assert (patch.patch_id, patch.version, patch.digest) == ("hsx-sglang-dump", "2", "441b8149a284")
    text, _ = patching.plan(MODEL_MODULE, patch)
    namespace: dict = {"__name__": "patched_deepseek"}
    exec(compile(text, "<deepseek patched>", "exec"), namespace)
    model = namespace["OwnForward"](6)
    assert not hasattr(model, "_hsx_dump_class") and model._hsx_dump is not None
