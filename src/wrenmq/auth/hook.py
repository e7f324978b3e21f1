"""The `[auth]` hook: password file, ACL file and the anonymous-access policy.

The assembly (wrenmq/assemble.py) always puts this hook first in the chain (`build_auth_hook`).

Authentication (CONNECT), in this order:

0. a client whose verified TLS certificate gave its user name
   (`use_identity_as_username`, `client.cert_identity`) is accepted: the
   certificate is the credential, as in Mosquitto;
1. a user name found in the password file: the password is checked there (in a
   worker thread); right -> accepted, wrong or missing -> refused (0x86 / 3.1.1: 4);
2. otherwise the `authenticate` of the hooks behind this one is asked, in
   order; the first that answers decides. Right behind this hook come the login
   sources of the config (`build_auth_sources`): `[auth.jwt]` (a password that is a
   JWT: valid -> accepted, invalid -> refused; not a JWT -> no opinion), then
   `[auth.http]` (the service's allow / deny / ignore), then the `[[hook]]`s and
   the hooks of a program that embeds the broker;
3. otherwise the policy: a client without a user name is accepted if anonymous
   access is allowed on its listener, else refused with 0x87 (3.1.1: 5); a user
   name the password file does not know is refused (0x86 / 4); with no password
   file, a user name is not checked and is treated like an anonymous client.

Every refusal by the password file or the policy for a client that sent a user
name is answered `failed_login_delay` seconds after the CONNECT arrived (an
asyncio sleep: no other client waits), the same for unknown users and wrong
passwords.

Anonymous access (`[auth] allow_anonymous`): true or false applies to every
listener. When the key is not set, anonymous clients are refused everywhere once a
password file is configured (as in Mosquitto: a password file means clients log
in); without one they are accepted on listeners bound to a loopback address only
and refused on every other listener.

Authorization, in the same order: the ACL file (below) can only refuse; then the
rules a JWT or an HTTP answer gave the client (grants.py: allow ends the question,
deny refuses, no matching rule passes it on); then the hooks; then the default,
allowed.

The ACL file (only with an `acl_file`): PUBLISH and the will need WRITE on the
topic (the router asks when the will is published, not at CONNECT), every
delivery (live, retained, queued) needs READ, SUBSCRIBE is checked as described
in `acl.py`. The hook only ever refuses (returns False) or has no opinion
(None), so hooks behind it may refuse more but never grant what the file
refuses. Decisions are cached per (session, topic) and the caches are dropped
on reload and when a client (re)connects.

`on_reload` (SIGHUP, `wrenmq reload`) re-reads both files; if either cannot be
used, both old ones stay in force and the reason is logged. Connections stay up;
new rules apply to their next packet, and queued messages the new rules no
longer allow are dropped.
"""

import asyncio
import concurrent.futures
import logging
import os
import time

from ..broker.hooks import Hook, awaitable
from ..config import ConfigError
from ..mqtt import constants as C
from .acl import READ, WRITE, Acl, AclError
from .passwords import PasswordFile, PasswordFileError

log = logging.getLogger("wrenmq.auth")

_MISS = object()
_CACHE_TOPICS = 10_000     # per session and direction: a bigger dict is cleared
_CACHE_SESSIONS = 100_000  # sessions with cached decisions: more and all are cleared

_pool = None


def _executor():
    """A small pool of its own for hashing, so a flood of logins cannot fill the default one."""
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="wrenmq-auth")
    return _pool


class AuthFileError(ConfigError):
    """A password or ACL file that cannot be used (at startup: the broker does not start)."""


def listener_names(lst):
    """The names a connection may report as `client.listener` for this listener
    (`ListenerConfig.label`; `name or bind:port` as Connection.__init__ computes it)."""
    names = {lst.name or f"{lst.bind}:{lst.port}"}
    label = getattr(lst, "label", None)
    if isinstance(label, str) and label:
        names.add(label)
    return names


def load_files(password_file, acl_file):
    """(PasswordFile or None, Acl or None); AuthFileError if either cannot be used."""
    try:
        pw = PasswordFile.load(password_file) if password_file else None
        acl = Acl.load(acl_file) if acl_file else None
    except (PasswordFileError, AclError) as e:
        raise AuthFileError(str(e)) from None
    return pw, acl


