"""Who may use an admin listener, and what they may do.

Three ways in, each checked in constant time, and every refusal of credentials answered
`[auth] failed_login_delay` after the request arrived (an asyncio sleep: nobody else
waits), as a refused MQTT login is:

- HTTP Basic with a user of `[auth] password_file` that the listener names: `users` may
  read and change, `readonly_users` only read. The password is checked as the broker
  checks an MQTT login's (`Entry.verify`, PBKDF2 in a worker thread, compare_digest); a
  password once confirmed is remembered (its SHA-256, compared with compare_digest) until
  the file's entry for the user changes, so a dashboard's calls hash once, not per call.
  The password file is the broker's own: SIGHUP (`wrenmq reload`) re-reads it.
- `Authorization: Bearer <token>`: a token of the listener's `token_file` (tokens.py).
- nothing: allowed only when the listener says `anonymous = "read"` or `"write"`, which
  config.py permits on loopback listeners only.

A request without credentials is answered 401 at once (with a Basic challenge, so a
browser asks for them); wrong credentials are answered 401 after the delay. Read-only
callers get 403 for anything that changes state (the route says which do).
"""

import asyncio
import base64
import binascii
import hashlib
import hmac
import logging
import time

from .http import HttpError
from .tokens import TokenFile, TokenFileError

log = logging.getLogger("wrenmq.admin")

REALM = "wrenmq admin"
CHALLENGE = [("WWW-Authenticate", f'Basic realm="{REALM}", charset="UTF-8"')]


class Identity:
    """Who a request comes from: `name`, `how` ("user", "token" or "anonymous"), and
    whether it may change things (`write`)."""

    __slots__ = ("name", "how", "write")

    def __init__(self, name, how, write):
        self.name = name
        self.how = how
        self.write = write

    def as_dict(self):
        return {"name": self.name, "how": self.how, "write": self.write}


class AdminAuth:
    def __init__(self, broker, cfg, where):
        self.broker = broker
        self.cfg = cfg
        self.where = where
        self.users = frozenset(cfg.users)
        self.readers = frozenset(cfg.readonly_users)
        self.tokens = TokenFile(cfg.token_file) if cfg.token_file else None
        self.anonymous = None if cfg.anonymous == "none" else Identity("anonymous", "anonymous",
                                                                       cfg.anonymous == "write")
        self._logins = {}  # user -> (password file entry, sha256 of the password confirmed)
        self.refused = 0

    async def identify(self, request):
        """The request's Identity; HttpError 401 if it has none that is good."""
        header = request.headers.get("authorization")
        if header is None:
            if self.anonymous is not None:
                return self.anonymous
            raise HttpError(401, "credentials required (HTTP Basic, or Authorization: Bearer <token>)",
                            CHALLENGE)
        started = time.monotonic()
        scheme, _, value = header.strip().partition(" ")
        scheme = scheme.lower()
        who = None
        if scheme == "basic":
            who, identity = await self._basic(value.strip())
        elif scheme == "bearer":
            identity = self._bearer(value.strip())
            who = f"token {value.strip().partition('.')[0][:64]!r}"
        else:
            identity = None
        if identity is not None:
            return identity
        self.refused += 1
        log.warning("%s (admin): refused a request from %s: %s", self.where, request.peer,
                    f"{who} not accepted" if who else f"unsupported authorization scheme {scheme[:20]!r}")
        delay = self.broker.auth.delay - (time.monotonic() - started)
        if delay > 0:
            await asyncio.sleep(delay)
        raise HttpError(401, "wrong credentials", CHALLENGE)

    async def _basic(self, value):
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, ValueError, UnicodeDecodeError):
            return "malformed Basic credentials", None
        user, sep, password = decoded.partition(":")
        if not sep:
            return "malformed Basic credentials", None
        who = f"user {user[:64]!r}"
        write = user in self.users
        if not write and user not in self.readers:
            return who, None
        passwords = self.broker.auth.passwords
        entry = passwords.get(user) if passwords is not None else None
        if entry is None:
            return who, None
        digest = hashlib.sha256(password.encode("utf-8", "surrogateescape")).digest()
        known = self._logins.get(user)
        if known is not None and known[0] is entry and hmac.compare_digest(known[1], digest):
            return who, Identity(user, "user", write)
        ok = await asyncio.get_running_loop().run_in_executor(None, entry.verify, password)
        if not ok:
            return who, None
        self._logins[user] = (entry, digest)
        return who, Identity(user, "user", write)

    def _bearer(self, token):
        tokens = self.tokens
        if tokens is None or not token:
            return None
        try:
            tokens.refresh()
        except TokenFileError as e:
            log.error("%s (admin): token_file: %s; the tokens read before stay in force", self.where, e)
        scope = tokens.check(token)
        if scope is None:
            return None
        return Identity(token.partition(".")[0], "token", scope == "write")
