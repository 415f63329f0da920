"""The layout of an output directory: names, folders, the tensors of a shard, shard and temp naming.

Output layout::

    OUTPUT/run.json                      run manifest (refuse to mix runs)
    OUTPUT/index.jsonl                   append-only log of completed samples
    OUTPUT/shards/<bucket>/<id>.pt       one torch.save dict per sample
    OUTPUT/quarantine/<bucket>/<id>.pt   shards that failed verification, + .reason.json
"""

from __future__ import annotations

import hashlib
import itertools
import operator
import os
import re

FORMAT_VERSION = 1

# --- layout ---------------------------------------------------------------------------------
MANIFEST_NAME = "run.json"
INDEX_NAME = "index.jsonl"
SHARDS_DIR = "shards"
QUARANTINE_DIR = "quarantine"
SHARD_SUFFIX = ".pt"
TEMP_PREFIX = "."
TEMP_SUFFIX = ".tmp"
REASON_SUFFIX = ".reason.json"
BUCKET_HEX_CHARS = 2  # 256 buckets: ~146 files each at 37k samples, ~4k at 1M

# Where the patched SGLang server dumps and the sglang client reads, unless told otherwise (the
# roles' hsx_dump_dir, `hsx extract --dump-dir`, $HSX_DUMP_DIR): RAM (tmpfs), so a dump never costs
# the output disk a second write. Under /run, which only root may write (no link can be planted there,
# unlike world-writable /dev/shm); the server unit makes it (RuntimeDirectory=) owned by its account.
DEFAULT_DUMP_DIR = "/run/hsx-dumps"

# What a shard's path relative to the output root looks like (`shards/<bucket>/<name>.pt`): an
# index entry whose path does not match points outside shards/ and is never touched.
# Anchored with \A and \Z, never ^ and $: `$` also matches before a trailing newline, so
# re.match(r"^x$", "x\n") matches. Use fullmatch on these patterns all the same.
SHARD_RELPATH_RE = re.compile(rf"\A{SHARDS_DIR}/[0-9a-f]{{{BUCKET_HEX_CHARS}}}/[^/]+\.pt\Z")

# --- tensors in a shard ---------------------------------------------------------------------
KEY_INPUT_IDS = "input_ids"
KEY_LOSS_MASK = "loss_mask"
KEY_HIDDEN = "hidden_state"
KEY_AUX = "aux_hidden_state"
SHARD_KEYS = (KEY_INPUT_IDS, KEY_LOSS_MASK, KEY_HIDDEN, KEY_AUX)

# dtype name (as torch spells it after "torch.") -> (legacy storage class torch.save pickles, itemsize)
DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("DoubleStorage", 8),
    "float32": ("FloatStorage", 4),
    "float16": ("HalfStorage", 2),
    "bfloat16": ("BFloat16Storage", 2),
    "int64": ("LongStorage", 8),
    "int32": ("IntStorage", 4),
    "int16": ("ShortStorage", 2),
    "int8": ("CharStorage", 1),
    "uint8": ("ByteStorage", 1),
    "bool": ("BoolStorage", 1),
}
STORAGE_DTYPES = {storage: name for name, (storage, _size) in DTYPES.items()}
HIDDEN_DTYPES = ("bfloat16", "float16", "float32")
INPUT_IDS_DTYPE = "int64"
LOSS_MASK_DTYPES = ("int64", "int32", "uint8", "bool")

_SAFE_ID = re.compile(r"\A[A-Za-z0-9_-][A-Za-z0-9._-]{0,119}\Z")
# Safe ids, each followed by "/" (which no safe id holds): many ids checked in one regex call.
_SAFE_IDS = re.compile(r"(?:[A-Za-z0-9_-][A-Za-z0-9._-]{0,119}/)*")
_UNSAFE_CHAR = re.compile(r"[^A-Za-z0-9._-]")


# --- naming ---------------------------------------------------------------------------------
def safe_name(sample_id: str) -> str:
    """A file-name stem for a sample id, injective: safe ids map to themselves, others get a hash.

    Safe = [A-Za-z0-9._-], not starting with '.', at most 120 chars. Anything else becomes a
    sanitised prefix + '~' + 16 hex of its SHA-1; '~' never occurs in a safe id, so two ids
    cannot share a name.
    """
    if not isinstance(sample_id, str) or not sample_id:
        raise ValueError(f"sample id must be a non-empty string, got {sample_id!r}")
    if _SAFE_ID.fullmatch(sample_id):
        return sample_id
    digest = hashlib.sha1(sample_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    prefix = _UNSAFE_CHAR.sub("_", sample_id)[:64].lstrip(".")
    return f"{prefix}~{digest}"


def bucket_of(sample_id: str) -> str:
    """Subfolder for a sample: a SHA-1 prefix of its id, so folders stay small and balanced."""
    return hashlib.sha1(sample_id.encode("utf-8", "surrogatepass")).hexdigest()[:BUCKET_HEX_CHARS]


def shard_relpath(sample_id: str) -> str:
    """Path of a sample's shard relative to the output root: `shards/<bucket>/<safe id>.pt`."""
    return f"{SHARDS_DIR}/{bucket_of(sample_id)}/{safe_name(sample_id)}{SHARD_SUFFIX}"


_HEXDIGEST = operator.methodcaller("hexdigest")
_RELPATH_OF_SAFE = f"{SHARDS_DIR}/{{0:.{BUCKET_HEX_CHARS}}}/{{1}}{SHARD_SUFFIX}".format  # (sha1 hex, safe id)


def are_shard_relpaths(sample_ids: list[str], paths: list[str]) -> bool:
    """Whether paths[i] == shard_relpath(sample_ids[i]) for every i (lists of equal length).

    The same answer as comparing shard_relpath one by one, in C-level passes when every id is
    safe (a run's usual ids): one regex over them all, then SHA-1s and names by map.
    """
    if len(sample_ids) != len(paths):
        return False
    joined = "/".join(sample_ids) + "/"
    if _SAFE_IDS.fullmatch(joined) and joined.count("/") == len(sample_ids):  # no id holds a "/"
        hexes = map(_HEXDIGEST, map(hashlib.sha1, map(str.encode, sample_ids)))
        return list(map(_RELPATH_OF_SAFE, hexes, sample_ids)) == paths
    try:
        return list(map(shard_relpath, sample_ids)) == paths
    except ValueError:  # an id that names no shard (empty, not a string)
        return False


_TEMP_TAG = os.urandom(4).hex()  # with the pid and a counter: unique without a getrandom per shard
_TEMP_COUNTER = itertools.count()


def temp_name(final_name: str) -> str:
    """A temp name next to `final_name`: hidden, unique, and never ending in `.pt`."""
    return f"{TEMP_PREFIX}{final_name}.{os.getpid()}.{_TEMP_TAG}{next(_TEMP_COUNTER):x}{TEMP_SUFFIX}"


def is_temp_name(name: str) -> bool:
    return name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX)


def is_shard_name(name: str) -> bool:
    return name.endswith(SHARD_SUFFIX) and not name.startswith(TEMP_PREFIX)
