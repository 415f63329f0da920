"""The dump hook on synthetic SGLang batches built from the tiny model's real hidden states.

A batch here is what DeepseekV2Model.forward hands the hook: the final normed state of every
token of the batch (HF hidden_states[-1]), the aux states the model collected for the ids in
`layers_to_capture` (HF hidden_states[i]) as a list or as SGLang's real AuxHiddenStatePacker
(loaded from the released file), and a ForwardBatch-like object with rids and extend lengths.
Requests are ragged and one is chunked across two forward passes; what the reader joins back must
equal transformers' hidden_states exactly.
"""

from __future__ import annotations

import enum
import importlib.util
import logging
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from extraction.sglang import dumps, hook, patchdef
from extraction.sglang.versions import SUPPORTED_VERSIONS, release_key

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sglang_wheels  # noqa: E402

LAYERS = [1, 3, 4]
LENGTHS = {"req-a": 5, "req-b": 17, "req-c": 9}


class ForwardMode(enum.IntEnum):  # the names SGLang's ForwardMode uses
    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4
    TARGET_VERIFY = 5


@pytest.fixture(scope="module")
def states() -> dict[str, tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
    """rid -> (input_ids [L], HF hidden_states of that request alone)."""
    from transformers import DeepseekV3Config, DeepseekV3Model

    from extraction.tiny import model_config_kwargs

    torch.manual_seed(0)
    model = DeepseekV3Model(DeepseekV3Config(**model_config_kwargs())).to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1)
    out = {}
    with torch.inference_mode():
        for rid, n in LENGTHS.items():
            ids = torch.randint(3, 1024, (n,), generator=gen)
            hs = model(input_ids=ids[None], output_hidden_states=True, use_cache=False).hidden_states
            out[rid] = (ids, tuple(h[0].clone() for h in hs))
    return out


def _packer_class(version: str):
    src = sglang_wheels.require(version) / "aux_hidden_states.py"
    spec = importlib.util.spec_from_file_location(f"sglang_aux_{version.replace('.', '_')}", src)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.AuxHiddenStatePacker


def _model(num_layers: int = 6):
    """The two attributes of DeepseekV2Model the hook touches."""
    return SimpleNamespace(config=SimpleNamespace(num_hidden_layers=num_layers), layers_to_capture=[])


def forward(model, pieces, states, form, mode=ForwardMode.EXTEND):
    """Mimic DeepseekV2Model.forward's tail for a batch of (rid, start, end) pieces."""
    rows = lambda i: torch.cat([states[rid][1][i][s:e] for rid, s, e in pieces])  # noqa: E731
    final = rows(-1)
    captured = [i for i in range(model.config.num_hidden_layers) if i in model.layers_to_capture]
    if form == "list":
        aux = [rows(i) for i in captured]
    else:
        aux = form(len(model.layers_to_capture))
        for i in captured:
            aux.append(rows(i))
    batch = SimpleNamespace(
        forward_mode=mode,
        rids=[rid for rid, _, _ in pieces],
        extend_seq_lens_cpu=[e - s for _, s, e in pieces],
        extend_prefix_lens_cpu=[s for _, s, _ in pieces],
        input_ids=torch.cat([states[rid][0][s:e] for rid, s, e in pieces]),
    )
    returned = model._hsx_dump.after_forward(batch, final, aux)
    return returned, aux


# Releases whose DeepseekV2Model collects into an AuxHiddenStatePacker (0.5.17 on); earlier ones a list.
PACKER_RELEASES = [v for v in SUPPORTED_VERSIONS if release_key(v) >= (0, 5, 17, 0)]


@pytest.fixture(params=["list"] + [f"packer-{v}" for v in PACKER_RELEASES])
def form(request):
    if request.param == "list":
        return "list"
    return _packer_class(request.param.split("-")[1])


@pytest.fixture
def attached(tmp_path):
    model = _model()
    model._hsx_dump = hook.attach(
        model, {hook.ENV_DIR: str(tmp_path), hook.ENV_LAYERS: ",".join(map(str, LAYERS))}
    )
    assert model._hsx_dump is not None
    model._hsx_dump.version = "0.5.23"
    return model, tmp_path


