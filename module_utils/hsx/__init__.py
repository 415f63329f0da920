"""hsx: the stdlib-only portable core of hidden-state extraction.

Everything a host needs to read, check and repair an output directory without torch or the
`extraction` package: the on-disk layout, the index log, run.json, atomic writes, the shard
verifier (`verify`), status.json, and the versioned source patches with SGLang's patch data.

Two ways in, one source:

- the `extraction` package, its tests and benchmarks import it as the top-level package `hsx`
  (installed with hsx-extraction, from module_utils/hsx);
- Ansible ships it to hosts as `ansible.module_utils.hsx.<module>`, only the modules a task's
  module imports and the modules those import in turn.

So that both work, every module here imports only the standard library and, inside the package,
its siblings by relative import (tests/unit/test_portable_core.py checks this). This file
imports nothing, so shipping one module never ships the rest.
"""
