"""Capture-layer numbering: SGLang's default, the SpecForge +1 convention, refusals."""

from __future__ import annotations

import pytest

from extraction.inputs.layers import (
    LayerSpecError,
    default_layer_ids,
    from_canonical,
    parse_layers,
    to_canonical,
)


def test_default_is_sglangs_formula() -> None:
    assert default_layer_ids(61) == [2, 30, 58]  # DeepSeek-V3 / Kimi-K2
    assert parse_layers("auto", 61) == [2, 30, 58]
    assert parse_layers(None, 8) == [2, 4, 5]


def test_default_refused_when_layers_collide() -> None:
    # N=6 gives [2, 3, 3]: SGLang would capture 2 layers, the aux width would not be 3H.
    with pytest.raises(LayerSpecError, match=r"\[2, 3, 3\].*explicit"):
        default_layer_ids(6)


def test_specforge_ids_are_one_lower() -> None:
    # SpecForge's DeepSeek-V3 EAGLE-3 config [1, 29, 57] = SGLang's default for 61 layers.
    assert to_canonical([1, 29, 57], "specforge") == default_layer_ids(61)
    assert from_canonical([2, 30, 58], "specforge") == [1, 29, 57]
    assert parse_layers("1,29,57", 61, "specforge") == [2, 30, 58]
    assert parse_layers("specforge:1,29,57", 61) == [2, 30, 58]
    assert parse_layers("hf:2,30,58", 61) == parse_layers("2,30,58", 61, "sglang") == [2, 30, 58]
    assert parse_layers([1, 3, 4], 6) == [1, 3, 4]


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("0,2,3", r"out of range.*1\.\.5"),  # no residual before layer 0 in SGLang
        ("1,3,6", r"out of range"),
        ("3,1,4", r"distinct and increasing"),
        ("1,3,3", r"distinct and increasing"),
        ("1,x,3", r"comma-separated integers"),
        ("nope:1,2,3", r"unknown layer convention"),
        (",", r"no capture layers"),
    ],
)
def test_bad_specs_say_why(spec: str, match: str) -> None:
    with pytest.raises(LayerSpecError, match=match):
        parse_layers(spec, 6)
