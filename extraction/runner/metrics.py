"""The run's Prometheus metrics: a node_exporter textfile written beside every status.json.

Contract:
- `MetricsReporter` is the run's StatusReporter (hsx/status.py) that, each time status.json is
  written (every --status-interval seconds and at each change of state), also writes
  `OUTPUT/metrics.prom` and, with --metrics-textfile-dir DIR, `DIR/hsx-<key>.prom` (one file per
  output directory: `<key>` is hsx.textfile.textfile_key(output), so a resume rewrites the same file and two
  runs on one host never share one).
- The values are rendered from the very dict written to status.json (`render`), so a scrape and
  `hsx status --json` cannot disagree. Each file is replaced atomically: a temp of our own kind in
  the same directory (`.<name>.<pid>.<tag>.tmp`: hidden, not `*.prom`, so the textfile collector
  never reads a half-written file), created O_EXCL|O_NOFOLLOW, chmod 0644 (node_exporter runs as
  another user), renamed relative to the directory's fd (a link planted at the file's name is
  replaced, never written through). prometheus_client's write_to_textfile is not used: it opens
  a guessable temp name with a plain open(), which follows a link planted there, and the runner
  may run as root in a directory other users can write.
- Writing metrics never fails the run: an error is logged once per file and the run goes on.

Every series carries `output` (the output directory), the key operators already know from
`hsx status OUT`. Names follow Prometheus's conventions (`hsx_` prefix, base units, `_total` for
counters); `promtool check metrics` is clean (tests/unit/test_metrics.py).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from hsx.fsutil import DIR_FLAGS, open_nofollow, unlink_quiet
from hsx.layout import temp_name
from hsx.status import STATES, StatusReporter
from hsx.textfile import textfile_name

METRICS_NAME = "metrics.prom"
FILE_MODE = 0o644
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL


def run_id(output_dir: str, created_at: str) -> str:
    """A run's id: the output directory and its run.json's creation time (resumes keep it). The
    path's own bytes are hashed (os.fsencode): a path need not be UTF-8 (same id for one that is)."""
    raw = os.fsencode(os.path.abspath(output_dir)) + b"\0" + created_at.encode("utf-8", "surrogateescape")
    return hashlib.sha256(raw).hexdigest()[:12]


def label_text(value: Any) -> str:
    """A label's value as UTF-8 text: a path's bytes that are not UTF-8 as \\xNN escapes (a
    path is bytes; Prometheus text is UTF-8), anything else as str() gives it."""
    raw = os.fsencode(value) if isinstance(value, str) else str(value).encode("utf-8", "surrogateescape")
    return raw.decode("utf-8", "backslashreplace")


def run_info(cfg: Any, manifest: Any) -> dict[str, str]:
    """hsx_run_info's labels from the run's config (ExtractConfig) and manifest (RunManifest)."""
    return {
        "model": str(manifest.model),
        "layers": ",".join(str(i) for i in manifest.layer_ids),
        "dtype": str(manifest.dtype),
        "run_id": run_id(cfg.output, manifest.created_at),
        "shard_index": str(cfg.shard_index),
        "num_shards": str(cfg.num_shards),
        # The per-run textfile's name: how the stale alert joins node_textfile_mtime_seconds.
        "textfile": textfile_name(cfg.output),
    }


