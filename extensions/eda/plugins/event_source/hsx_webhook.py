"""hsx_webhook: ansible-rulebook's built-in webhook source (eda.builtin.webhook), with its secrets read
from files and no way to listen beyond loopback unauthenticated (README, "Self-healing"; docs/security.md).

Anyone who can post to the self-healing webhook can ask for a recovery or a takeover. The built-in
source takes its token or HMAC secret as a literal argument (so it would sit in the rulebook or its vars
file) and accepts an empty one. This source:
- reads the bearer token from `token_file` and/or the HMAC secret from `hmac_secret_file`: regular files,
  not links, readable by their owner only, non-empty (one line; surrounding whitespace dropped);
- refuses to start when `host` is not a loopback address and neither secret is set;
- passes everything else (`port`, `certfile`, `keyfile`, `cafile`, `capath`, `hmac_algo`, `hmac_header`,
  `hmac_format`) to the built-in source, which does the serving and the checking.

Alertmanager's side: `http_config.authorization.credentials_file` (the same token) in the webhook receiver.
Run it from the checkout with `ansible-rulebook -S extensions/eda/plugins/event_source ...`.
"""

from __future__ import annotations

import ipaddress
import os
import stat
from typing import Any

from ansible_rulebook.event_source.webhook import main as webhook_main

PASSED = ("port", "certfile", "keyfile", "password", "cafile", "capath", "hmac_algo", "hmac_header", "hmac_format")


class SecretError(ValueError):
    """A secret file that must not be used (the message names it and why)."""


def read_secret(path: str, what: str) -> str:
    """The one-line secret in `path`: a regular file (not a link) that only its owner may read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise SecretError(f"hsx_webhook: {what} {path}: {exc.strerror} (a link is refused)") from exc
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"hsx_webhook: {what} {path}: not a regular file")
        if st.st_mode & 0o077:
            raise SecretError(f"hsx_webhook: {what} {path}: readable by others (mode {stat.S_IMODE(st.st_mode):o}); "
                              f"chmod 600 it")
        secret = f.read(4097).decode("utf-8", "replace").strip()
    if not secret or len(secret) > 4096 or "\n" in secret:
        raise SecretError(f"hsx_webhook: {what} {path}: must hold one non-empty line (at most 4096 characters)")
    return secret


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def webhook_args(args: dict[str, Any]) -> dict[str, Any]:
    """The built-in source's arguments for ours (pure but for reading the secret files)."""
    host = str(args.get("host") or "127.0.0.1")
    out: dict[str, Any] = {k: args[k] for k in PASSED if args.get(k) not in (None, "")}
    out["host"] = host
    if args.get("token_file"):
        out["token"] = read_secret(str(args["token_file"]), "token_file")
    if args.get("hmac_secret_file"):
        out["hmac_secret"] = read_secret(str(args["hmac_secret_file"]), "hmac_secret_file")
    for literal in ("token", "hmac_secret"):
        if args.get(literal):
            raise SecretError(f"hsx_webhook: give {literal}_file, not {literal}: a secret belongs in a file "
                              f"only the operator can read, not in the rulebook or its vars")
    if not is_loopback(host) and "token" not in out and "hmac_secret" not in out:
        raise SecretError(f"hsx_webhook: refusing to listen on {host} without authentication: set token_file "
                          f"(or hmac_secret_file), or listen on 127.0.0.1")
    return out


async def main(queue: Any, args: dict[str, Any]) -> None:
    await webhook_main(queue, webhook_args(args))
