"""The dump hook on synthetic SGLang batches built from the tiny model's real hidden states.

A batch here is what DeepseekV2Model.forward hands the hook: the final normed state of every
token of the batch (HF hidden_states[-1]), the aux states the model collected for the ids in
`layers_to_capture` (HF hidden_states[i]) as a list or as SGLang's real AuxHiddenStatePacker
(loaded from the released file), and a ForwardBatch-like object with rids and extend lengths.
Requests are ragged and one is chunked across two forward passes; what the reader joins back must
equal transformers' hidden_states exactly.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from extraction.sglang import dumps, hook, hsx_dump_format, install
from extraction.shards.filebytes import in_memory
from hsx import sglang_patch
from hsx.sglang_versions import SUPPORTED_VERSIONS, release_key

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


def forward(model, pieces, states, form, mode=ForwardMode.EXTEND, flush=True):
    """Mimic DeepseekV2Model.forward's tail for a batch of (rid, start, end) pieces; with `flush`,
    wait until the hook's writer has written what it took (the client's wait, in one process)."""
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
    if flush:
        assert model._hsx_dump.flush(30)
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
    (out / hsx_dump_format.dump_name("req-b", 0)).unlink()
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
    assert model._hsx_dump.flush(30)
    got = dumps.read_request(str(dump_dir), "req-a", expected_len=5)
    assert torch.equal(got.hidden_state, hs[-1])


# ---------------------------------------------------------------- off the critical path (#29)


def _batch(pieces, states):
    """A ForwardBatch-like object and the tail of the forward for (rid, start, end) pieces."""
    rows = lambda i: torch.cat([states[rid][1][i][s:e] for rid, s, e in pieces])  # noqa: E731
    batch = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        rids=[rid for rid, _, _ in pieces],
        extend_seq_lens_cpu=[e - s for _, s, e in pieces],
        extend_prefix_lens_cpu=[s for _, s, _ in pieces],
        input_ids=torch.cat([states[rid][0][s:e] for rid, s, e in pieces]),
    )
    return batch, rows(-1), [rows(i) for i in LAYERS]


class Gate:
    """Holds the hook's writer inside its save until opened (the disk made slow at will)."""

    def __init__(self, hk, monkeypatch):
        self.open, self.entered = threading.Event(), threading.Event()
        self.records = []
        real = hk._save

        def save(record, path):
            self.records.append(record)
            self.entered.set()
            assert self.open.wait(30)
            real(record, path)

        monkeypatch.setattr(hk, "_save", save)


def _in_thread(fn, *args):
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("value", fn(*args)), daemon=True)
    t.start()
    return t, result


def test_after_forward_returns_before_the_dump_is_written(attached, states, monkeypatch):
    model, out = attached
    hk = model._hsx_dump
    gate = Gate(hk, monkeypatch)
    batch, final, aux = _batch([("req-a", 0, 5), ("req-b", 0, 7)], states)
    t, result = _in_thread(hk.after_forward, batch, final, aux)
    try:
        t.join(5)
        assert not t.is_alive(), "after_forward waited for the write"
        assert result["value"] == []
        assert gate.entered.wait(5)  # the writer has it, in its own thread
        assert not list(out.glob("*.pt"))  # nothing visible until complete
    finally:
        gate.open.set()
    assert hk.flush(30)
    assert dumps.read_request(str(out), "req-a", expected_len=5).pieces == 1
    assert hk.dumped == 2 and hk.stats()["held_bytes"] == 0