class _Snapshot(Collector):
    """The families of one status snapshot (see render)."""

    def __init__(self, status: dict[str, Any], info: dict[str, str], extra: dict[str, float | None]):
        self.status, self.info, self.extra = status, info, extra

    def collect(self) -> Iterator[Metric]:
        s, out = self.status, {"output": label_text(self.status.get("output", ""))}

        def gauge(name: str, doc: str, value: Any) -> Iterator[Metric]:
            if isinstance(value, int | float) and not isinstance(value, bool):
                g = GaugeMetricFamily(name, doc, labels=["output"])
                g.add_metric([out["output"]], float(value))
                yield g

        def counter(name: str, doc: str, value: Any) -> Iterator[Metric]:
            c = CounterMetricFamily(name, doc, labels=["output"])
            c.add_metric([out["output"]], float(value or 0))
            yield c

        info = InfoMetricFamily("hsx_run", "The run: model, layers, dtype, run id, shard index and count, textfile name.",
                                labels=["output"])
        info.add_metric([out["output"]], {k: label_text(v) for k, v in self.info.items()})
        yield info
        state = GaugeMetricFamily("hsx_state", "The run's state (status.json's): 1 for the current one.",
                                  labels=["output", "state"])
        for name in STATES:
            state.add_metric([out["output"], name], 1.0 if s.get("state") == name else 0.0)
        yield state
        yield from gauge("hsx_samples_done", "Samples of this node's run done (verified shards), this process's "
                         "and those found at its start.", s.get("done"))
        yield from gauge("hsx_samples_planned", "Samples this node's run must do (status.json's total).",
                         s.get("total"))
        yield from counter("hsx_samples_written", "Shards this process wrote.", s.get("written"))
        yield from counter("hsx_samples_failed", "Samples this process gave up on (errors.jsonl).", s.get("errors"))
        yield from counter("hsx_written_bytes", "Shard bytes this process wrote.", s.get("bytes_written"))
        yield from gauge("hsx_samples_per_second", "Samples written per second by this process.",
                         s.get("samples_per_s"))
        yield from gauge("hsx_tokens_per_second", "Tokens written per second by this process.",
                         s.get("tokens_per_s"))
        yield from gauge("hsx_eta_seconds", "Seconds until the run is done at the recent rate.", s.get("eta_s"))
        yield from gauge("hsx_output_free_bytes", "Free bytes of the output's filesystem (for the run).",
                         s.get("free_bytes"))
        yield from gauge("hsx_output_reserve_bytes", "Bytes the run keeps free: below reserve + the next "
                         "shard it pauses.", s.get("reserve_bytes"))
        yield from gauge("hsx_remaining_bytes", "Bytes the run still has to write (samples left times the "
                         "mean shard size so far, or the shard estimate before any).", self.extra.get("remaining"))
        yield from gauge("hsx_last_progress_timestamp_seconds", "When this process last wrote a shard (its "
                         "start while it wrote none), Unix time.", self.extra.get("last_progress"))
        yield from gauge("hsx_process_start_time_seconds", "When this runner process started, Unix time "
                         "(changes at each restart).", self.extra.get("started"))
        yield from gauge("hsx_resume_bad_shards", "Indexed shards that failed verification at this "
                         "process's start (they are redone).", s.get("resume_bad_shards"))


def render(status: dict[str, Any], info: dict[str, str], extra: dict[str, float | None]) -> bytes:
    """The exposition text of one status snapshot (the dict written to status.json); `info` the
    hsx_run_info labels, `extra` remaining/last_progress/started (None: series left out)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(status, info, extra))
    return generate_latest(registry)


def write_textfile(directory: str, name: str, data: bytes) -> None:
    """`directory/name` replaced atomically, mode 0644, nothing below `directory` followed (see the
    module's contract). No fsync: rewritten every few seconds, a lost update costs nothing."""
    dfd = os.open(directory, DIR_FLAGS)
    try:
        tmp = temp_name(name)
        try:
            fd = open_nofollow(tmp, _NEW_FILE, FILE_MODE, dir_fd=dfd, path=os.path.join(directory, tmp))
            with open(fd, "wb") as f:
                os.fchmod(f.fileno(), FILE_MODE)  # whatever the umask: node_exporter reads it as its own user
                f.write(data)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            unlink_quiet(tmp, dir_fd=dfd)
            raise
    finally:
        os.close(dfd)


class MetricsReporter(StatusReporter):
    """StatusReporter that writes the metrics files with every status.json (module contract).

    `info` labels hsx_run_info; `shard_estimate` gives the bytes of one shard before any is
    written (the disk guard's estimate); `textfile_dir` is --metrics-textfile-dir (None: only
    OUTPUT/metrics.prom); `log` hears each file's first failure."""

    def __init__(
        self,
        output_dir: str,
        total: int,
        skipped_existing: int,
        reserve_bytes: int,
        *,
        info: dict[str, str],
        shard_estimate: Callable[[], int],
        textfile_dir: str | None,
        log: Callable[[str], None],
    ):
        super().__init__(output_dir, total, skipped_existing, reserve_bytes)
        self.info = info
        self.shard_estimate = shard_estimate
        self.textfile_dir = textfile_dir
        self.log = log
        self.last_progress: float | None = None
        self._failed: set[str] = set()

    def add_written(self, tokens: int, nbytes: int) -> None:
        super().add_written(tokens, nbytes)
        self.last_progress = time.time()

    def remaining_bytes(self, status: dict[str, Any]) -> int:
        left = max(int(status.get("total") or 0) - int(status.get("done") or 0), 0)
        written, nbytes = int(status.get("written") or 0), int(status.get("bytes_written") or 0)
        per_shard = nbytes / written if written else self.shard_estimate()
        return int(left * per_shard)

    def write(self) -> dict[str, Any]:
        data = super().write()
        extra = {
            "remaining": self.remaining_bytes(data),
            "last_progress": round(self.last_progress or self.started, 3),
            "started": round(self.started, 3),
        }
        text = render(data, self.info, extra)
        targets = [(self.output_dir, METRICS_NAME)]
        if self.textfile_dir:
            targets.append((self.textfile_dir, textfile_name(self.output_dir)))
        for directory, name in targets:
            try:
                write_textfile(directory, name, text)
            except OSError as e:
                path = os.path.join(directory, name)
                if path not in self._failed:  # once per file: a full disk must not flood the log
                    self._failed.add(path)
                    self.log(f"cannot write the metrics file {path}: {e}; the run goes on")
        return data
