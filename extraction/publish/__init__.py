"""Publishing: the forward pass's batches taken to indexed shards on disk, beside the forward pass.

publisher: the Publisher interface and the BatchPublisher every publisher shares (disk guard,
NaN/Inf check, atomic shard, one index commit a batch); writerproc: the shard writer in a forked
process fed through shared memory; diskguard: stop cleanly before the disk fills. The runner's
side (which publisher a run uses, its threads) is extraction/runner/publish*.py.
"""