def test_full_budget_makes_after_forward_wait_and_drops_nothing(tmp_path, states, monkeypatch):
    model = _model()
    # one pass of 5 + 7 tokens (hidden 64, 3 layers, bf16 + int64 ids) fits; two do not
    hk = hook.attach(model, {hook.ENV_DIR: str(tmp_path), hook.ENV_LAYERS: "1,3,4", hook.ENV_BUDGET: "0.01"})
    assert hk is not None and hk.budget == int(0.01 * 2**20)
    gate = Gate(hk, monkeypatch)
    b1, f1, a1 = _batch([("req-a", 0, 5), ("req-b", 0, 7)], states)
    b2, f2, a2 = _batch([("req-b", 7, 17), ("req-c", 0, 9)], states)
    hk.after_forward(b1, f1, a1)  # room for it: returns at once
    assert gate.entered.wait(5)
    held = hk.stats()["held_bytes"]
    assert 0 < held <= hk.budget < 2 * held
    t, _ = _in_thread(hk.after_forward, b2, f2, a2)
    t.join(0.5)
    assert t.is_alive(), "the second pass must wait for room (back-pressure)"
    gate.open.set()
    t.join(30)
    assert not t.is_alive()
    assert hk.flush(30)
    for rid, n in LENGTHS.items():  # every piece of both passes written, none dropped
        got = dumps.read_request(str(tmp_path), rid, expected_len=n)
        assert torch.equal(got.hidden_state, states[rid][1][-1])
    assert hk.dumped == 4 and hk.failed == 0 and hk.stats()["waited_s"] > 0.3
    assert hk.stats()["held_bytes"] == 0
    # a pass larger than the whole budget still goes, alone
    big = hook.attach(
        _model(), {hook.ENV_DIR: str(tmp_path / "big"), hook.ENV_LAYERS: "1,3,4", hook.ENV_BUDGET: "0.001"}
    )
    big.after_forward(b1, f1, a1)
    assert big.flush(30) and big.dumped == 2


