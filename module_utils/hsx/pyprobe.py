"""Ask another Python interpreter on the host (a venv's: SGLang's, the one that builds the
extraction's venv) what it has, without importing what it is asked about where that would run code.

A module runs under Ansible's interpreter; the package in question lives under another. Each probe
is a small program run as `PYTHON -c PROGRAM ARG...` with the working directory / (a package in the
caller's directory is never found instead), printing one JSON object on its last line.

Part of the stdlib-only core: shipped to Ansible hosts as ansible.module_utils.hsx.pyprobe.
"""

from __future__ import annotations

import json
import typing as t

# Where a top-level package is and which distribution version it has, without importing it
# (find_spec of a top-level package does not run it; metadata reads dist-info). ARG: the package.
PACKAGE_PROBE = r"""
import importlib.metadata, importlib.util, json, os, sys
name = sys.argv[1]
out = {"python": os.path.realpath(sys.executable), "package": None, "version": None, "error": None}
try:
    spec = importlib.util.find_spec(name)
except Exception as exc:
    spec, out["error"] = None, "%s: %s" % (type(exc).__name__, exc)
if spec is not None and spec.origin:
    out["package"] = os.path.dirname(spec.origin)
elif out["error"] is None:
    out["error"] = "no importable %s package" % name
try:
    out["version"] = importlib.metadata.version(name)
except importlib.metadata.PackageNotFoundError:
    pass
print(json.dumps(out))
"""

# Which of the named modules this interpreter can import (stdlib modules such as venv: importing
# them runs nothing of anyone else's). ARG...: the module names.
IMPORT_PROBE = r"""
import importlib, json, os, sys
missing = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        missing[name] = "%s: %s" % (type(exc).__name__, exc)
print(json.dumps({"python": os.path.realpath(sys.executable), "version": "%d.%d.%d" % sys.version_info[:3],
                  "missing": missing}))
"""


class ProbeError(Exception):
    """The interpreter could not be run, or did not answer with JSON: the message says which and why."""


def run_probe(run_command: t.Callable[..., tuple[int, str, str]], python: str, program: str,
              args: t.Sequence[str] = ()) -> dict:
    """Run `program` under `python` (run_command: AnsibleModule.run_command) and return the JSON
    object it printed last. ProbeError names the interpreter and what went wrong."""
    try:
        rc, out, err = run_command([python, "-c", program, *args], cwd="/", handle_exceptions=False)
    except OSError as exc:  # no such interpreter, not executable
        raise ProbeError(f"cannot run {python}: {exc.strerror or exc}") from None
    lines = out.strip().splitlines()
    if rc != 0 or not lines:
        why = (err.strip() or out.strip() or f"exit {rc}").splitlines()[-1]
        raise ProbeError(f"{python} failed (rc {rc}): {why}")
    try:
        answer = json.loads(lines[-1])
    except ValueError:
        raise ProbeError(f"{python} printed no JSON: {lines[-1][:200]!r}") from None
    if not isinstance(answer, dict):
        raise ProbeError(f"{python} printed {type(answer).__name__}, not a JSON object")
    return answer
