"""Hidden-state shards: the format, the atomic writer, the index and the verifier.

Stable API used by the runner, the CLI and tests. `format` is stdlib-only (it ships to hosts
through module_utils); `writer` and the deep verifier need torch.
"""

from extraction.shards.format import (
    FORMAT_VERSION,
    INDEX_NAME,
    MANIFEST_NAME,
    QUARANTINE_DIR,
    SHARD_KEYS,
    SHARDS_DIR,
    IndexEntry,
    ManifestError,
    load_index,
    read_index,
    shard_relpath,
)
from extraction.shards.manifest import RunManifest, manifest_mismatches, read_manifest, write_manifest

# The writer needs torch (~2 s to import on these hosts): loaded on first use, so that `hsx status`,
# `hsx verify` and the other read-only commands start at once.
_WRITER_NAMES = frozenset({"DiskFullError", "ManifestMismatchError", "ShardDataError", "ShardWriter",
                           "remove_orphan_temps"})


def __getattr__(name: str):
    if name in _WRITER_NAMES:
        from extraction.shards import writer

        return getattr(writer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FORMAT_VERSION",
    "INDEX_NAME",
    "MANIFEST_NAME",
    "QUARANTINE_DIR",
    "SHARDS_DIR",
    "SHARD_KEYS",
    "DiskFullError",
    "IndexEntry",
    "ManifestError",
    "ManifestMismatchError",
    "RunManifest",
    "ShardDataError",
    "ShardWriter",
    "load_index",
    "manifest_mismatches",
    "read_index",
    "read_manifest",
    "remove_orphan_temps",
    "shard_relpath",
    "write_manifest",
]