def test_budget_setting_is_checked(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(hook, "_logged", set())
    env = {hook.ENV_DIR: str(tmp_path), hook.ENV_LAYERS: "1,3,4"}
    assert hook.attach(_model(), env).budget == hook.DEFAULT_BUDGET_MB * 2**20
    with caplog.at_level(logging.WARNING, logger="hsx_dump_hook"):
        assert hook.attach(_model(), {**env, hook.ENV_BUDGET: "lots"}) is None
    assert "HSX_DUMP_BUDGET_MB='lots' is not a number" in caplog.text


def test_write_failures_are_logged_and_the_dump_missing(attached, states, caplog, monkeypatch):
    model, out = attached
    hk = model._hsx_dump
    monkeypatch.setattr(hook, "_logged", set())
    batch, final, aux = _batch([("req-a", 0, 5)], states)
    with caplog.at_level(logging.WARNING, logger="hsx_dump_hook"):
        shutil.rmtree(out)  # the dump directory removed under the server
        assert hk.after_forward(batch, final, aux) == []
        assert hk.flush(30)
        assert "dump req-a.000000000.pt not written: FileNotFoundError: [Errno 2]" in caplog.text
        out.mkdir()
        assert not list(out.iterdir())  # neither a dump nor a marker: the client times out, asks again
        with pytest.raises(dumps.DumpError, match="no dump"):
            dumps.read_request(str(out), "req-a", expected_len=5)

        def disk_full(record, path):
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(hk, "_save", disk_full)
        batch, final, aux = _batch([("req-b", 0, 7), ("req-c", 0, 9)], states)
        assert hk.after_forward(batch, final, aux) == []
        assert hk.flush(30)
    assert hk.failed == 3 and hk.dumped == 0
    assert sorted(p.name for p in out.iterdir()) == ["req-b.000000000.failed", "req-c.000000000.failed"]
    with pytest.raises(dumps.DumpError, match="could not write this piece.*No space left on device"):
        dumps.read_request(str(out), "req-b", expected_len=7)
    t0 = time.monotonic()
    with pytest.raises(dumps.DumpWriteFailed, match="could not write"):
        dumps.wait_request(str(out), "req-c", expected_len=9, timeout=20)
    assert time.monotonic() - t0 < 5  # a marker ends the wait at once
    assert dumps.remove_request(str(out), "req-b") == 1 and dumps.remove_request(str(out), "req-c") == 1
    monkeypatch.undo()  # the writer survived its failures: the next dump is written
    forward(model, [("req-a", 0, 5)], states, "list")
    assert dumps.read_request(str(out), "req-a", expected_len=5).pieces == 1


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
    for pieces in ([("req-a", 0, 5), ("req-b", 0, 7)], [("req-b", 7, 17), ("req-c", 0, 9)]):
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


def _packer(packed):
    """What AuxHiddenStatePacker hands the hook: .finalize() -> [tokens, k*H]."""
    return SimpleNamespace(finalize=lambda: packed)


def test_cpu_states_are_kept_not_copied_and_not_mutated(attached, states, monkeypatch):
    """On CPU the hook writes straight from the tensors the forward returned (no copy), keeps them
    alive until written, never writes into them, and copies what SGLang may reuse."""
    model, out = attached
    hk = model._hsx_dump
    gate = Gate(hk, monkeypatch)
    pieces = [("req-a", 0, 5), ("req-b", 0, 7)]
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
    for rid, s, n in (("req-a", 0, 5), ("req-b", 5, 7)):
        got = dumps.read_request(str(out), rid)
        assert torch.equal(got.hidden_state, snapshot[0][s : s + n])
        assert torch.equal(got.aux_hidden_state, snapshot[1][s : s + n])
        assert torch.equal(got.input_ids, snapshot[2][s : s + n])
    assert hk.stats()["held_bytes"] == 0

    # a packed buffer SGLang hands every pass (a decode graph's aux buffer) is copied, not kept
    batch, final, aux_list = _batch([("req-c", 0, 9)], states)
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
    assert torch.equal(dumps.read_request(str(out), "req-c", expected_len=9).aux_hidden_state, want)


_EXIT_SCRIPT = r"""
import importlib.util, sys, time, types, torch
spec = importlib.util.spec_from_file_location("hsx_dump_hook", sys.argv[1])  # the one deployed file
hook = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hook)
model = types.SimpleNamespace(config=types.SimpleNamespace(num_hidden_layers=6), layers_to_capture=[])
hk = hook.attach(model, {"HSX_DUMP_DIR": sys.argv[2], "HSX_DUMP_LAYERS": "1,3,4"})
real = hk._save
def slow(record, path):
    time.sleep(0.25)
    real(record, path)
hk._save = slow
for i in range(4):
    batch = types.SimpleNamespace(forward_mode=types.SimpleNamespace(name="EXTEND"), rids=[f"r{i}"],
                                  extend_seq_lens_cpu=[64], extend_prefix_lens_cpu=[0], input_ids=torch.arange(64))
    hk.after_forward(batch, torch.full((64, 64), float(i)), [torch.full((64, 64), float(i))] * 3)
print("taken", hk.dumped, flush=True)
if sys.argv[3] == "hang":
    time.sleep(120)
"""


def test_writer_drains_at_exit_and_a_kill_loses_only_dumps_in_flight(tmp_path):
    """Daemon writer + atexit drain: a normal exit writes everything taken; SIGKILL loses what was
    in flight, never leaving a partial dump under a final name."""
    script = tmp_path / "server.py"
    script.write_text(_EXIT_SCRIPT)
    drained = tmp_path / "drained"
    proc = subprocess.run(
        [sys.executable, str(script), hook.__file__, str(drained), "exit"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "taken 0"  # all four taken before any was written ...
    for i in range(4):  # ... and all four written before the interpreter was gone
        got = dumps.read_request(str(drained), f"r{i}", expected_len=64)
        assert torch.equal(got.hidden_state, torch.full((64, 64), float(i)))
    assert sorted(p.name for p in drained.iterdir()) == [f"r{i}.000000000.pt" for i in range(4)]

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, str(script), hook.__file__, str(killed), "hang"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().startswith("taken")
        deadline = time.monotonic() + 30
        while not (killed / "r0.000000000.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finals = sorted(p.name for p in killed.glob("*.pt"))
    assert "r0.000000000.pt" in finals and len(finals) < 4  # in-flight dumps lost ...
    for name in finals:  # ... but every dump in place is whole
        dumps.read_request(str(killed), name.split(".")[0], expected_len=64)
    assert all(p.name.startswith(".") for p in killed.iterdir() if not p.name.endswith(".pt"))


def test_wait_request_wakes_on_the_rename_and_times_out(attached, states, monkeypatch):
    model, out = attached
    hk = model._hsx_dump
    watch = dumps._DirWatch(str(out))
    assert watch.ok  # inotify on this machine: the wait below is woken, not polled
    watch.close()
    gate = Gate(hk, monkeypatch)
    batch, final, aux = _batch([("req-b", 0, 7)], states)
    hk.after_forward(batch, final, aux)
    batch, final, aux = _batch([("req-b", 7, 17)], states)
    hk.after_forward(batch, final, aux)
    t, result = _in_thread(dumps.wait_request, str(out), "req-b", 17, 30.0)
    t.join(0.3)
    assert t.is_alive()  # both pieces taken, none written yet
    gate.open.set()
    t.join(30)
    got = result["value"]
    assert got.pieces == 2 and torch.equal(got.hidden_state, states["req-b"][1][-1])
    t0 = time.monotonic()
    with pytest.raises(dumps.DumpError, match=r"no dump for request 'req-x'.*\(waited 0.3s\)"):
        dumps.wait_request(str(out), "req-x", 5, timeout=0.3)
    assert 0.3 <= time.monotonic() - t0 < 3
    monkeypatch.setattr(dumps._DirWatch, "ok", property(lambda self: False))  # no inotify: polls
    forward(model, [("req-a", 0, 5)], states, "list", flush=False)
    assert dumps.wait_request(str(out), "req-a", 5, timeout=30).pieces == 1


# ---------------------------------------------------------------- the CUDA path, torch.cuda faked


class DeviceTensor(torch.Tensor):
    """A CPU tensor the hook takes for a CUDA one: is_cuda, and record_stream logged."""

    calls: list = []

    @property
    def is_cuda(self):
        return True

    def record_stream(self, stream):
        DeviceTensor.calls.append(("record_stream", self.data_ptr(), stream))


class _Queued(TorchFunctionMode):
    """Inside the side stream: a non-blocking copy is queued for the 'GPU', not run."""

    def __init__(self, cuda):
        super().__init__()
        self.cuda = cuda

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and kwargs.get("non_blocking"):
            self.cuda.calls.append(("copy", args[1].data_ptr()))
            self.cuda.queued.append((args[0], args[1]))
            return args[0]
        return func(*args, **kwargs)


class FakeCuda:
    """torch.cuda's stream and event API on a CPU-only machine, and host memory that is not pinned.
    A non-blocking copy on the side stream runs only when an event recorded after it is
    synchronized (the GPU finishing the stream's work): a writer that did not wait writes zeros."""

    def __init__(self, monkeypatch):
        self.calls = []
        self.queued = []  # (host, source), in stream order
        self.ran = 0  # how many of them have run
        self.lock = threading.Lock()
        self.capturing = False
        self.pinned = []  # shapes of the pinned tensors handed out
        self.fail_pinned_at = None  # this pinned allocation (0-based) raises, once
        cuda = self

        class Stream:
            def __init__(self, device):
                self.device = device

            def wait_stream(self, other):
                cuda.calls.append(("wait_stream", other))

        class Event:
            def __init__(self, blocking=False):
                cuda.calls.append(("event", blocking))
                self.upto = 0

            def record(self, stream):
                cuda.calls.append(("record", stream))
                self.upto = len(cuda.queued)

            def synchronize(self):
                cuda.calls.append(("synchronize", threading.current_thread().name))
                cuda.run(self.upto)

        @contextlib.contextmanager
        def stream(s):
            with _Queued(cuda):
                yield

        def pinned(hk, shape, dtype):
            if len(cuda.pinned) == cuda.fail_pinned_at:
                cuda.fail_pinned_at = None
                raise RuntimeError("cudaHostAlloc failed")
            cuda.pinned.append(tuple(shape))
            return torch.zeros(shape, dtype=dtype)

        def set_device(device):
            cuda.calls.append(("set_device", device, threading.current_thread().name))

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device: "forward-stream")
        monkeypatch.setattr(torch.cuda, "set_device", set_device)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: cuda.capturing)
        monkeypatch.setattr(hook.DumpHook, "_pinned", pinned)
        monkeypatch.setattr(DeviceTensor, "calls", self.calls)

    def run(self, upto):
        with self.lock:
            for host, source in self.queued[self.ran : upto]:
                host.copy_(source)
            self.ran = max(self.ran, upto)


@pytest.fixture(params=["cpu", "cuda-faked"])
def device(request, monkeypatch):
    """Where the forward's states live: CPU tensors, or 'CUDA' ones (FakeCuda)."""
    if request.param == "cpu":
        return lambda t: t
    FakeCuda(monkeypatch)
    return lambda t: t.as_subclass(DeviceTensor)


def _on_device(pieces, states, rids=None):
    """_batch's pass with its states 'on the GPU' (and its requests renamed, given `rids`)."""
    batch, final, aux = _batch(pieces, states)
    batch.input_ids = batch.input_ids.as_subclass(DeviceTensor)
    batch.rids = rids or batch.rids
    return batch, final.as_subclass(DeviceTensor), [t.as_subclass(DeviceTensor) for t in aux]


class Turnstile:
    """Lets the hook's writer through its saves only as many times as told."""

    def __init__(self, hk, monkeypatch):
        self.entered, self.go = threading.Semaphore(0), threading.Semaphore(0)
        real = hk._save

        def save(record, path):
            self.entered.release()
            assert self.go.acquire(timeout=30)
            real(record, path)

        monkeypatch.setattr(hk, "_save", save)

    def let(self, n):
        for _ in range(n):
            self.go.release()


def test_cuda_path_copies_on_a_side_stream_and_the_writer_waits_for_them(attached, states, monkeypatch):
    model, out = attached
    hk = model._hsx_dump
    cuda = FakeCuda(monkeypatch)
    cuda.capturing = True  # a CUDA graph being captured: not dumped, nothing taken
    assert hk.after_forward(*_on_device([("req-a", 0, 5)], states)) == []
    assert hk.flush(30) and not cuda.calls and not list(out.iterdir()) and hk.stats()["held_bytes"] == 0
    cuda.capturing = False
    gate = Gate(hk, monkeypatch)
    batch, final, aux = _on_device([("req-a", 0, 5), ("req-b", 0, 7)], states)
    sources = [final, batch.input_ids, *aux]
    assert hk.after_forward(batch, final, aux) == []
    assert gate.entered.wait(5)  # the writer is saving the first piece
    side = hk._streams[final.device]
    want = [("wait_stream", "forward-stream")]  # the side stream waits for the forward's first
    for t in sources:  # each source copied whole into pinned memory, and kept from reuse until copied
        want += [("copy", t.data_ptr()), ("record_stream", t.data_ptr(), side)]
    want += [("event", True), ("record", side)]  # a blocking event after the copies
    writer = "hsx-dump-writer"  # which sets the device, then waits for the event, then writes
    want += [("set_device", final.device, writer), ("synchronize", writer)]
    # first, on the side stream, the rows' finiteness (hsx_dump_format.rows_finite: made there, so no
    # record_stream) copied into pinned memory of its own, then the sources
    finite_copy = cuda.calls.pop(1)
    assert finite_copy[0] == "copy" and finite_copy[1] not in [t.data_ptr() for t in sources]
    assert cuda.calls == want
    assert cuda.pinned == [(final.shape[0],)] + [tuple(t.shape) for t in sources]
    assert cuda.ran == len(sources) + 1  # every copy had run before the first save
    assert torch.equal(gate.records[0]["hidden_state"], states["req-a"][1][-1])
    gate.open.set()
    assert hk.flush(30) and hk.failed == 0 and hk.stats()["held_bytes"] == 0
    for rid, n in (("req-a", 5), ("req-b", 7)):
        got = dumps.read_request(str(out), rid, expected_len=n)
        hs = states[rid][1]
        assert torch.equal(got.hidden_state, hs[-1][:n])
        assert torch.equal(got.aux_hidden_state, torch.cat([hs[i][:n] for i in LAYERS], dim=-1))
        assert got.input_ids.dtype == torch.long and torch.equal(got.input_ids, states[rid][0][:n])


def test_cuda_path_waits_for_room_and_an_oversize_pass_goes_alone(tmp_path, states, monkeypatch):
    FakeCuda(monkeypatch)
    # 520 bytes a token (bf16 final state, int64 id, 3 bf16 aux layers of 64) in 8388 bytes of budget
    env = {hook.ENV_DIR: str(tmp_path), hook.ENV_LAYERS: "1,3,4", hook.ENV_BUDGET: "0.008"}
    hk = hook.attach(_model(), env)
    turn = Turnstile(hk, monkeypatch)
    held = lambda: hk.stats()["held_bytes"]  # noqa: E731
    a = _on_device([("req-a", 0, 5), ("req-b", 0, 7)], states)  # 6240 bytes
    c = _on_device([("req-a", 0, 5)], states, rids=["late-a"])  # 2600: fits, but not beside a
    big = _on_device([("req-b", 7, 17), ("req-c", 0, 9)], states)  # 9880: more than the budget
    d = _on_device([("req-c", 0, 9)], states, rids=["late-c"])  # 4680
    assert hk.after_forward(*a) == []  # room: returns at once
    assert turn.entered.acquire(timeout=5) and held() == 6240
    t, _ = _in_thread(hk.after_forward, *c)
    t.join(0.3)
    assert t.is_alive() and held() == 6240  # back-pressure
    turn.let(2)  # a written: c goes
    t.join(5)
    assert not t.is_alive() and turn.entered.acquire(timeout=5) and held() == 2600
    t, _ = _in_thread(hk.after_forward, *big)
    t.join(0.3)
    assert t.is_alive() and held() == 2600  # the oversize pass waits until nothing is in flight ...
    turn.let(1)
    t.join(5)
    assert not t.is_alive() and turn.entered.acquire(timeout=5) and held() == 9880  # ... then goes alone
    t, _ = _in_thread(hk.after_forward, *d)
    t.join(0.3)
    assert t.is_alive() and held() == 9880  # nothing beside it
    turn.let(3)
    t.join(5)
    assert not t.is_alive()
    assert hk.flush(30) and hk.dumped == 6 and hk.failed == 0 and held() == 0
    assert hk.stats()["waited_s"] > 0.9
    written = {"req-a": "req-a", "req-b": "req-b", "req-c": "req-c", "late-a": "req-a", "late-c": "req-c"}
    for rid, src in written.items():
        got = dumps.read_request(str(tmp_path), rid, expected_len=LENGTHS[src])
        assert torch.equal(got.hidden_state, states[src][1][-1]), rid


def test_cuda_copy_failure_gives_the_room_back(tmp_path, states, monkeypatch, caplog):
    cuda = FakeCuda(monkeypatch)
    monkeypatch.setattr(hook, "_logged", set())
    env = {hook.ENV_DIR: str(tmp_path), hook.ENV_LAYERS: "1,3,4", hook.ENV_BUDGET: "0.008"}
    hk = hook.attach(_model(), env)
    a = _on_device([("req-a", 0, 5), ("req-b", 0, 7)], states)  # 6240 bytes: two do not fit together
    cuda.fail_pinned_at = 2  # the first aux part's pinned memory, after two copies were queued
    with caplog.at_level(logging.WARNING, logger="hsx_dump_hook"):
        assert hk.after_forward(*a) == []  # never raises into SGLang
    assert "batch skipped: cudaHostAlloc failed" in caplog.text
    assert len(cuda.queued) == 2 and hk.stats()["held_bytes"] == 0
    t, result = _in_thread(hk.after_forward, *a)  # had the room not come back, this would wait forever
    t.join(5)
    assert not t.is_alive() and result["value"] == []
    assert hk.flush(30) and hk.dumped == 2 and hk.failed == 0 and hk.stats()["held_bytes"] == 0
    assert torch.equal(
        dumps.read_request(str(tmp_path), "req-b", expected_len=7).hidden_state, states["req-b"][1][-1][:7]
    )


def test_wait_request_works_with_a_descriptor_above_1023(tmp_path):
    """A busy client has many files open; select() refuses a descriptor above 1023, poll() not."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        while not held or held[-1] < 1030:
            held.append(os.open(os.devnull, os.O_RDONLY))
        watch = dumps._DirWatch(str(tmp_path))
        try:
            assert watch.ok and watch.fd > 1023
            assert watch.wait("req-z.", 0.05) is False  # times out, no ValueError
            os.rename(_touch(tmp_path / "x.tmp"), tmp_path / "req-z.000000000.pt")
            assert watch.wait("req-z.", 5) is True
        finally:
            watch.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _touch(path):
    path.write_bytes(b"")
    return path


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "-inf", "1e400", "many"])
def test_budget_refuses_what_is_not_a_finite_positive_number(text):
    with pytest.raises(ValueError, match=hook.ENV_BUDGET):
        hook.parse_budget(text)


def test_budget_is_mib():
    assert hook.parse_budget("512") == 512 * 2**20
    assert hook.parse_budget("0.5") == 2**19
