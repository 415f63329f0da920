"""The patches that make SGLang's model files call the dump hook, and which file a model needs:
plain data, read by hsx.patching (the patch core) and hsx.sglang_versions (the release checks).

Each patched file gets two one-line insertions in its model class (the anchors are EAGLE-3's own
capture code and appear exactly once in every supported release; line numbers move, the text does
not):
- after `self.layers_to_capture = []` in __init__: attach the hook (it may claim layers_to_capture);
- before `if len(aux_hidden_states) == 0:` in forward, where `hidden_states` is the final normed
  state: hand the batch to the hook, which dumps prefill passes and returns the aux states the
  model should return (unchanged when EAGLE-3 owns capture, empty when the hook does).
The import is guarded by find_spec, so a missing hook module leaves SGLang as it was. The hook is
deployed as `sglang/hsx_dump_hook.py` (inside the package, so any install layout can import it),
with the dump format it imports beside it, `sglang/hsx_dump_format.py`.

One patch per file (PATCH_FILES), each with an id of its own, so several targets can be patched in
one install and each file is read and reverted on its own. TARGETS maps what a server runs (the
model's config.json `architectures`) to the file patched; which releases refuse a target is
hsx.sglang_versions' (TARGET_REFUSED_FROM).

NO IMPORTS: part of the stdlib-only core, shipped to Ansible hosts as ansible.module_utils.hsx.sglang_patch.
"""

PATCH_ID = "hsx-sglang-dump"  # deepseek_v2.py's (the first target); the others add their file's name
PATCH_VERSION = "2"
TARGET = "srt/models/deepseek_v2.py"  # the default target's file, relative to the sglang package directory
HOOK_MODULE = "sglang.hsx_dump_hook"
HOOK_FILENAME = "hsx_dump_hook.py"  # deployed next to sglang/__init__.py
FORMAT_FILENAME = "hsx_dump_format.py"  # the dump file format the hook imports, deployed beside it

_ATTACH = (
    'self._hsx_dump = __import__("importlib.util").util.find_spec("sglang.hsx_dump_hook")'
    ' and __import__("sglang.hsx_dump_hook", fromlist=["attach"]).attach(self)'
)
_AFTER_FORWARD = (
    "aux_hidden_states = self._hsx_dump.after_forward(forward_batch, hidden_states,"
    ' aux_hidden_states) if getattr(self, "_hsx_dump", None) else aux_hidden_states'
)

SGLANG_DUMP_PATCH = {
    "id": PATCH_ID,
    "version": PATCH_VERSION,
    "description": "call the hsx hidden-state dump hook from DeepseekV2Model",
    "blocks": [
        {"name": "init", "anchor": "self.layers_to_capture = []", "where": "after", "code": [_ATTACH]},
        {
            "name": "forward",
            "anchor": "if len(aux_hidden_states) == 0:",
            "where": "before",
            "code": [_AFTER_FORWARD],
        },
    ],
}

# Version 1, as first rolled out: kept so tests (and `hsx patch status`) can show an in-place
# upgrade from it. It imported the hook unguarded.
SGLANG_DUMP_PATCH_V1 = {
    "id": PATCH_ID,
    "version": "1",
    "description": "call the hsx hidden-state dump hook from DeepseekV2Model (first version)",
    "blocks": [
        {
            "name": "init",
            "anchor": "self.layers_to_capture = []",
            "where": "after",
            "code": ['self._hsx_dump = __import__("sglang.hsx_dump_hook", fromlist=["attach"]).attach(self)'],
        },
        {
            "name": "forward",
            "anchor": "if len(aux_hidden_states) == 0:",
            "where": "before",
            "code": [
                "aux_hidden_states = self._hsx_dump.after_forward(forward_batch, hidden_states,"
                " aux_hidden_states) if self._hsx_dump else aux_hidden_states",
            ],
        },
    ],
}


def _model_patch(name: str, model_class: str) -> dict:
    """The dump patch for another model file: DeepSeek's two blocks, and before the attach the class
    whose __init__ runs it (`__class__`, the class the patched method is defined in), which the hook
    compares with the model's forward: a subclass with a forward of its own (Qwen3Model from 0.5.21,
    JetNemotronModel) never calls after_forward, so the hook must not claim capture there (the
    model would return aux states its caller does not expect)."""
    return {
        "id": f"{PATCH_ID}-{name}",
        "version": "1",
        "description": f"call the hsx hidden-state dump hook from {model_class}",
        "blocks": [
            {
                "name": "init",
                "anchor": "self.layers_to_capture = []",
                "where": "after",
                "code": ["self._hsx_dump_class = __class__", _ATTACH],
            },
            {
                "name": "forward",
                "anchor": "if len(aux_hidden_states) == 0:",
                "where": "before",
                "code": [_AFTER_FORWARD],
            },
        ],
    }


# The files patched, by name: the file (relative to the sglang package), the class holding both
# anchors, and the named patch (NAMED_PATCHES; the source_patch module's `patch` choices).
PATCH_FILES = {
    "deepseek_v2": {"file": TARGET, "model_class": "DeepseekV2Model", "patch": "sglang_dump_hook"},
    "llama": {"file": "srt/models/llama.py", "model_class": "LlamaModel", "patch": "sglang_dump_hook_llama"},
    "qwen2": {"file": "srt/models/qwen2.py", "model_class": "Qwen2Model", "patch": "sglang_dump_hook_qwen2"},
}

NAMED_PATCHES = {
    "sglang_dump_hook": SGLANG_DUMP_PATCH,
    "sglang_dump_hook_llama": _model_patch("llama", "LlamaModel"),
    "sglang_dump_hook_qwen2": _model_patch("qwen2", "Qwen2Model"),
}

# What a server runs -> the file patched (PATCH_FILES) and the class whose forward calls the hook.
# `architectures` are config.json's names, as SGLang's model registry (each file's EntryClass)
# knows them. Qwen3Model (srt/models/qwen3.py) subclasses Qwen2Model: it runs Qwen2Model's patched
# __init__ and, while it has no forward of its own (to 0.5.20), its patched forward.
TARGETS = {
    "deepseek_v2": {
        "file": "deepseek_v2",
        "model_class": "DeepseekV2Model",
        "architectures": [
            "DeepseekV2ForCausalLM",
            "DeepseekV3ForCausalLM",
            "DeepseekV32ForCausalLM",
            "KimiK25ForConditionalGeneration",  # srt/models/kimi_k25.py wraps DeepseekV3ForCausalLM
        ],
    },
    "llama": {"file": "llama", "model_class": "LlamaModel", "architectures": ["LlamaForCausalLM"]},
    "qwen2": {"file": "qwen2", "model_class": "Qwen2Model", "architectures": ["Qwen2ForCausalLM"]},
    "qwen3": {"file": "qwen2", "model_class": "Qwen3Model", "architectures": ["Qwen3ForCausalLM"]},
}
# `hsx patch` without --target/--model, and the role with no model to read: the patch's first target.
DEFAULT_TARGET = "deepseek_v2"
