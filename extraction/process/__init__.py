"""The run's process machinery, below any one stage: forked children, the heap, the output lock.

childgen: a generator run in a forked child, its items read back through a pipe; heap: glibc's
malloc told to keep what a CPU forward frees; outputlock: one `hsx extract` per output (flock).
"""
