"""What reading a dump can fail with (extraction/sglang/dumps.py and the modules it is split into).

Contract: every problem with a dump file the client reads is a DumpError naming the file (or the
request) and the problem; the backend turns it into the sample's failure:
- DumpIncomplete: not every piece is in place yet (none, a gap, fewer tokens than sent): waited
  for (dumps.wait_request), a failure only once the wait times out;
- DumpWriteFailed: the server's hook left a `.failed` marker for a piece: the request is asked
  again at once with a new rid;
- any other DumpError is final: the pieces are renamed into place whole, so a piece refused now
  stays refused, and the sample fails at once. A dump that shrinks or a disk that fails under the
  read (or under the copy into the shard, extraction/shards/filebytes.py) is one of these.
"""

from __future__ import annotations


class DumpError(ValueError):
    """A dump is missing, incomplete or inconsistent."""


class DumpIncomplete(DumpError):
    """Not every piece of the request is in place yet (none, a gap, fewer tokens): wait for it."""


class DumpWriteFailed(DumpError):
    """The server's hook could not write a piece (its `.failed` marker says why): ask again now."""
