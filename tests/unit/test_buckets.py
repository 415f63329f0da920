"""Issue #39: hsx.buckets, the work units and their assignment (pure functions, stdlib only)."""

from __future__ import annotations

import pytest

from extraction.runner.plan import assigned_to
from hsx.buckets import (
    AssignError,
    bucket_of,
    check_assignment,
    derive_assignment,
    format_ranges,
    id_hash,
    parse_assign,
)


@pytest.mark.parametrize(("hosts", "buckets"), [(1, 1024), (2, 1024), (3, 1024), (7, 1024), (8, 8), (5, 13)])
def test_the_derived_assignment_puts_every_bucket_on_exactly_one_host_in_near_equal_ranges(hosts, buckets) -> None:
    names = [f"node{i:02d}" for i in range(hosts)]
    got = derive_assignment(reversed(names), buckets)  # the order given does not matter
    assert list(got) == names and got == derive_assignment(names, buckets)
    owned = [parse_assign(got[h], buckets) for h in names]
    assert sorted(b for mine in owned for b in mine) == list(range(buckets))
    assert all("," not in got[h] for h in names)  # one contiguous range each
    assert max(map(len, owned)) - min(map(len, owned)) <= 1
    check_assignment(got, buckets)


def test_the_derivation_of_two_hosts() -> None:
    assert derive_assignment(["b", "a"], 1024) == {"a": "0-511", "b": "512-1023"}


@pytest.mark.parametrize(
    ("hosts", "says"),
    [([], "no host"), (["a", "a"], "listed twice"), ([f"h{i}" for i in range(5)], "5 hosts but only 4 buckets")],
)
def test_the_derivation_refuses_what_it_cannot_split(hosts, says) -> None:
    with pytest.raises(AssignError, match=says):
        derive_assignment(hosts, 4)


def test_a_spec_parses_and_formats_back() -> None:
    assert parse_assign("0-2, 5,7-8", 16) == {0, 1, 2, 5, 7, 8}
    assert format_ranges({8, 7, 5, 2, 1, 0}) == "0-2,5,7-8"
    assert format_ranges([]) == ""
    assert parse_assign("15", 16) == {15}


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("", "is empty"),
        ("  ", "is empty"),
        ("1,,2", "an empty part"),
        ("1-", "'' is not a bucket number"),
        ("-1", "'' is not a bucket number"),
        ("1-2-3", "'2-3' is not a bucket number"),
        ("+1", "'\\+1' is not a bucket number"),
        ("٣", "is not a bucket number"),  # a non-ASCII digit
        ("3-1", "runs backwards"),
        ("16", "bucket 16 is outside 0-15"),
        ("0-3,3", "bucket 3 is listed twice"),
    ],
)
def test_a_bad_spec_is_refused_saying_what_and_where(spec, says) -> None:
    with pytest.raises(AssignError, match=says) as e:
        parse_assign(spec, 16)
    assert repr(spec) in str(e.value)


@pytest.mark.parametrize(
    ("hosts", "says"),
    [
        ({"a": "0-2", "b": "2-3"}, "bucket 2 is on both a and b"),
        ({"a": "0-1"}, r"bucket\(s\) 2-3 are on no host"),
        ({"a": "0-1", "b": "x"}, "host b: assignment 'x'"),
    ],
)
def test_a_recorded_assignment_must_hold_every_bucket_once(hosts, says) -> None:
    with pytest.raises(AssignError, match=says):
        check_assignment(hosts, 4, "fleet.json")


def test_buckets_use_the_one_id_hash_of_the_shard_split() -> None:
    for sid in ("a", "conv-17", "\udcff lone surrogate"):
        assert bucket_of(sid, 1024) == id_hash(sid) % 1024
        assert assigned_to(sid, id_hash(sid) % 3, 3)