def test_ragged_and_chunked_dumps_equal_hf_hidden_states(attached, states, form):
    model, out = attached
    assert model.layers_to_capture == LAYERS
    # pass 1: a whole, and the first 7 tokens of b; pass 2: the rest of b, and c whole
    r1, _ = forward(model, [("req-a", 0, 5), ("req-b", 0, 7)], states, form)
    r2, _ = forward(model, [("req-b", 7, 17), ("req-c", 0, 9)], states, form)
    assert len(r1) == 0 and len(r2) == 0  # the hook owns capture: the model returns no aux states
    assert len(list(out.glob("req-b.*.pt"))) == 2
    for f in out.glob("*.pt"):  # each file holds its own rows only, not the batch's storage
        record = torch.load(f, weights_only=True)
        for key in ("input_ids", "hidden_state", "aux_hidden_state"):
            t = record[key]
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), (f.name, key)
    for rid, n in LENGTHS.items():
        ids, hs = states[rid]
        got = dumps.read_request(str(out), rid, expected_len=n)
        assert torch.equal(got.input_ids, ids)
        assert got.hidden_state.dtype == torch.bfloat16
        assert torch.equal(got.hidden_state, hs[-1])
        assert torch.equal(got.aux_hidden_state, torch.cat([hs[i] for i in LAYERS], dim=-1))
        assert got.layer_ids == LAYERS and got.capture_owner == hook.OWNER_HOOK
        assert got.sglang_version == "0.5.23"
        assert got.pieces == (2 if rid == "req-b" else 1)


def test_eagle3_capture_is_passed_through(attached, states, form):
    model, out = attached
    model.layers_to_capture = [2, 4]  # what set_eagle3_layers_to_capture does: a new list
    returned, aux = forward(model, [("req-a", 0, 5), ("req-c", 0, 9)], states, form)
    assert returned is aux  # SGLang's own aux states go back untouched
    got = dumps.read_request(str(out), "req-c", expected_len=9)
    hs = states["req-c"][1]
    assert got.layer_ids == [2, 4] and got.capture_owner == hook.OWNER_SGLANG
    assert torch.equal(got.aux_hidden_state, torch.cat([hs[2], hs[4]], dim=-1))


def test_only_prefill_on_rank_zero_is_dumped(attached, states):
    model, out = attached
    for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE):
        forward(model, [("req-a", 0, 1)], states, "list", mode=mode)
    assert not list(out.iterdir())
    model._hsx_dump.rank = 1
    forward(model, [("req-a", 0, 5)], states, "list")
    assert not list(out.iterdir())
    model._hsx_dump.rank = 0
    forward(model, [("req-a", 0, 5)], states, "list", mode=ForwardMode.MIXED)
    assert [p.name for p in out.iterdir()] == ["req-a.000000000.pt"]


def test_gaps_and_missing_prefix_are_refused(attached, states):
    model, out = attached
    forward(model, [("req-b", 0, 7)], states, "list")
    with pytest.raises(dumps.DumpError, match="cover 7 tokens, expected 17"):
        dumps.read_request(str(out), "req-b", expected_len=17)
    forward(model, [("req-b", 9, 17)], states, "list")
    with pytest.raises(dumps.DumpError, match="gap in request 'req-b': piece starts at 9, expected 7"):
        dumps.read_request(str(out), "req-b")
    (out / hook.dump_name("req-b", 0)).unlink()
    with pytest.raises(dumps.DumpError, match="starts at token 9, not 0"):
        dumps.read_request(str(out), "req-b")
    assert dumps.remove_request(str(out), "req-b") == 1
    with pytest.raises(dumps.DumpError, match="no dump"):
        dumps.read_request(str(out), "req-b")


