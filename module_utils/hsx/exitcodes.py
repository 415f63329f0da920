"""The exit statuses of every `hsx` command, defined once; import them from here.

Part of the portable core: the verifier's report (hsx.verify) and every `hsx` command use them.
The job unit's YAML (roles/extraction_job) cannot import: it repeats 75 and 2 as literals, which
must stay equal to EXIT_PAUSED and EXIT_USAGE.
"""

from __future__ import annotations

EXIT_OK = 0  # done; every host ok; every shard good
EXIT_FAILED = 1  # failed: a sample, a host or a shard is not good (a rerun or a person looks)
EXIT_USAGE = 2  # usage, configuration or I/O error: nothing was done
EXIT_CRASHED = 3  # `hsx status`: a run under way by status.json whose process is gone (rerun to resume)
EXIT_INTERRUPTED = 4  # `hsx status`: a run stopped by a signal, cleanly (rerun to resume)
EXIT_CANARY_MISMATCH = 5  # `hsx canary`: this node computes other states than its shards hold (a person looks)
EXIT_PAUSED = 75  # EX_TEMPFAIL: `hsx extract` paused on a low disk; free space and run again
EXIT_SIGINT = 130  # 128 + SIGINT: stopped by Ctrl-C, cleanly (a rerun resumes)
EXIT_SIGTERM = 143  # 128 + SIGTERM: stopped by `systemctl stop` or kill, cleanly (a rerun resumes)
