"""The dump hook on synthetic SGLang batches built from the tiny model's real hidden states.

A batch here is what DeepseekV2Model.forward hands the hook: the final normed state of every
token of the batch (HF hidden_states[-1]), the aux states the model collected for the ids in
`layers_to_capture` (HF hidden_states[i]) as a list or as SGLang's real AuxHiddenStatePacker
(loaded from the released file), and a ForwardBatch-like object with rids and extend lengths.
Requests are ragged and one is chunked across two forward passes; what the reader joins back must
equal transformers' hidden_states exactly.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from extraction.sglang import dumps, hook, hsx_dump_format, install
from extraction.shards.filebytes import in_memory
from hsx import sglang_patch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_hook_helpers import LAYERS, LENGTHS, ForwardMode, Gate, _batch, _model, _packer, forward


def test_ragged_and_chunked_dumps_equal_hf_hidden_states(attached, states, form):
    model, out = attached
    assert model.layers_to_capture == LAYERS
    # pass 1: a whole, and the first 7 tokens of b; pass 2: the rest of b, and c whole
    r1, _ = forward(model, [("hsx-req-a", 0, 5), ("hsx-req-b", 0, 7)], states, form)
    r2, _ = forward(model, [("hsx-req-b", 7, 17), ("hsx-req-c", 0, 9)], states, form)
    assert len(r1) == 0 and len(r2) == 0  # the hook owns capture: the model returns no aux states
    assert len(list(out.glob("hsx-req-b.*.pt"))) == 2
    for f in out.glob("*.pt"):  # each file holds its own rows only, not the batch's storage
        record = dumps._load(str(f), f.name.split(".")[0])
        rows = sum(record[k].nbytes for k in dumps._KEYS)
        assert rows < f.stat().st_size <= rows + 4 * hsx_dump_format.DUMP_ALIGN, f.name
    for rid, n in LENGTHS.items():
        ids, hs = states[rid]
        got = dumps.read_request(str(out), rid, expected_len=n)
        assert torch.equal(got.input_ids, ids)
        assert got.hidden_state.dtype == torch.bfloat16
        assert torch.equal(got.hidden_state, hs[-1])
        assert torch.equal(got.aux_hidden_state, torch.cat([hs[i] for i in LAYERS], dim=-1))
        assert got.layer_ids == LAYERS and got.capture_owner == hook.OWNER_HOOK
        assert got.sglang_version == "0.5.23"
        assert got.pieces == (2 if rid == "hsx-req-b" else 1)


def test_eagle3_capture_is_passed_through(attached, states, form):
    model, out = attached
    model.layers_to_capture = [2, 4]  # what set_eagle3_layers_to_capture does: a new list
    returned, aux = forward(model, [("hsx-req-a", 0, 5), ("hsx-req-c", 0, 9)], states, form)
    assert returned is aux  # SGLang's own aux states go back untouched
    got = dumps.read_request(str(out), "hsx-req-c", expected_len=9)
    hs = states["hsx-req-c"][1]
    assert got.layer_ids == [2, 4] and got.capture_owner == hook.OWNER_SGLANG
    assert torch.equal(got.aux_hidden_state, torch.cat([hs[2], hs[4]], dim=-1))


def test_only_prefill_on_rank_zero_is_dumped(attached, states):
    model, out = attached
    for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE):
        forward(model, [("hsx-req-a", 0, 1)], states, "list", mode=mode)
    assert not list(out.iterdir())
    model._hsx_dump.rank = 1
    forward(model, [("hsx-req-a", 0, 5)], states, "list")
    assert not list(out.iterdir())
    model._hsx_dump.rank = 0
    forward(model, [("hsx-req-a", 0, 5)], states, "list", mode=ForwardMode.MIXED)
    assert [p.name for p in out.iterdir()] == ["hsx-req-a.000000000.pt"]


def test_gaps_and_missing_prefix_are_refused(attached, states):
    model, out = attached
    forward(model, [("hsx-req-b", 0, 7)], states, "list")
    with pytest.raises(dumps.DumpError, match="cover 7 tokens, expected 17"):
        dumps.read_request(str(out), "hsx-req-b", expected_len=17)
    forward(model, [("hsx-req-b", 9, 17)], states, "list")
    with pytest.raises(dumps.DumpError, match="gap in request 'hsx-req-b': piece starts at 9, expected 7"):
        dumps.read_request(str(out), "hsx-req-b")
    (out / hsx_dump_format.dump_name("hsx-req-b", 0)).unlink()
    with pytest.raises(dumps.DumpError, match="starts at token 9, not 0"):
        dumps.read_request(str(out), "hsx-req-b")
    assert dumps.remove_request(str(out), "hsx-req-b") == 1
    with pytest.raises(dumps.DumpError, match="no dump"):
        dumps.read_request(str(out), "hsx-req-b")


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
            rids=["hsx-x"],
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
    assert hsx_dump_format.dump_name("abc-1.x", 12) == "abc-1.x.000000012.pt"
    odd = hsx_dump_format.dump_name("../etc/passwd", 0)
    assert "/" not in odd and odd.startswith("rid-")


def _exec_line(block: str, namespace: dict) -> None:
    (code,) = next(b["code"] for b in sglang_patch.SGLANG_DUMP_PATCH["blocks"] if b["name"] == block)
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

    install.deploy_files(site / "sglang")  # the hook and the dump format it imports
    importlib.invalidate_caches()
    model = _model()
    _exec_line("init", {"self": model})
    assert type(model._hsx_dump).__module__ == sglang_patch.HOOK_MODULE
    assert model.layers_to_capture == LAYERS
    ids, hs = states["hsx-req-a"]
    batch = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        rids=["hsx-req-a"],
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
    assert model._hsx_dump.flush(30)
    got = dumps.read_request(str(dump_dir), "hsx-req-a", expected_len=5)
    assert torch.equal(got.hidden_state, hs[-1])



def _reference_dump(directory, batch, hidden_states, aux, layer_ids, version):
    """The hook as it was before #29 (synchronous, in the forward, format 1): what to match."""
    seq = [int(n) for n in batch.extend_seq_lens_cpu]
    packed = hook.pack_aux(aux) if hasattr(aux, "finalize") else None
    start = 0
    for rid, n, prefix in zip(batch.rids, seq, batch.extend_prefix_lens_cpu, strict=True):
        end = start + n
        rows = packed[start:end] if packed is not None else torch.cat([t[start:end] for t in aux], dim=-1)
        record = {
            "format": hsx_dump_format.FORMAT_V1,
            "rid": str(rid),
            "offset": prefix,
            "seq_len": prefix + n,
            "input_ids": batch.input_ids[start:end].clone().long(),
            "hidden_state": hidden_states[start:end].clone(),
            "aux_hidden_state": rows.clone(),
            "layer_ids": layer_ids,
            "capture_owner": hook.OWNER_HOOK,
            "sglang_version": version,
        }
        name = hsx_dump_format.dump_name(str(rid), prefix)
        tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")  # torch.save names the archive after it
        torch.save(record, tmp)
        os.replace(tmp, os.path.join(directory, name))
        start = end


