r"""The project's Jinja filters (ansible.cfg: filter_plugins = filter_plugins).

hsx_systemd(value, name, kind='arg'): one operator-given value made safe for one place in a systemd
unit file (systemd.syntax(7), systemd.service(5), systemd.exec(5)), or refused with an error naming
`name` (the variable). Every value a unit template interpolates goes through it:

    kind     where                                    what is done
    arg      an ExecStart=/ExecStopPost= argument     % -> %%, $ -> $$, quoted when not plain
    command  the first word of an Exec*= line         % -> %%, quoted when not plain; must be an
                                                      absolute path without " ' \ $ (systemd
                                                      refuses those, and never expands $ there)
    env      one Environment= assignment NAME=VALUE   % -> %%, quoted when not plain; NAME checked
    word     one word of a list (RequiresMountsFor=,   % -> %%, quoted when not plain
             Documentation=)
    path     as word; must be an absolute path
    text     the rest of a line (Description=)        % -> %%
    unit     a unit name (After=, Requires=, or an    must be a unit name: [A-Za-z0-9:_.@-] and a
             Exec argument)                           unit type suffix (so plain everywhere)

A newline, carriage return, NUL or other control character (tab aside) is refused in every kind: it
would end the line and start a directive of the operator's choosing. "Quoted" is a double-quoted
string with backslash and double quote escaped by a backslash; plain is [A-Za-z0-9_@%+=:,./-]+.
% is a specifier everywhere systemd reads these values; $ is variable expansion only in Exec*=
lines (in Environment= it is literal, so it is left as it is there).

hsx_redact(result): a copy with secrets redacted by the one rule in module_utils/hsx/redact.py (loaded
from this checkout by path: this runs on the control node, where ansible.module_utils.hsx is not
importable). The same relative path holds in the collection hsx.recovery (tools/collection/build.py:
plugins/filter/ beside plugins/module_utils/hsx/), where roles call these as hsx.recovery.hsx_redact.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from ansible.errors import AnsibleFilterError

_REDACT_PATH = Path(__file__).resolve().parents[1] / "module_utils" / "hsx" / "redact.py"
_spec = importlib.util.spec_from_file_location("hsx_filters_redact", _REDACT_PATH)
_redact = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_redact)

KINDS = ("arg", "command", "env", "word", "path", "text", "unit")
_PLAIN = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_UNIT = re.compile(r"[A-Za-z0-9:_.@-]+\.(service|socket|target|mount|automount|swap|timer|path|slice|scope|device)")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_NOT_IN_EXECUTABLE = re.compile(r"[\"'\\$]")


def _quote(s: str) -> str:
    if _PLAIN.fullmatch(s):
        return s
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def systemd_escape(value, name: str, kind: str = "arg") -> str:
    """`value` escaped for `kind` (see the module's docstring); AnsibleFilterError naming `name`."""
    if kind not in KINDS:
        raise AnsibleFilterError(f"hsx_systemd: unknown kind {kind!r} for {name} (one of {', '.join(KINDS)})")
    if value is None:
        raise AnsibleFilterError(f"{name} is not set (null) but goes into a systemd unit")
    s = str(value)
    bad = _CONTROL.search(s)
    if bad:
        what = {"\n": "a newline", "\r": "a carriage return", "\x00": "a NUL byte"}.get(
            bad.group(), f"the control character {bad.group()!r}")
        raise AnsibleFilterError(
            f"{name} holds {what}, which would start a new directive in the systemd unit; refused (remove it)")
    if kind == "unit":
        if not _UNIT.fullmatch(s):
            raise AnsibleFilterError(f"{name} is {s!r}, not a systemd unit name (like hsx-extraction.service)")
        return s
    if kind in ("command", "path") and not s.startswith("/"):
        raise AnsibleFilterError(f"{name} is {s!r}, not an absolute path (a systemd unit needs one here)")
    if kind == "command" and _NOT_IN_EXECUTABLE.search(s):
        raise AnsibleFilterError(
            f"{name} is {s!r}: systemd runs no executable whose path holds a quote or a backslash, and a $ "
            "there is not expanded; use another path")
    s = s.replace("%", "%%")
    if kind == "text":
        return s
    if kind == "env":
        env_name = s.split("=", 1)[0]
        if "=" not in s or not _ENV_NAME.fullmatch(env_name):
            raise AnsibleFilterError(f"{name}: {env_name!r} is not an environment variable name (letters, digits, _)")
    if kind == "arg":
        s = s.replace("$", "$$")
    return _quote(s) if s else '""'


def redact(value):
    """A copy of `value` (a result, an argv list, a command line) with secrets redacted."""
    return _redact.redact_tree(value)


class FilterModule:
    def filters(self):
        return {"hsx_systemd": systemd_escape, "hsx_redact": redact}
