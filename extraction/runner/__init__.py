"""The extraction run (`hsx extract`), as stages with one job each:

  plan.py       which samples this node runs, and the batches they run in
  resume.py     the run's manifest, the output made ready, the verified done set
  produce.py    the tokenizer, ahead of the forward (a forked process by default)
  forward.py    the backend call, with retries and the one-by-one search for a bad sample
  stream.py     the same for a server backend (sglang): a window of requests always in flight
  publish.py    the Publisher a run uses (--publisher), and the in-process one (writer threads)
  publish_process.py   the writer-process Publisher (the runner's side of extraction/publish/writerproc.py)
  lifecycle.py  the run's state: signals, the pause, errors.jsonl, status, the exit status
  metrics.py    the Prometheus textfiles written with each status.json (OUTPUT/metrics.prom, the textfile dir)
  timing.py     where the time went (Runner.timings)
  core.py       the Runner: the stages wired together

Exit statuses are module_utils/hsx/exitcodes.py's; the Publisher interface is extraction/publish/publisher.py's.
"""

from extraction.runner.core import Runner
from extraction.runner.forward import make_backend
from extraction.runner.lifecycle import RunError
from extraction.runner.plan import iter_batches_for_bench

__all__ = ["RunError", "Runner", "iter_batches_for_bench", "make_backend"]
