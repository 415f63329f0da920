"""Work units: a run's samples in a fixed number of buckets, and which buckets a node runs.

Stdlib only (it runs on the control node inside an Ansible module, and on the nodes).

Contract:
- `id_hash`: the one hash of a stable sample id (the legacy --shard-index/--num-shards split is
  `id_hash % num_shards`, a bucket is `id_hash % buckets`): the same answer whatever the
  dataset's order or the node.
- `parse_assign`: a compact range list ("0-255,512-767", "7") -> the set of bucket numbers; a
  bad spec is an AssignError naming the spec, the bad part and what a spec looks like. Strict:
  no empty part, no reversed range, no bucket outside 0..buckets-1, no bucket listed twice.
- `format_ranges` is its inverse (sorted, merged ranges).
- `derive_assignment`: hosts (sorted) -> contiguous near-equal ranges, every bucket on exactly
  one host; a pure function of (hosts, buckets).
- `check_assignment`: a recorded assignment (host -> spec) covers every bucket exactly once; a
  host may have "" (it owns no bucket: a host taken over, see hsx.fleetplan).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

DEFAULT_BUCKETS = 1024
MAX_BUCKETS = 1 << 20
SPEC_HELP = 'a comma-separated list of bucket numbers and ranges, e.g. "0-255,512-767"'


class AssignError(ValueError):
    """A bad bucket count, assignment spec or assignment; the message says what and where."""


def id_hash(sample_id: str) -> int:
    """64 bits of the SHA-256 of the id's UTF-8 (lone surrogates passed through, so every id has
    one and a valid id gets the same as with "strict")."""
    return int.from_bytes(hashlib.sha256(sample_id.encode("utf-8", "surrogatepass")).digest()[:8], "big")


def bucket_of(sample_id: str, buckets: int) -> int:
    """The bucket (0..buckets-1) a sample belongs to."""
    return id_hash(sample_id) % buckets


def check_buckets(buckets: object, where: str = "buckets") -> int:
    """`buckets` as an int in 1..MAX_BUCKETS; AssignError naming `where` otherwise."""
    if isinstance(buckets, bool) or not isinstance(buckets, int) or not 1 <= buckets <= MAX_BUCKETS:
        raise AssignError(f"{where}: the bucket count must be an integer in 1..{MAX_BUCKETS}, got {buckets!r}")
    return buckets


def _number(text: str, spec: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise AssignError(f"assignment {spec!r}: {text!r} is not a bucket number; expected {SPEC_HELP}")
    return int(text)


def parse_assign(spec: str, buckets: int) -> frozenset[int]:
    """The buckets `spec` names (see the module's contract)."""
    check_buckets(buckets)
    if not isinstance(spec, str) or not spec.strip():
        raise AssignError(f"assignment {spec!r} is empty; expected {SPEC_HELP}")
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            raise AssignError(f"assignment {spec!r}: an empty part (two commas, or one at an end); expected {SPEC_HELP}")
        lo_text, dash, hi_text = part.partition("-")
        lo = _number(lo_text.strip(), spec)
        hi = _number(hi_text.strip(), spec) if dash else lo
        if hi < lo:
            raise AssignError(f"assignment {spec!r}: range {part!r} runs backwards; write it low-high")
        if hi >= buckets:
            raise AssignError(
                f"assignment {spec!r}: bucket {hi} is outside 0-{buckets - 1} (the run has {buckets} buckets)"
            )
        new = set(range(lo, hi + 1))
        twice = new & out
        if twice:
            raise AssignError(f"assignment {spec!r}: bucket {min(twice)} is listed twice")
        out |= new
    return frozenset(out)


def format_ranges(numbers: Iterable[int]) -> str:
    """Sorted numbers as merged ranges: {0,1,2,5} -> "0-2,5"; "" for none."""
    parts: list[str] = []
    ordered = sorted(set(numbers))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def derive_assignment(hosts: Iterable[str], buckets: int = DEFAULT_BUCKETS) -> dict[str, str]:
    """Sorted hosts -> contiguous near-equal ranges (the first `buckets % n` hosts get one more);
    every bucket on exactly one host. AssignError for no host, a repeated host, or more hosts
    than buckets (a host with none would run nothing)."""
    check_buckets(buckets)
    names = list(hosts)
    ordered = sorted(set(names))
    if len(ordered) != len(names):
        raise AssignError(f"hosts: a host is listed twice in {names}")
    if not ordered:
        raise AssignError("hosts: no host to assign buckets to")
    if len(ordered) > buckets:
        raise AssignError(f"{len(ordered)} hosts but only {buckets} buckets: raise the bucket count")
    base, extra = divmod(buckets, len(ordered))
    out, start = {}, 0
    for i, host in enumerate(ordered):
        size = base + (1 if i < extra else 0)
        out[host] = format_ranges(range(start, start + size))
        start += size
    return out


def check_assignment(hosts: Mapping[str, str], buckets: int, where: str = "assignment") -> None:
    """AssignError (naming `where`) unless every host's spec parses ("" for none) and every bucket
    is on exactly one host."""
    check_buckets(buckets, where)
    owner: dict[int, str] = {}
    for host, spec in hosts.items():
        if spec == "":
            continue  # a host that owns no bucket (taken over)
        try:
            mine = parse_assign(spec, buckets)
        except AssignError as e:
            raise AssignError(f"{where}: host {host}: {e}") from None
        for b in mine:
            if b in owner:
                raise AssignError(f"{where}: bucket {b} is on both {owner[b]} and {host}")
            owner[b] = host
    missing = set(range(buckets)) - owner.keys()
    if missing:
        raise AssignError(f"{where}: bucket(s) {format_ranges(missing)} are on no host")


def host_changes(recorded: Iterable[str], hosts: Iterable[str]) -> tuple[list[str], list[str]]:
    """(new, gone): the hosts not in a recorded assignment, and those it has that are not here."""
    before, now = set(recorded), set(hosts)
    return sorted(now - before), sorted(before - now)
