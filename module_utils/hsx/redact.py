"""Secrets out of what we report: the one rule for command lines, environments and results.

A *secret name* is a flag or variable name one of whose parts (split at `-`, `_` and `.`, compared
without case) ends with key, keys, token, secret, secrets, password, passwd, credential or
credentials: --api-key, --hf-token, HF_TOKEN, OPENAI_API_KEY, apiKey, --db-password, PGPASSWORD,
AWS_SECRET_ACCESS_KEY, model.api_key. Not secret: --tokenizer, --max-total-tokens (a count),
--ssl-keyfile (a path), PWD.

What is replaced by REDACTED, in an argv list or in command-line text:

    --NAME VALUE   -> --NAME <redacted>   the next argument, unless it is a long option (`--...`)
    --NAME=VALUE   -> --NAME=<redacted>   (one dash too: -password x, -token=x)
    NAME=VALUE     -> NAME=<redacted>     an environment assignment (`env HF_TOKEN=... cmd`)
    scheme://user:PASSWORD@host -> scheme://user:<redacted>@host   anywhere in an argument
    Bearer TOKEN   -> Bearer <redacted>   (an Authorization header)

An argument that holds a whole command (`sh -c "vllm serve --api-key K"`) is redacted as text;
text is split into words at whitespace, a quoted word ('a b' or "a b") being one word.
An environment mapping loses the values of its secret names; a result (dicts and lists, as a
module or a role returns it) loses the string values of secret keys, its argv lists are redacted
as argv and its other strings as text.

Not recognised: short options (-p VALUE), secrets in JSON or config-file arguments, or a value
given positionally. The rule errs on the side of hiding: a secret-named flag that takes no value
hides the argument after it. Patterns that match processes (gpu_processes) see the redacted line.

Stdlib only (module_utils: shipped to hosts as ansible.module_utils.hsx.redact).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

REDACTED = "<redacted>"
SECRET_WORDS = ("key", "keys", "token", "secret", "secrets", "password", "passwd", "credential",
                "credentials")

_PARTS = re.compile(r"[-_.]+")
_FLAG = re.compile(r"(-{1,2})([A-Za-z0-9][A-Za-z0-9_.-]*)(=.*)?", re.S)
_ASSIGN = re.compile(r"([A-Za-z_][A-Za-z0-9_.-]*)=(.*)", re.S)
_URL_CREDENTIALS = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^\s/@:]*:)[^\s/@]+@")
_WORD = re.compile(r"""(?:"[^"]*"|'[^']*'|\S)+""")


def is_secret_name(name: str) -> bool:
    """The flag or variable name (without dashes) names a secret, by the rule above."""
    return any(part.endswith(SECRET_WORDS) for part in _PARTS.split(name.lower()) if part)


def _word(word: str) -> tuple[str, bool]:
    """(the word redacted, whether the next word is a secret value)."""
    flag = _FLAG.fullmatch(word)
    if flag and is_secret_name(flag.group(2)):
        if flag.group(3) is None:
            return word, True
        return f"{flag.group(1)}{flag.group(2)}={REDACTED}", False
    assign = _ASSIGN.fullmatch(word)
    if assign and not word.startswith("-") and is_secret_name(assign.group(1)):
        return f"{assign.group(1)}={REDACTED}", False
    if word.lower() == "bearer":
        return word, True
    return _URL_CREDENTIALS.sub(lambda m: f"{m.group(1)}{REDACTED}@", word), False


def _hides(next_word: str) -> bool:
    return not next_word.startswith("--")


def redact_text(text: str) -> str:
    """A command line (or any text) with secret values replaced; everything else as it was."""
    out, pos, hide = [], 0, False
    for m in _WORD.finditer(text):
        out.append(text[pos : m.start()])
        word = m.group(0)
        if hide and _hides(word):
            out.append(REDACTED)
            hide = False
        else:
            shown, hide = _word(word)
            out.append(shown)
        pos = m.end()
    out.append(text[pos:])
    return "".join(out)


def redact_argv(argv: Iterable[str]) -> list[str]:
    """An argument vector with secret values replaced (an argument holding spaces as text)."""
    out, hide = [], False
    for arg in argv:
        arg = str(arg)
        if hide and _hides(arg):
            out.append(REDACTED)
            hide = False
            continue
        shown, hide = _word(arg)
        if shown == arg and any(c.isspace() for c in arg):
            shown = redact_text(arg)
        out.append(shown)
    return out


def redact_env(env: Mapping[str, object]) -> dict[str, object]:
    """An environment with the values of secret names replaced (other string values as text)."""
    return {k: REDACTED if is_secret_name(str(k)) else redact_text(v) if isinstance(v, str) else v
            for k, v in env.items()}


def redact_tree(value: object) -> object:
    """A copy of a result (dicts, lists, strings) with every secret replaced, by the rule above: a
    secret key's string value, a list of strings as argv, any other string as text."""
    if isinstance(value, Mapping):
        return {k: REDACTED if isinstance(v, str) and v and is_secret_name(str(k)) else redact_tree(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, str) for v in value):
            return redact_argv(value)
        return [redact_tree(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value
