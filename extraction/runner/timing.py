"""Where a run's time went: `Runner.timings`, filled by every stage, printed by the benchmarks.

Contract: seconds summed per key (`*_s`), perf_counter stamps for the start and end marks
(`*_at`), and per-thread usage as NAME_cpu_s, NAME_vcsw, NAME_ivcsw (record_usage). Recording
never blocks and never fails the run; on a platform without per-thread usage the usage is zero.
"""

from __future__ import annotations

try:
    import resource
except ImportError:  # not Unix: no usage figures in the timings
    resource = None  # type: ignore[assignment]


def new_timings() -> dict[str, float]:
    """The keys every run has. The model is ready at `ready_at`; `pipeline_end_at` is after the
    last shard is indexed; `*_cpu_at` are process CPU seconds (all threads), `*_faults_at` this
    process's minor page faults so far, at those two marks."""
    return {
        "model_load_s": 0.0,
        "forward_wait_batch_s": 0.0,
        "forward_s": 0.0,
        "forward_wait_writer_s": 0.0,  # the forward thread waiting on a full queue to the publisher
        "forward_send_s": 0.0,  # a CPU forward sending its batches to the writer process itself
        "writer_wait_copy_s": 0.0,
        "writer_publish_s": 0.0,
        "drain_s": 0.0,
        "ready_at": 0.0,
        "pipeline_end_at": 0.0,
        "ready_cpu_at": 0.0,
        "pipeline_end_cpu_at": 0.0,
        "ready_faults_at": 0.0,
        "pipeline_end_faults_at": 0.0,
    }


def minor_faults() -> float:
    """This process's minor page faults so far (0 where there is no usage)."""
    if resource is None:
        return 0.0
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def thread_usage() -> tuple[float, int, int]:
    """This thread's (CPU seconds, voluntary, involuntary context switches): a thread that waits
    on the GIL switches voluntarily, one that loses its core to another task involuntarily.
    Zeros where the platform has no per-thread usage."""
    try:
        ru = resource.getrusage(resource.RUSAGE_THREAD)  # type: ignore[union-attr]
    except (AttributeError, OSError):  # not Unix (resource None), or not Linux
        return 0.0, 0, 0
    return ru.ru_utime + ru.ru_stime, ru.ru_nvcsw, ru.ru_nivcsw


def record_usage(timings: dict[str, float], name: str, before: tuple[float, int, int]) -> None:
    """Add this thread's usage since `before` to timings as NAME_cpu_s, NAME_vcsw, NAME_ivcsw."""
    for suffix, now, then in zip(("cpu_s", "vcsw", "ivcsw"), thread_usage(), before, strict=True):
        timings[f"{name}_{suffix}"] = timings.get(f"{name}_{suffix}", 0) + now - then
