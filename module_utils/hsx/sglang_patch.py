"""The deepseek_v2.py patch that calls the dump hook: plain data, read by hsx.patching.

Two one-line insertions in DeepseekV2Model (the anchors appear exactly once in every supported
release; line numbers move, the text does not):
- after `self.layers_to_capture = []` in __init__: attach the hook (it may claim layers_to_capture);
- before `if len(aux_hidden_states) == 0:` in forward, where `hidden_states` is the final normed
  state: hand the batch to the hook, which dumps prefill passes and returns the aux states the
  model should return (unchanged when EAGLE-3 owns capture, empty when the hook does).
The import is guarded by find_spec, so a missing hook module leaves SGLang as it was. The hook is
deployed as `sglang/hsx_dump_hook.py` (inside the package, so any install layout can import it),
with the dump format it imports beside it, `sglang/hsx_dump_format.py`.

NO IMPORTS: part of the stdlib-only core, shipped to Ansible hosts as ansible.module_utils.hsx.sglang_patch.
"""

PATCH_ID = "hsx-sglang-dump"
PATCH_VERSION = "2"
TARGET = "srt/models/deepseek_v2.py"  # relative to the sglang package directory
HOOK_MODULE = "sglang.hsx_dump_hook"
HOOK_FILENAME = "hsx_dump_hook.py"  # deployed next to sglang/__init__.py
FORMAT_FILENAME = "hsx_dump_format.py"  # the dump file format the hook imports, deployed beside it

SGLANG_DUMP_PATCH = {
    "id": PATCH_ID,
    "version": PATCH_VERSION,
    "description": "call the hsx hidden-state dump hook from DeepseekV2Model",
    "blocks": [
        {
            "name": "init",
            "anchor": "self.layers_to_capture = []",
            "where": "after",
            "code": [
                'self._hsx_dump = __import__("importlib.util").util.find_spec("sglang.hsx_dump_hook")'
                ' and __import__("sglang.hsx_dump_hook", fromlist=["attach"]).attach(self)',
            ],
        },
        {
            "name": "forward",
            "anchor": "if len(aux_hidden_states) == 0:",
            "where": "before",
            "code": [
                "aux_hidden_states = self._hsx_dump.after_forward(forward_batch, hidden_states,"
                ' aux_hidden_states) if getattr(self, "_hsx_dump", None) else aux_hidden_states',
            ],
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

NAMED_PATCHES = {"sglang_dump_hook": SGLANG_DUMP_PATCH}