class FileAuth(Hook):
    """Authentication without a password file (anonymous policy + custom hooks)."""

    def __init__(self, config, chain=None):
        auth = config.auth
        self.allow_anonymous = auth.allow_anonymous  # None = by listener
        self.delay = auth.failed_login_delay
        self.password_path = os.path.abspath(auth.password_file) if auth.password_file else ""
        self.acl_path = os.path.abspath(auth.acl_file) if auth.acl_file else ""
        # Listener name -> may anonymous clients connect there?
        # Two listeners sharing a name count as loopback-only only if both are.
        loopback = {}
        for lst in config.listener:
            for name in listener_names(lst):
                loopback[name] = loopback.get(name, True) and lst.loopback_only
        if self.allow_anonymous is None:
            self.anonymous_by_listener = {name: local and not self.password_path
                                          for name, local in loopback.items()}
        else:
            self.anonymous_by_listener = {name: self.allow_anonymous for name in loopback}
        self.chain = chain
        self._rest_key = None
        self._rest = ()
        self.router = None  # set by the assembly: lets a reload re-check queued messages
        self.passwords, self.acl = load_files(self.password_path, self.acl_path)
        self.reloads = 0
        self.reload_failures = 0
        self.last_reload_error = None
        self.logins_failed = 0

    # --- authentication ---------------------------------------------------------

    def anonymous_allowed(self, listener):
        if self.allow_anonymous is not None:
            return self.allow_anonymous
        return self.anonymous_by_listener.get(listener, False)

    def _others(self):
        """The `authenticate` methods of the hooks behind this one."""
        chain = self.chain
        if chain is None:
            return ()
        hooks = chain.hooks
        key = (len(hooks), id(hooks))
        if key != self._rest_key:
            try:
                behind = hooks[hooks.index(self) + 1:]
            except ValueError:
                behind = [h for h in hooks if h is not self]
            self._rest = tuple(h.authenticate for h in behind
                               if getattr(type(h), "authenticate", None) is not Hook.authenticate)
            self._rest_key = key
        return self._rest

    def _ask_others(self, client, connect):
        """First answer of the hooks behind; None if none; an awaitable if one is async."""
        funcs = self._others()
        for i, f in enumerate(funcs):
            r = f(client, connect)
            if awaitable(r):
                return self._ask_others_async(r, funcs[i + 1:], client, connect)
            if r is not None:
                return r
        return None

    @staticmethod
    async def _ask_others_async(first, funcs, client, connect):
        r = await first
        if r is not None:
            return r
        for f in funcs:
            r = f(client, connect)
            if awaitable(r):
                r = await r
            if r is not None:
                return r
        return None

    def _policy(self, client, connect):
        """Nobody had an opinion: the anonymous policy (True or 0x87)."""
        if self.anonymous_allowed(client.listener):
            return True
        if connect.username is not None:
            why = "no password file to check the user name against"
        elif self.allow_anonymous is None and self.password_path:
            why = "anonymous access is not allowed with a password file ([auth] allow_anonymous = true allows it)"
        else:
            why = "anonymous access is not allowed"
        log.info("refusing %s on %s: %s", client.address, client.listener, why)
        return C.NOT_AUTHORIZED

    def authenticate(self, client, connect):
        if getattr(client, "cert_identity", None) is not None:
            return True  # verified client certificate, CN as user name (use_identity_as_username)
        r = self._ask_others(client, connect)
        if awaitable(r):
            return self._then_policy(r, client, connect)
        return r if r is not None else self._policy(client, connect)

    async def _then_policy(self, pending, client, connect):
        r = await pending
        return r if r is not None else self._policy(client, connect)

    async def _refuse_after_delay(self, started, client, why):
        self.logins_failed += 1
        log.warning("login failed for user %r from %s: %s", client.username, client.address, why,
                    extra={"event": "auth.failed", "client_id": client.client_id, "username": client.username,
                           "address": client.address, "listener": client.listener, "reason": why})
        wait = self.delay - (time.monotonic() - started)
        if wait > 0:
            await asyncio.sleep(wait)
        return False

    # --- reload ---------------------------------------------------------------------

    def on_reload(self):
        """Re-read the password and ACL files; on any error keep both old ones."""
        try:
            passwords, acl = load_files(self.password_path, self.acl_path)
        except AuthFileError as e:
            self.reload_failures += 1
            self.last_reload_error = str(e)
            log.error("reload failed, keeping the previous password and ACL files: %s", e)
            return
        self.passwords = passwords
        self.acl = acl
        self.reloads += 1
        self.last_reload_error = None
        self._reloaded()
        log.info("reloaded auth files: %s%s",
                 f"{len(passwords)} user(s) from {self.password_path}" if passwords is not None
                 else "no password file",
                 f", {acl.rule_count} ACL rule(s) from {self.acl_path}" if acl is not None else "")

    def _reloaded(self):
        pass


