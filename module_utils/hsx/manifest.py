"""run.json: what a run extracted, so a resume never mixes two runs in one output directory."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .buckets import MAX_BUCKETS
from .fsutil import LinkRefused, atomic_write_bytes, read_nofollow
from .layout import FORMAT_VERSION, HIDDEN_DTYPES, INDEX_NAME, MANIFEST_NAME


class ManifestError(Exception):
    """run.json is missing or unreadable: the directory is not a run (an I/O or usage error)."""


def read_manifest_dict(output_dir: str) -> dict[str, Any]:
    """run.json as a dict; ManifestError (naming the path) when it is missing, unreadable, not a
    regular file (a link or a FIFO there is neither followed nor waited on) or not an object."""
    path = os.path.join(output_dir, MANIFEST_NAME)
    try:
        data = json.loads(read_nofollow(path).decode("utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"{output_dir}: not an extraction run (no {MANIFEST_NAME})") from None
    except PermissionError as e:
        raise ManifestError(f"{path}: cannot read: {e.strerror}") from None
    except LinkRefused as e:  # a link or a FIFO planted there: never followed, never waited on
        raise ManifestError(str(e)) from None
    except RecursionError:
        raise ManifestError(f"{path}: unreadable run manifest: JSON nested too deeply") from None
    except (OSError, ValueError) as e:
        raise ManifestError(f"{path}: unreadable run manifest: {e}") from None
    if not isinstance(data, dict):
        raise ManifestError(f"{path}: run manifest is not a JSON object")
    return data


# Compared by manifest_mismatches: everything that changes what a shard means.
_IGNORED = ("created_at", "extra")


@dataclass
class RunManifest:
    """The run's identity. `extra` is free-form (host, batch size...) and never compared."""

    model: str
    hidden_size: int
    num_layers: int
    layer_ids: list[int]
    layer_convention: str  # e.g. "hf_hidden_states_index" (HF hidden_states[i] = input of layer i)
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    revision: str | None = None
    final_normed: bool = True
    vocab_size: int | None = None
    tokenizer_hash: str | None = None
    chat_template_hash: str | None = None
    dataset_path: str | None = None
    dataset_hash: str | None = None
    # Work units (hsx.buckets): fixed when the run is made; None in a run.json made before them
    # (its nodes split by --shard-index/--num-shards, and resume so).
    buckets: int | None = None
    format_version: int = FORMAT_VERSION
    created_at: str = field(default_factory=lambda: _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"))
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_aux(self) -> int:
        """k: how many captured layers aux_hidden_state concatenates."""
        return len(self.layer_ids)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = MANIFEST_NAME) -> RunManifest:
        """Build from a parsed run.json; unknown keys go to `extra` so newer files still load."""
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in data.items() if k in names}
        unknown = {k: v for k, v in data.items() if k not in names}
        known["extra"] = {**dict(known.get("extra") or {}), **unknown}
        try:
            manifest = cls(**known)
        except TypeError as e:
            raise ManifestError(f"{source}: invalid run manifest: {e}") from None
        problems = manifest.problems()
        if problems:
            raise ManifestError(f"{source}: invalid run manifest: {'; '.join(problems)}")
        return manifest

    def problems(self) -> list[str]:
        out = []
        if not isinstance(self.hidden_size, int) or self.hidden_size <= 0:
            out.append(f"hidden_size must be a positive integer, got {self.hidden_size!r}")
        if not isinstance(self.num_layers, int) or self.num_layers <= 0:
            out.append(f"num_layers must be a positive integer, got {self.num_layers!r}")
        if not isinstance(self.layer_ids, list) or not all(isinstance(i, int) for i in self.layer_ids):
            out.append(f"layer_ids must be a list of integers, got {self.layer_ids!r}")
        elif not self.layer_ids:
            out.append("layer_ids must not be empty")
        if self.dtype not in HIDDEN_DTYPES:
            out.append(f"dtype must be one of {', '.join(HIDDEN_DTYPES)}, got {self.dtype!r}")
        if self.buckets is not None and (
            isinstance(self.buckets, bool) or not isinstance(self.buckets, int) or not 1 <= self.buckets <= MAX_BUCKETS
        ):
            out.append(f"buckets must be an integer in 1..{MAX_BUCKETS}, got {self.buckets!r}")
        if not isinstance(self.format_version, int) or self.format_version > FORMAT_VERSION:
            out.append(f"format_version {self.format_version!r} is newer than this code ({FORMAT_VERSION})")
        return out


def write_manifest(output_dir: str | os.PathLike[str], manifest: RunManifest) -> None:
    """Write run.json atomically (creates the output directory if needed)."""
    output_dir = os.fspath(output_dir)
    problems = manifest.problems()
    if problems:
        raise ManifestError(f"refusing to write an invalid run manifest: {'; '.join(problems)}")
    os.makedirs(output_dir, exist_ok=True)
    data = json.dumps(manifest.to_dict(), indent=2, sort_keys=True).encode("utf-8") + b"\n"
    atomic_write_bytes(os.path.join(output_dir, MANIFEST_NAME), data)


