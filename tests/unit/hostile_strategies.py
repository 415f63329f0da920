"""Hostile values the test_hostile_* modules share: a lone surrogate, and the hypothesis strategies for
text as scraped data has it and for JSON made of it; `deep_nesting(n)`, JSON nested n deep (the input
that makes a recursive parser raise RecursionError)."""

from __future__ import annotations

from hypothesis import strategies as st

LONE = "\ud83d"  # the first half of an emoji: what a scraper that cut a UTF-16 string leaves

# Text as scraped data has it: any code point incl. lone surrogates and control characters.
TEXT = st.text(st.characters(exclude_categories=[]), max_size=12) | st.lists(
    st.sampled_from([LONE, "\udc00", "\ude00", "\x00", "\x1b", "\u2028", "\ufeff", "a", "\U0001f600"]),
    max_size=6,
).map("".join)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT
JSON = st.recursive(
    SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(TEXT, kids, max_size=4), max_leaves=12
)


def deep_nesting(n: int) -> bytes:
    """A JSON array nested `n` deep."""
    return b"[" * n + b"]" * n
