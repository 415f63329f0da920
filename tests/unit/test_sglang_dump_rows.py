"""The hook's CPU path (#49 item 6): states written from row views without a copy, and checked for
NaN/Inf by hsx_dump_format.states_finite (the header's `finite`, which the client takes as said)."""

from __future__ import annotations

import pytest
import torch

from extraction.sglang import dumps, hook, hsx_dump_format

RID, H = "hsx-abcd0123-s-0", 8
LAYERS = [1, 2, 3]


def _header(rows: int) -> dict:
    return {
        "format": hsx_dump_format.FORMAT,
        "rid": RID,
        "offset": 0,
        "seq_len": rows,
        "layer_ids": LAYERS,
        "capture_owner": hook.OWNER_HOOK,
        "sglang_version": "0.5.23",
    }


def _block(rows: int, dtype=torch.bfloat16) -> torch.Tensor:
    """One buffer holding a pass's final state and its 3 aux states side by side, as the stand-in
    server's null model and a packer hand them over: [rows, 4H], the states column slices of it."""
    return torch.randn(rows, 4 * H, generator=torch.Generator().manual_seed(rows)).to(dtype)


def _storage(t: torch.Tensor) -> tuple[int, int]:
    base = t.untyped_storage().data_ptr()
    return base, base + t.untyped_storage().nbytes()


@pytest.mark.parametrize("form", ["packed", "list"])
def test_row_views_of_a_wider_buffer_are_written_where_they_lie(tmp_path, monkeypatch, form):
    """A state whose rows are contiguous but not the tensor (a column slice of a wider buffer) is
    written an iovec a row, straight from the buffer, not copied first (it cost ~0.5 s of a core a
    GiB in the hook's writer): the file equals the one written from contiguous copies, and every
    iovec of the states points into the buffer."""
    block = _block(10)
    ids = torch.arange(10)
    hidden, packed = block[:, :H], block[:, H:]
    parts = [packed] if form == "packed" else [block[:, H * (i + 1) : H * (i + 2)] for i in range(3)]
    assert not hidden.is_contiguous() and not any(p.is_contiguous() for p in parts)
    want = tmp_path / "want"
    hsx_dump_format.write_dump(
        str(want), _header(10), (ids, hidden.contiguous(), [p.contiguous() for p in parts])
    )
    tables = []
    row_iovecs = hsx_dump_format._row_iovecs

    def spy(states, rows):
        table = row_iovecs(states, rows)
        tables.append(table)
        return table

    monkeypatch.setattr(hsx_dump_format, "_row_iovecs", spy)
    got = tmp_path / hsx_dump_format.dump_name(RID, 0)
    hsx_dump_format.write_dump(str(got), _header(10), (ids, hidden, parts))
    assert got.read_bytes() == want.read_bytes()
    lo, hi = _storage(block)
    assert len(tables) == 2 and all(((t[:, 0] >= lo) & (t[:, 0] + t[:, 1] <= hi)).all() for t in tables)
    record = dumps._load(str(got), RID)
    assert torch.equal(record["hidden_state"], hidden) and torch.equal(record["aux_hidden_state"], packed)


def test_a_state_whose_rows_are_not_contiguous_is_copied_and_written_the_same(tmp_path):
    """A transposed view (its rows strided) cannot be written from where it lies: copied first."""
    ids = torch.arange(6)
    hidden = torch.randn(H, 6).to(torch.bfloat16).t()
    parts = [torch.randn(H, 6).to(torch.bfloat16).t() for _ in range(3)]
    path = tmp_path / hsx_dump_format.dump_name(RID, 0)
    hsx_dump_format.write_dump(str(path), _header(6), (ids, hidden, parts))
    record = dumps._load(str(path), RID)
    assert torch.equal(record["hidden_state"], hidden)
    assert torch.equal(record["aux_hidden_state"], torch.cat(parts, dim=-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_states_finite_finds_every_nan_and_inf_in_any_block_and_nothing_else(monkeypatch, dtype):
    """The CPU path's check, by dtype, over column views of one buffer, checked a block of rows at
    a time (made small here: 4 rows of the final state, 1 of the aux states): the largest finite values, subnormals
    and zeros of both signs pass; NaN, +Inf, -Inf are found in the first row, a middle block's
    edge and the last value, in the final state and in an aux state."""
    monkeypatch.setattr(hsx_dump_format, "_CHECK_BLOCK", 4 * H * torch.empty((), dtype=dtype).element_size())
    block = _block(10, dtype)
    info = torch.finfo(dtype)
    block[0, :6] = torch.tensor([info.max, -info.max, info.tiny / 2, -0.0, 0.0, info.min], dtype=dtype)
    hidden, aux = block[:, :H], block[:, H:]
    assert hsx_dump_format.states_finite(hidden, [aux])
    assert hsx_dump_format.states_finite(hidden, list(aux.split(H, dim=-1)))
    for bad in (float("nan"), float("inf"), -float("inf")):
        for row, col in ((0, 0), (4, H - 1), (5, 0), (9, 4 * H - 1), (9, H)):
            dirty = block.clone()
            dirty[row, col] = bad
            got = hsx_dump_format.states_finite(dirty[:, :H], [dirty[:, H:]])
            assert got is False, (bad, row, col)
            assert not hsx_dump_format.rows_finite(dirty[:, :H], [dirty[:, H:]]).all()  # the GPU path agrees


def test_states_finite_hands_what_it_cannot_read_to_rows_finite():
    """Another dtype (float64) or rank goes to torch's amax/amin check, with the same answers."""
    hidden = torch.randn(4, H, dtype=torch.float64)
    assert hsx_dump_format.states_finite(hidden, [hidden.clone()])
    dirty = hidden.clone()
    dirty[3, 2] = float("nan")
    assert not hsx_dump_format.states_finite(hidden, [dirty])
    assert hsx_dump_format.states_finite(torch.zeros(0, H, dtype=torch.bfloat16), [])


def test_the_hooks_cpu_writer_flags_with_states_finite_not_torch(tmp_path, monkeypatch):
    """The CPU path's flag comes from states_finite (numpy, one thread): torch's amax/amin, with
    its OpenMP team spinning beside the server's, cost ~3x as much; it is the CUDA path's."""
    monkeypatch.setattr(hsx_dump_format, "rows_finite", lambda *a: pytest.fail("rows_finite on the CPU path"))
    model = type("M", (), {})()
    model.config = type("C", (), {"num_hidden_layers": 6})()
    model.layers_to_capture = []
    hk = hook.attach(model, {hook.ENV_DIR: str(tmp_path), hook.ENV_LAYERS: "1,3,4"})
    block = _block(5)
    clean = hook._Piece("clean", 0, [block[:, :H], torch.arange(5), block[:, H:]])
    dirty_block = block.clone()
    dirty_block[2, 3 * H] = float("inf")
    dirty = hook._Piece("dirty", 0, [dirty_block[:, :H], torch.arange(5), dirty_block[:, H:]])
    hk._write_pass(hook._Pass([clean, dirty], 0, LAYERS, hook.OWNER_HOOK, "test"))
    assert dumps._load(str(tmp_path / hsx_dump_format.dump_name("clean", 0)), "clean")["finite"] is True
    assert dumps._load(str(tmp_path / hsx_dump_format.dump_name("dirty", 0)), "dirty")["finite"] is False
