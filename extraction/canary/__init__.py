"""The canary (issue #51): before a recovered node's job resumes, re-extract a few samples it already
has in verified shards and compare the states with the shards.

  settings.py  the defaults: samples, the tolerance per dtype and where it comes from (stdlib)
  compare.py   the measure (relative error of a state's scale) and a sample's verdict (torch only:
               tests/bench/bench_canary_tolerance.py imports it without the runner)
  pick.py      which samples: a stable hash of the id, from finished buckets first (stdlib + hsx)
  rebuild.py   the batch each runs in: its original one (OUTPUT/batches.jsonl, runner/batchlog.py),
               rebuilt with the same rows, padding and shape, or alone where none is recorded
  check.py     the check itself, through the job's own config, inputs, tokenizer and backend
  result.py    the verdict, its record (OUTPUT/canary.json) and the exit status

`hsx canary` (extraction/commands/canary.py) runs it; roles/extraction_job/tasks/canary.yml runs that
before the job starts in a recovery.
"""