def test_dumps_hold_exactly_what_the_synchronous_hook_wrote(attached, states, form, device, tmp_path_factory):
    """Read back, every field and tensor (dtype, shape, bytes) equals the synchronous format 1
    hook's (which the reader still reads: a server not restarted since); on CPU (references) and
    on the CUDA path with torch.cuda faked (pinned copies)."""
    model, out = attached
    ref = tmp_path_factory.mktemp("reference")
    for pieces in ([("hsx-req-a", 0, 5), ("hsx-req-b", 0, 7)], [("hsx-req-b", 7, 17), ("hsx-req-c", 0, 9)]):
        batch, final, _ = _batch(pieces, states)

        def collect(wrap, pieces=pieces):
            rows = [wrap(torch.cat([states[rid][1][i][s:e] for rid, s, e in pieces])) for i in LAYERS]
            if form == "list":
                return rows
            aux = form(len(LAYERS))
            for t in rows:
                aux.append(t)
            return aux

        _reference_dump(str(ref), batch, final, collect(lambda t: t), LAYERS, "0.5.23")
        batch.input_ids = device(batch.input_ids)
        model._hsx_dump.after_forward(batch, device(final), collect(device))
    assert model._hsx_dump.flush(30)
    names = sorted(p.name for p in ref.iterdir())
    assert names == sorted(p.name for p in out.iterdir()) and len(names) == 4
    for name in names:
        got, want = dumps._load(str(out / name), name.split(".")[0]), dumps._load(str(ref / name), name.split(".")[0])
        assert (got.pop("format"), want.pop("format")) == (hsx_dump_format.FORMAT, hsx_dump_format.FORMAT_V1)
        assert (got.pop("finite"), want.pop("finite")) == (True, None)  # format 2's hook checked them
        assert sorted(got) == sorted(want), name
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                mine = in_memory(got[key])  # the states the hook found finite are left in the file
                assert value.dtype == mine.dtype and torch.equal(value, mine), (name, key)
            else:
                assert got[key] == value, (name, key)