def read_manifest(output_dir: str | os.PathLike[str]) -> RunManifest:
    """The run's manifest; ManifestError names the path when it is missing or invalid."""
    output_dir = os.fspath(output_dir)
    return RunManifest.from_dict(read_manifest_dict(output_dir), os.path.join(output_dir, MANIFEST_NAME))


# Which dataset file a run reads: a change is harmless while the output holds no sample of it
# (a dataset fixed after a first run whose rows were all errors), and refused after that.
DATASET_FIELDS = ("dataset_path", "dataset_hash")


def mismatched_fields(existing: RunManifest, wanted: RunManifest) -> list[str]:
    """The names of the fields manifest_mismatches reports, sorted."""
    a, b = existing.to_dict(), wanted.to_dict()
    return [name for name in sorted(set(a) | set(b)) if name not in _IGNORED and a.get(name) != b.get(name)]


def manifest_mismatches(existing: RunManifest, wanted: RunManifest) -> list[str]:
    """One human-readable line per field that differs (created_at and extra are ignored)."""
    a, b = existing.to_dict(), wanted.to_dict()
    return [
        f"{name}: existing run has {a.get(name)!r}, this run wants {b.get(name)!r}"
        for name in mismatched_fields(existing, wanted)
    ]


# --- the fingerprint: what ties an index line (and so its shard) to run.json -------------------
# The fields that define what a shard holds: the model and its tokenizer/template (input_ids),
# the layers captured and their convention (aux_hidden_state's k and order), hidden size, dtype,
# final norm, the format. Not created_at, not `extra` (max_length may be tightened on a resume),
# not the dataset (a fixed dataset resumes: a sample's shard depends on its own row only).
# `buckets` counts only when run.json has it (OPTIONAL_FINGERPRINT_FIELDS): a run.json made before
# buckets keeps its fingerprint, so its index lines stay its own. A node's assignment is never in it.
FINGERPRINT_FIELDS = (
    "model",
    "revision",
    "hidden_size",
    "num_layers",
    "layer_ids",
    "layer_convention",
    "dtype",
    "final_normed",
    "vocab_size",
    "tokenizer_hash",
    "chat_template_hash",
    "format_version",
    "buckets",
)
OPTIONAL_FINGERPRINT_FIELDS = ("buckets",)
_DEFAULTS = {
    f.name: f.default for f in dataclasses.fields(RunManifest) if f.default is not dataclasses.MISSING
}


def manifest_fingerprint(data: Mapping[str, Any]) -> str:
    """16 hex of the SHA-256 of run.json's FINGERPRINT_FIELDS (as a dict: RunManifest.to_dict()
    or run.json as read; a field it lacks counts as RunManifest's default). The one definition:
    the writer puts it in every index line (`run_fp`), verify and resume compare it."""
    picked = {name: data.get(name, _DEFAULTS.get(name)) for name in FINGERPRINT_FIELDS}
    for name in OPTIONAL_FINGERPRINT_FIELDS:
        if picked[name] is None:
            del picked[name]
    try:
        body = json.dumps(picked, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=repr)
    except (ValueError, RecursionError):  # run.json is data: a value nested too deeply, say
        body = repr(picked)
    return hashlib.sha256(body.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def check_fingerprints(output_dir: str, want: str | None, fingerprints: Iterable[str | None]) -> None:
    """ManifestError unless every live index entry's fingerprint (None: written before there was
    one, accepted as it always was) is run.json's: otherwise the shards hold data run.json does
    not describe (run.json edited, or lines appended from another run), and nothing may count
    them as done or move them. The message names both files, the counts and what to do.
    `want`: manifest_fingerprint of run.json (None: nothing to compare)."""
    if want is None:
        return
    total = foreign = 0
    seen: set[str] = set()
    for fp in fingerprints:
        total += 1
        if fp is not None and fp != want:
            foreign += 1
            seen.add(fp)
    if not foreign:
        return
    index, run_json = os.path.join(output_dir, INDEX_NAME), os.path.join(output_dir, MANIFEST_NAME)
    others = ", ".join(sorted(seen)[:3]) + (" ..." if len(seen) > 3 else "")
    raise ManifestError(
        f"{index}: {foreign} of {total} entries were written under another run.json (run "
        f"fingerprint {others}; {run_json} now gives {want}): one of its fields "
        f"{', '.join(FINGERPRINT_FIELDS)} differs from when those shards were written, so they "
        f"hold other data than it describes. Nothing was counted or moved: restore run.json as it "
        f"was, or extract into another --output"
    )
