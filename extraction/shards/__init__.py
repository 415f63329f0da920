"""Hidden-state shards, the torch side: the atomic writer and the deep verifier.

The format itself (layout, index, run.json, the quick and full verifiers) is the stdlib-only core
`hsx`; import it from there. `writer` and `verify.deep_check` need torch.
"""

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
    "DiskFullError",
    "ManifestMismatchError",
    "ShardDataError",
    "ShardWriter",
    "remove_orphan_temps",
]
