"""`hsx extract` options: one table feeds argparse and the YAML config file; the CLI wins.

The job unit runs extraction from a config file, people run it from a shell; both must accept
exactly the same options with the same checks, so each option is declared once here.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, fields
from typing import Any

from hsx.layout import DEFAULT_DUMP_DIR

# The dataset's row bound (extraction/inputs/dataset.py holds the why); a literal here so that checking
# the options imports nothing heavy (the dataset module imports torch).
DEFAULT_MAX_ROW_BYTES = 8 << 20

BACKENDS = ("hf", "sglang")
PUBLISHERS = ("auto", "process", "thread")
DTYPE_CHOICES = ("bf16", "fp16", "fp32")
# Seconds the sglang backend waits for a request's dump after its reply: the server's hook writes
# behind the reply with up to HSX_DUMP_BUDGET_MB (default 4096 MiB) queued, ~14 s on a ~300 MiB/s
# disk, plus the queueing in front of it (docs/sglang_hook.md).
DEFAULT_DUMP_TIMEOUT = 120.0


class ConfigError(ValueError):
    """A bad option value or config file; the message names the option and the source."""


def read_api_key(path: str) -> str:
    """The SGLang API key in `path` (one line; surrounding whitespace dropped); ConfigError if the file
    cannot be read or holds no usable key (empty, or with inner whitespace, which no header carries)."""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            key = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"api_key_file {path}: cannot read it: {getattr(e, 'strerror', None) or e}") from None
    if not key or any(c.isspace() for c in key) or not key.isprintable() or not key.isascii():
        raise ConfigError(f"api_key_file {path}: holds no usable API key (one line of printable ASCII)")
    return key


def default_dump_dir() -> str:
    """The sglang backend's dump directory when no option names one: $HSX_DUMP_DIR, else RAM
    (hsx.layout.DEFAULT_DUMP_DIR, the roles' default too)."""
    return os.environ.get("HSX_DUMP_DIR") or DEFAULT_DUMP_DIR


def parse_bytes(value: Any) -> int:
    """'10G', '512MiB', '2.5T', 1000 -> bytes (powers of 1024 for K/M/G/T, with or without 'iB')."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int | float):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgtp]?)(i?b)?\s*", str(value), re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {value!r} (e.g. 500G, 2T, 1048576)")
    power = " kmgtp".index(m.group(2).lower() or " ")
    return int(float(m.group(1)) * 1024**power)


@dataclass
class ExtractConfig:
    """Every `hsx extract` option. None = unset (a default or a derived value applies)."""

    model: str | None = None
    dataset: str | None = None
    output: str | None = None
    backend: str = "hf"
    server_url: str | None = None
    dump_dir: str | None = None
    api_key_file: str | None = None
    layers: str = "auto"
    layer_convention: str = "sglang"
    dtype: str = "bf16"
    device: str = "cpu"
    cpu_threads: int | None = None
    max_length: int | None = None
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES
    batch_size: int = 8
    concurrency: int = 8
    dump_timeout: float = DEFAULT_DUMP_TIMEOUT
    publisher: str = "auto"  # who writes the shards (extraction/runner/publish.py)
    reserve_bytes: int | None = None
    max_consecutive_errors: int = 20
    retries: int = 3
    retry_backoff: float = 1.0
    shard_index: int = 0
    num_shards: int = 1
    buckets: int | None = None  # None: run.json's, else hsx.buckets.DEFAULT_BUCKETS (a new run)
    assign: str | None = None  # this node's buckets ("0-255,512-767"); None: the legacy split above
    limit: int | None = None
    status_interval: float = 3.0
    metrics_textfile_dir: str | None = None  # node_exporter's textfile directory (extraction/runner/metrics.py)
    progress: str = "auto"  # auto | on | lines | off (extraction/runner/progress.py)
    progress_interval: float = 60.0  # seconds between progress lines in a log (progress.py)

    def check(self) -> None:
        missing = [n for n in ("model", "dataset", "output") if not getattr(self, n)]
        if missing:
            raise ConfigError(f"missing required option(s): {', '.join('--' + m for m in missing)}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.backend == "sglang" and not self.server_url:
            raise ConfigError("--backend sglang needs --server-url")
        if self.backend == "sglang" and self.api_key_file:
            read_api_key(self.api_key_file)
        if self.dtype not in DTYPE_CHOICES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        for name in ("batch_size", "concurrency", "num_shards", "max_consecutive_errors"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.dump_timeout > 0:
            raise ConfigError(f"--dump-timeout must be > 0 seconds, got {self.dump_timeout}")
        for name in ("max_length", "limit", "cpu_threads", "max_row_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if not 0 <= self.shard_index < self.num_shards:
            raise ConfigError(f"--shard-index must be in 0..{self.num_shards - 1}, got {self.shard_index}")
        self.check_split()
        if self.retries < 0:
            raise ConfigError(f"--retries must be >= 0, got {self.retries}")
        if self.publisher not in PUBLISHERS:
            raise ConfigError(f"--publisher must be one of {', '.join(PUBLISHERS)}, got {self.publisher!r}")
        if self.metrics_textfile_dir is not None and not os.path.isabs(self.metrics_textfile_dir):
            raise ConfigError(f"--metrics-textfile-dir must be an absolute path, got {self.metrics_textfile_dir!r}")
        if self.progress not in ("auto", "on", "lines", "off"):
            raise ConfigError(f"--progress must be auto, on, lines or off, got {self.progress!r}")
        if not self.progress_interval >= 0:
            raise ConfigError(f"--progress-interval must be >= 0 seconds, got {self.progress_interval}")

    def check_split(self) -> None:
        """--buckets/--assign against --shard-index/--num-shards: one split or the other."""
        from hsx.buckets import MAX_BUCKETS, AssignError, check_buckets, parse_assign

        try:
            if self.buckets is not None:
                check_buckets(self.buckets, "--buckets")
        except AssignError as e:
            raise ConfigError(str(e)) from None
        try:  # the range against run.json's count is checked when the run starts (resume.run_buckets)
            if self.assign is not None:
                parse_assign(self.assign, self.buckets or MAX_BUCKETS)
        except AssignError as e:
            raise ConfigError(f"--assign: {e}") from None
        if self.assign is not None and self.num_shards > 1:
            raise ConfigError(
                "--assign and --num-shards are two ways to split the dataset: give one (--assign with "
                "--buckets for a new run; --shard-index/--num-shards only to resume an output made with them)"
            )

    @property
    def partial(self) -> bool:
        """True when this node runs part of the dataset (--assign, or --num-shards > 1)."""
        return self.assign is not None or self.num_shards > 1


_CONVERTERS: dict[str, Any] = {
    "max_length": int,
    "max_row_bytes": parse_bytes,
    "cpu_threads": int,
    "batch_size": int,
    "concurrency": int,
    "dump_timeout": float,
    "reserve_bytes": parse_bytes,
    "max_consecutive_errors": int,
    "retries": int,
    "retry_backoff": float,
    "shard_index": int,
    "num_shards": int,
    "buckets": int,
    "limit": int,
    "status_interval": float,
    "progress_interval": float,
}

_HELP = {
    "model": "model directory (config, weights, tokenizer with chat template)",
    "dataset": "JSONL conversations (ShareGPT or OpenAI shape)",
    "output": "output directory (run.json, index.jsonl, shards/, status.json, errors.jsonl); made if absent, "
    "but its parent must exist",
    "backend": "hf (in-process transformers) or sglang (patched server)",
    "server_url": "SGLang server URL (sglang backend)",
    "dump_dir": "directory the patched SGLang server dumps into (sglang backend; default $HSX_DUMP_DIR, "
    f"else {DEFAULT_DUMP_DIR}: RAM)",
    "api_key_file": "file holding the SGLang server's API key (its --api-key), sent as 'Authorization: Bearer' "
    "(sglang backend; the Ansible roles use /etc/hsx/sglang-api-key)",
    "layers": "capture layers: auto = [2, N//2, N-3], or a,b,c (optionally 'specforge:a,b,c')",
    "layer_convention": "numbering of explicit --layers: sglang (= HF hidden_states index) or specforge (+1)",
    "dtype": "hidden-state dtype",
    "device": "hf backend device (cpu, cuda, cuda:1)",
    "cpu_threads": "torch threads for the forward on a CPU device; default: every core but one per writer "
    "thread and one for the tokenizer (or OMP_NUM_THREADS when set)",
    "max_length": "cut samples to this many tokens; default: the model's context (config.json's "
    "max_position_embeddings), each sample cut by it recorded in errors.jsonl (kind truncated). A resume "
    "may tighten it (samples done keep theirs; run.json's bound_history records it), never loosen it",
    "max_row_bytes": "a dataset row (JSONL line) longer than this many bytes is a row error, never parsed "
    "(e.g. 16M; default 8M)",
    "batch_size": "samples per forward (hf); sglang: the plan's unit only (requests stream, --concurrency in flight)",
    "concurrency": "requests in flight (sglang)",
    "dump_timeout": "seconds to wait for a request's dump files after its reply (sglang; default 120: "
    "the server's hook writes behind the reply, with up to HSX_DUMP_BUDGET_MB queued: 4096 MiB at "
    "~300 MiB/s is ~14 s, plus the queueing)",
    "publisher": "who writes the shards: process (a writer process forked before the model loads, "
    "fed through shared memory), thread (writer threads in this process), or auto (the default: "
    "process for the hf backend, thread for sglang); same shards either way",
    "reserve_bytes": "keep at least this much free (e.g. 200G); default max(2%% of fs, 10 shards)",
    "max_consecutive_errors": "abort after this many failed samples in a row",
    "retries": "retries per sample before it is logged as failed",
    "retry_backoff": "first retry delay in seconds (doubles each time)",
    "shard_index": "this node's part of the dataset (0-based)",
    "num_shards": "number of nodes splitting the dataset by a hash of the sample id (the legacy split: "
    "outputs made with it resume with it; new fleets use --buckets/--assign)",
    "buckets": "the number of work units the run's samples fall into by a hash of the sample id; fixed "
    "when the run is created (run.json; default 1024, or what run.json records)",
    "assign": "the buckets this node runs, e.g. 0-255,512-767 (default: every sample); may change "
    "between runs (a resume runs the buckets given now)",
    "limit": "process at most this many of this node's samples",
    "status_interval": "seconds between status.json updates",
    "metrics_textfile_dir": "node_exporter's textfile directory (Debian: /var/lib/prometheus/node-exporter): "
    "the run's metrics go there too, as hsx-<key>.prom, beside OUTPUT/metrics.prom",
    "progress": "auto: a tqdm bar on a terminal, else one progress line every --progress-interval seconds "
    "(a systemd journal, a log file); on: the bar; lines: the lines; off: neither (the closing summary "
    "is always printed)",
    "progress_interval": "seconds between progress lines when they are printed (--progress auto off a "
    "terminal, or lines); 0: only the first line and the closing summary",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options default to None so a value from the config file is only overridden when given."""
    parser.add_argument("--config", help="YAML file with any of these options (the command line wins)")
    for f in fields(ExtractConfig):
        flag = "--" + f.name.replace("_", "-")
        text = _HELP.get(f.name)
        if text and f.default is not None and "(default" not in text:  # argparse's default is None (see above)
            text += f" (default: {f.default})".replace("%", "%%")
        kwargs: dict[str, Any] = {"default": None, "help": text, "dest": f.name}
        if f.name in _CONVERTERS:
            kwargs["type"] = _CONVERTERS[f.name]
        if f.name == "backend":
            kwargs["choices"] = BACKENDS
        if f.name == "dtype":
            kwargs["choices"] = DTYPE_CHOICES
        if f.name == "publisher":
            kwargs["choices"] = PUBLISHERS
        parser.add_argument(flag, **kwargs)


def load_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: config must be a mapping of option: value")
    return data


def build_config(args: argparse.Namespace | dict[str, Any]) -> ExtractConfig:
    """Defaults <- YAML (--config) <- command line; converts and checks every value."""
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    names = {f.name for f in fields(ExtractConfig)}
    merged: dict[str, Any] = {}
    path = given.get("config")
    if path:
        for key, value in load_yaml(path).items():
            name = str(key).replace("-", "_")
            if name not in names:
                raise ConfigError(f"{path}: unknown option {key!r}")
            merged[name] = value
    for name in names:
        if given.get(name) is not None:
            merged[name] = given[name]
    source = path or "command line"
    for name, value in list(merged.items()):
        if value is None:
            continue
        conv = _CONVERTERS.get(name)
        try:
            if conv is not None:
                merged[name] = conv(value)
            elif name == "layers" and isinstance(value, list):
                merged[name] = ",".join(str(int(v)) for v in value)
            else:
                merged[name] = str(value) if not isinstance(value, str) else value
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{source}: option {name!r}: {e}") from None
    for name in ("model", "dataset", "output", "api_key_file", "metrics_textfile_dir"):
        if merged.get(name):
            merged[name] = os.path.expanduser(merged[name])
    if merged.get("backend") == "sglang" and not merged.get("dump_dir"):
        merged["dump_dir"] = default_dump_dir()
    cfg = ExtractConfig(**merged)
    cfg.check()
    return cfg
