"""The two ways checking a shard can fail: bad data, or no answer because the file could not be read."""

from __future__ import annotations


class ShardBad(Exception):
    """The shard is damaged or not a shard of this run; the message is the reason."""


class ShardIOError(Exception):
    """The shard could not be read (permissions, I/O error): not evidence of bad data."""
