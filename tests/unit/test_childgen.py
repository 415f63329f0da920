"""ChildGenerator: a generator run in a forked child, read back through a pipe."""

from __future__ import annotations

import gc
import os

import pytest

from extraction.process.childgen import ChildFailed, ChildGenerator


def test_items_come_from_another_process_in_order():
    got = list(ChildGenerator(lambda: ((os.getpid(), i) for i in range(5))))
    assert [i for _, i in got] == list(range(5))
    assert {pid for pid, _ in got} != {os.getpid()}


def test_a_failure_in_the_child_is_raised_here_with_its_reason():
    def items():
        yield 1
        raise ValueError("row 7 cannot be rendered")

    with pytest.raises(ChildFailed, match="ValueError: row 7 cannot be rendered"):
        list(ChildGenerator(items))


def test_objects_from_before_the_fork_are_left_out_of_garbage_collections():
    """A full collection writes to every object it tracks, which would copy every page this
    process still shares with the child: they are frozen before the fork."""
    gc.unfreeze()
    before = len(gc.get_objects())
    child = ChildGenerator(lambda: iter(()))
    try:
        assert gc.get_freeze_count() >= before * 0.9
    finally:
        list(child)
    assert gc.get_freeze_count() > 0  # not at the end of the items (a collection would stall the reader)
    child.close()
    assert gc.get_freeze_count() == 0  # thawed by close()
    gc.freeze()  # a caller's own freeze is left alone
    frozen = gc.get_freeze_count()
    try:
        child = ChildGenerator(lambda: iter(()))
        list(child)
        child.close()
        assert gc.get_freeze_count() > frozen // 2  # not thawed (0)
    finally:
        gc.unfreeze()