def test_cpu_states_are_kept_not_copied_and_not_mutated(attached, states, monkeypatch):
    """On CPU the hook writes straight from the tensors the forward returned (no copy), keeps them
    alive until written, never writes into them, and copies what SGLang may reuse."""
    model, out = attached
    hk = model._hsx_dump
    gate = Gate(hk, monkeypatch)
    pieces = [("hsx-req-a", 0, 5), ("hsx-req-b", 0, 7)]
    batch, final, aux_list = _batch(pieces, states)
    packed = torch.cat(aux_list, dim=-1)  # the packer form: one [tokens, k*H] tensor
    packer = _packer(packed)
    snapshot = (final.clone(), packed.clone(), batch.input_ids.clone())
    storages = {final.untyped_storage().data_ptr(), packed.untyped_storage().data_ptr()}
    assert hk.after_forward(batch, final, packer) == []
    assert gate.entered.wait(5)
    record = gate.records[0]  # what the writer is saving: the forward's own rows, not a copy
    assert record["hidden_state"].data_ptr() == final[0:5].data_ptr()
    assert record["aux_parts"][0].data_ptr() == packed[0:5].data_ptr()
    assert torch.equal(final, snapshot[0]) and torch.equal(packed, snapshot[1])
    del final, packed, packer, aux_list, record  # SGLang drops its references after the forward ...
    gate.records.clear()
    gc.collect()
    junk = [torch.full((12, 64 * k), 7.0, dtype=torch.bfloat16) for k in (1, 3) for _ in range(32)]
    assert not storages & {t.untyped_storage().data_ptr() for t in junk}  # ... the hook still holds them
    batch.input_ids.fill_(0)  # the batch's ids are SGLang's to reuse: the hook took a copy
    gate.open.set()
    assert hk.flush(30)
    for rid, s, n in (("hsx-req-a", 0, 5), ("hsx-req-b", 5, 7)):
        got = dumps.read_request(str(out), rid)
        assert torch.equal(got.hidden_state, snapshot[0][s : s + n])
        assert torch.equal(got.aux_hidden_state, snapshot[1][s : s + n])
        assert torch.equal(got.input_ids, snapshot[2][s : s + n])
    assert hk.stats()["held_bytes"] == 0

    # a packed buffer SGLang hands every pass (a decode graph's aux buffer) is copied, not kept
    batch, final, aux_list = _batch([("hsx-req-c", 0, 9)], states)
    buffer = torch.cat(aux_list, dim=-1)
    batch.aux_hidden_states_buffer = buffer
    want = buffer.clone()
    gate.open.clear()
    gate.entered.clear()
    hk.after_forward(batch, final, _packer(buffer))
    assert gate.entered.wait(5)
    buffer.fill_(0)  # the next pass writes into it
    gate.open.set()
    assert hk.flush(30)
    assert torch.equal(dumps.read_request(str(out), "hsx-req-c", expected_len=9).aux_hidden_state, want)




def test_only_requests_of_our_client_are_dumped(attached, states, monkeypatch):
    """SGLang sends requests of its own through the same forward: GET /health runs a one-token
    generate (rid HEALTH_CHECK_<hex>), the start-up warm-up one /generate (a uuid rid). No client
    of ours reads or sweeps their files (dumps.stale_names touches RID_PREFIX rids only), so
    dumping them leaves a file in the RAM directory for good: only RID_PREFIX rids are dumped, the
    rows of the others skipped in place, and a pass with none of ours costs nothing."""
    model, out = attached
    hk = model._hsx_dump
    assert hsx_dump_format.RID_PREFIX == dumps.RID_PREFIX == "hsx-"
    batch, final, aux = _batch([("hsx-req-a", 0, 5), ("hsx-req-b", 0, 7), ("hsx-req-c", 0, 9)], states)
    batch.rids = ["HEALTH_CHECK_5f0c2a9e", "hsx-req-b", "hsx-req-c"]
    assert hk.after_forward(batch, final, aux) == []
    assert hk.flush(30)
    assert sorted(p.name for p in out.iterdir()) == ["hsx-req-b.000000000.pt", "hsx-req-c.000000000.pt"]
    for rid, n in (("hsx-req-b", 7), ("hsx-req-c", 9)):  # their own rows, after the skipped ones
        got = dumps.read_request(str(out), rid, expected_len=n)
        assert torch.equal(got.input_ids, states[rid][0][:n])
        assert torch.equal(got.hidden_state, states[rid][1][-1][:n])
        assert torch.equal(got.aux_hidden_state, torch.cat([states[rid][1][i][:n] for i in LAYERS], -1))
    dumps.remove_request(str(out), "hsx-req-b")
    dumps.remove_request(str(out), "hsx-req-c")

    def untouched(*args):
        raise AssertionError("a pass with no request of ours reached the writer")

    monkeypatch.setattr(hk.writer, "admit", untouched)
    monkeypatch.setattr(hk.writer, "submit", untouched)
    batch, final, aux = _batch([("hsx-req-a", 0, 5), ("hsx-req-c", 0, 9)], states)
    batch.rids = ["HEALTH_CHECK_77aa01", "0f4e1d2c3b4a59687766554433221100"]  # health, warm-up
    dumped = hk.stats()["dumped"]
    assert hk.after_forward(batch, final, aux) == []
    assert hk.flush(30)
    assert list(out.iterdir()) == [] and hk.stats()["dumped"] == dumped