def test_bad_batches_never_raise_and_log_once(attached, states, caplog, monkeypatch):
    model, out = attached
    monkeypatch.setattr(hook, "_logged", set())
    bad = SimpleNamespace(forward_mode=ForwardMode.EXTEND, rids=None, extend_seq_lens_cpu=None)
    with caplog.at_level(logging.WARNING, logger="hsx_dump_hook"):
        for _ in range(3):
            assert model._hsx_dump.after_forward(bad, torch.zeros(2, 64), []) == []
        # rows that do not add up: skipped, and SGLang's own aux states returned when it owns them
        model.layers_to_capture = [2]
        short = SimpleNamespace(
            forward_mode=ForwardMode.EXTEND,
            rids=["x"],
            extend_seq_lens_cpu=[3],
            extend_prefix_lens_cpu=[0],
            input_ids=torch.zeros(2, dtype=torch.long),
        )
        aux = [torch.zeros(2, 64)]
        assert model._hsx_dump.after_forward(short, torch.zeros(2, 64), aux) is aux
    assert len(caplog.records) == 1  # both are ValueErrors: one line per kind of failure
    assert "batch skipped" in caplog.records[0].getMessage()
    assert not list(out.iterdir())


def test_attach_is_inactive_without_dir_and_refuses_bad_layers(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(hook, "_logged", set())
    model = _model()
    assert hook.attach(model, {}) is None and model.layers_to_capture == []
    with caplog.at_level(logging.WARNING, logger="hsx_dump_hook"):
        assert hook.attach(model, {hook.ENV_DIR: str(tmp_path), hook.ENV_LAYERS: "0,3"}) is None
        assert hook.attach(_model(), {hook.ENV_DIR: str(tmp_path)}) is None  # default [2,3,3]: not distinct
    assert model.layers_to_capture == []
    assert "not attached" in caplog.text and "1..5" in caplog.text
    eight = _model(8)
    assert hook.attach(eight, {hook.ENV_DIR: str(tmp_path)}) is not None
    assert eight.layers_to_capture == [2, 4, 5]


def test_rid_names_are_file_safe():
    assert hook.dump_name("abc-1.x", 12) == "abc-1.x.000000012.pt"
    odd = hook.dump_name("../etc/passwd", 0)
    assert "/" not in odd and odd.startswith("rid-")


def _exec_line(block: str, namespace: dict) -> None:
    (code,) = next(b["code"] for b in patchdef.SGLANG_DUMP_PATCH["blocks"] if b["name"] == block)
    exec(code, namespace)


def test_patch_lines_call_the_deployed_hook_and_tolerate_its_absence(tmp_path, states, monkeypatch):
    """Run the two inserted lines as written, with the hook deployed into a package named sglang."""
    site = tmp_path / "site"
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    dump_dir = tmp_path / "dumps"
    monkeypatch.setenv(hook.ENV_DIR, str(dump_dir))
    monkeypatch.setenv(hook.ENV_LAYERS, "1,3,4")

    model = _model()
    _exec_line("init", {"self": model})
    assert model._hsx_dump is None  # no hook module: unpatched behaviour
    aux = [torch.zeros(1)]
    ns = {"self": model, "forward_batch": None, "hidden_states": None, "aux_hidden_states": aux}
    _exec_line("forward", ns)
    assert ns["aux_hidden_states"] is aux

    shutil.copy(hook.__file__, site / "sglang" / patchdef.HOOK_FILENAME)
    importlib.invalidate_caches()
    model = _model()
    _exec_line("init", {"self": model})
    assert type(model._hsx_dump).__module__ == patchdef.HOOK_MODULE
    assert model.layers_to_capture == LAYERS
    ids, hs = states["req-a"]
    batch = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        rids=["req-a"],
        extend_seq_lens_cpu=[5],
        extend_prefix_lens_cpu=[0],
        input_ids=ids,
    )
    ns = {
        "self": model,
        "forward_batch": batch,
        "hidden_states": hs[-1],
        "aux_hidden_states": [hs[i] for i in LAYERS],
    }
    _exec_line("forward", ns)
    assert ns["aux_hidden_states"] == []
    got = dumps.read_request(str(dump_dir), "req-a", expected_len=5)
    assert torch.equal(got.hidden_state, hs[-1])