class _PasswordMixin:
    """Authentication with a password file (a coroutine: hashing runs in a thread)."""

    async def authenticate(self, client, connect):
        if getattr(client, "cert_identity", None) is not None:
            # The verified certificate is the credential (Mosquitto skips the password
            # file for use_identity_as_username too); the ACL applies to the CN.
            return True
        started = time.monotonic()
        user = connect.username
        if user is not None:
            entry = self.passwords.get(user)
            if entry is not None:
                loop = asyncio.get_running_loop()
                ok = await loop.run_in_executor(_executor(), entry.verify, connect.password)
                if ok:
                    return True
                return await self._refuse_after_delay(
                    started, client, "no password" if connect.password is None else "wrong password")
        r = self._ask_others(client, connect)
        if awaitable(r):
            r = await r
        if r is not None:
            return r
        if user is not None:
            return await self._refuse_after_delay(started, client, "unknown user")
        return self._policy(client, connect)


class _AclMixin:
    """ACL checks with per-session decision caches."""

    def _init_caches(self):
        self._write = {}
        self._read = {}

    def on_connect(self, client):
        self._forget(client)  # the session may come back under another user name

    def on_disconnect(self, client, reason):
        self._forget(client)

    def _forget(self, client):
        self._write.pop(client, None)
        self._read.pop(client, None)

    def _cache(self, caches, client):
        c = caches.get(client)
        if c is None:
            if len(caches) >= _CACHE_SESSIONS:
                caches.clear()
            c = caches[client] = {}
        elif len(c) >= _CACHE_TOPICS:
            c.clear()
        return c

    def authorize_publish(self, client, topic, qos, retain):
        c = self._write.get(client)
        if c is not None:
            r = c.get(topic, _MISS)
            if r is not _MISS:
                return r
        r = None if self.acl.check(client.client_id, client.username, topic, WRITE) else False
        if r is False:
            log.debug("ACL: %s (user %r) may not publish to %s", client.client_id, client.username, topic)
        self._cache(self._write, client)[topic] = r
        return r

    def authorize_deliver(self, client, message):
        topic = message.topic
        c = self._read.get(client)
        if c is not None:
            r = c.get(topic, _MISS)
            if r is not _MISS:
                return r
        r = None if self.acl.check(client.client_id, client.username, topic, READ) else False
        self._cache(self._read, client)[topic] = r
        return r

    def authorize_subscribe(self, client, topic_filter, qos):
        if self.acl.check_subscribe(client.client_id, client.username, topic_filter):
            return None
        log.info("ACL: %s (user %r) may not subscribe to %s", client.client_id, client.username,
                 topic_filter)
        return False

    def _reloaded(self):
        # Queued messages are checked again by the router when they are finally sent.
        self._init_caches()


def _make_class(passwords, acl):
    bases = []
    if passwords:
        bases.append(_PasswordMixin)
    if acl:
        bases.append(_AclMixin)
    if not bases:
        return FileAuth
    name = "FileAuth" + ("Passwords" if passwords else "") + ("Acl" if acl else "")
    return type(name, (*bases, FileAuth), {})


def build_auth_sources(config):
    """The `[auth.jwt]` and `[auth.http]` hooks (in that order) that go right behind the
    `[auth]` hook; AuthFileError if one cannot be set up (a missing library, key file)."""
    sources = []
    try:
        jwt = config.auth.jwt
        if jwt.secret or jwt.public_key or jwt.jwks_url:
            from .jwt import JwtAuth
            sources.append(JwtAuth(jwt))
        if config.auth.http.url:
            from .http import HttpAuth
            from ..net.http_client import aiohttp_module
            aiohttp_module("[auth.http]")
            sources.append(HttpAuth(config.auth.http))
        if config.auth.jwt.jwks_url:
            from ..net.http_client import aiohttp_module
            aiohttp_module("[auth.jwt] jwks_url")
    except (RuntimeError, OSError) as e:
        raise AuthFileError(str(e)) from None
    return sources


def build_auth_hook(config, chain=None):
    """The `[auth]` hook for a config. Which hook methods exist depends on the files
    configured, so an unused feature costs nothing on the publish path."""
    auth = config.auth
    cls = _make_class(bool(auth.password_file), bool(auth.acl_file))
    hook = cls(config, chain)
    if auth.acl_file:
        hook._init_caches()
    return hook
