"""EAGLE-3 capture layers: the one place that knows how the peers number them.

Canonical ids (what run.json records, what every backend captures) use SGLang's convention:
id i = the residual-stream input of decoder layer i = HF ``hidden_states[i]`` (index 0 is the
embedding output; HF's last entry, after the final norm, is never a capture layer). SpecForge
writes the same layers one lower (its ``[1, N//2-1, N-4]`` is SGLang's ``[2, N//2, N-3]``).

SGLang's ``set_eagle3_layers_to_capture(ids)`` adds 1 to each id it is given (0.5.5-0.5.10
always; 0.5.13+ only when ids[0] == 1), i.e. it expects SpecForge-numbered ids from a draft
config; the dump hook should use canonical ids directly and never go through that method.
"""

from __future__ import annotations

from collections.abc import Sequence

CANONICAL = "sglang"
CONVENTIONS = {
    "sglang": 0,  # input of layer i = HF hidden_states[i]
    "hf": 0,  # HF hidden_states index: same numbers as sglang
    "specforge": 1,  # SpecForge/EAGLE-3 configs: canonical = id + 1
}


class LayerSpecError(ValueError):
    """Bad --layers value; the message says what and why."""


def default_layer_ids(num_layers: int) -> list[int]:
    """SGLang's EAGLE-3 default [2, N//2, N-3]; refuses models too small for three distinct layers.

    SGLang captures with ``if i in layers_to_capture``, so a repeated id is captured once and
    the aux state would be 2H instead of 3H; e.g. N=6 gives [2, 3, 3]. Rather than invent a
    different default, ask for explicit ids.
    """
    ids = [2, num_layers // 2, num_layers - 3]
    if num_layers < 7 or len(set(ids)) != len(ids):
        raise LayerSpecError(
            f"the default capture layers [2, N//2, N-3] for a {num_layers}-layer model are {ids}, "
            "not three distinct layers inside the model; pass explicit ids, e.g. --layers 1,3,4"
        )
    return ids


def to_canonical(ids: Sequence[int], convention: str) -> list[int]:
    """Convert ids written in `convention` to canonical (sglang) ids."""
    if convention not in CONVENTIONS:
        raise LayerSpecError(f"unknown layer convention {convention!r}; use one of {', '.join(CONVENTIONS)}")
    return [int(i) + CONVENTIONS[convention] for i in ids]


def from_canonical(ids: Sequence[int], convention: str) -> list[int]:
    """Canonical ids written in `convention` (e.g. for a SpecForge draft config)."""
    if convention not in CONVENTIONS:
        raise LayerSpecError(f"unknown layer convention {convention!r}; use one of {', '.join(CONVENTIONS)}")
    return [int(i) - CONVENTIONS[convention] for i in ids]


def validate(ids: Sequence[int], num_layers: int) -> list[int]:
    """Canonical ids must be distinct, increasing, and in 1..N-1.

    0 (the embedding output) is refused: SGLang's capture adds `hidden_states + residual`, and the
    residual does not exist before layer 0, so the sglang backend could never produce it.
    """
    ids = [int(i) for i in ids]
    if not ids:
        raise LayerSpecError("no capture layers given")
    bad = [i for i in ids if not 1 <= i < num_layers]
    if bad:
        raise LayerSpecError(
            f"capture layer(s) {bad} out of range for a {num_layers}-layer model "
            f"(sglang convention: 1..{num_layers - 1}, the input of that layer)"
        )
    if sorted(set(ids)) != ids:
        raise LayerSpecError(f"capture layers must be distinct and increasing, got {ids}")
    return ids


def parse_layers(spec: str | Sequence[int] | None, num_layers: int, convention: str = CANONICAL) -> list[int]:
    """`--layers` value -> canonical ids. 'auto'/None -> default; 'a,b,c' or a list -> explicit.

    A spec may carry its convention as a prefix, e.g. 'specforge:1,2,3'; the prefix wins over
    `convention`.
    """
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "auto")):
        return default_layer_ids(num_layers)
    if isinstance(spec, str):
        text = spec.strip()
        if ":" in text:
            convention, text = (p.strip() for p in text.split(":", 1))
        try:
            raw = [int(p) for p in text.split(",") if p.strip()]
        except ValueError:
            raise LayerSpecError(
                f"--layers must be 'auto' or comma-separated integers, got {spec!r}"
            ) from None
    else:
        raw = [int(i) for i in spec]
    return validate(to_canonical(raw, convention), num_layers)
