"""`[auth.http]`: logins asked of an HTTP service, with EMQX's HTTP authentication contract.

For a login the password file does not decide (and a JWT source did not), the broker
POSTs JSON to `url`:

    {"clientid": "c1", "client_id": "c1", "username": "u", "password": "p",
     "peerhost": "203.0.113.7", "peerport": 51234, "protocol": "mqtt", "proto_ver": 5,
     "listener": "0.0.0.0:1883", "cert_common_name": "alice"}

(`password` and `username` are null when absent, `cert_common_name` when the listener
has no verified client certificate.) The answer, as EMQX reads it:

- 200 with `{"result": "allow" | "deny" | "ignore"}`: accepted / refused (0x86, 3.1.1:
  4) / no opinion (the next source: [[hook]]s, then the anonymous policy). Optional
  `"is_superuser": true` (no per-client rules apply), `"acl": [...]` (the client's
  rules, rules.py) and `"expire_at": <seconds since the epoch>` (its connection is
  closed then). A 200 whose body is not that JSON counts as "ignore";
- 204: accepted;
- anything else, a connection that fails, or no answer within `timeout`: the service
  is down, and `on_error` decides: "deny" (default) refuses with 0x88 server
  unavailable (3.1.1: 3), "ignore" asks the next source.

Answers are cached for `cache_seconds` per request body (client id, user name,
password, address, listener; the client's port left out), at most `cache_size` of
them, so a fleet that reconnects does not ask again; logins with the same body that
arrive while one is being asked wait for that one answer. The cache holds a SHA-256 of
the body, not passwords. Requests run on the event loop (aiohttp, net/http_client.py):
a slow service delays the logins that wait for it, never other clients.
"""

import asyncio
import collections
import hashlib
import json
import logging
import time

from ..mqtt import constants as C
from ..net.http_client import client_session
from .grants import Grant, GrantingSource
from .rules import RulesError, parse_rules

log = logging.getLogger("wrenmq.auth")


def _text(value):
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


class HttpAuth(GrantingSource):
    source = "HTTP auth"

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.session = None
        self._cache = collections.OrderedDict()  # sha256 of the body -> (deadline, answer, grant)
        self._asking = {}  # sha256 -> future of (answer, grant), shared by identical logins
        self.requests = 0
        self.cache_hits = 0
        self.errors = 0
        self._last_error_log = 0.0
        self._errors_unlogged = 0

    async def start(self, broker):
        await super().start(broker)
        self.session = client_session("[auth.http]", self.cfg.timeout, dict(self.cfg.headers))

    async def stop(self):
        if self.session is not None:
            await self.session.close()
            self.session = None

    def sys_values(self):
        return {"$SYS/broker/auth/http/requests": self.requests,
                "$SYS/broker/auth/http/cache hits": self.cache_hits,
                "$SYS/broker/auth/http/errors": self.errors,
                "$SYS/broker/auth/http/expired": self.expired}

    def _body(self, client, connect):
        host, _, port = client.address.rpartition(":")
        return {
            "clientid": client.client_id, "client_id": client.client_id,
            "username": _text(connect.username), "password": _text(connect.password),
            "peerhost": host or client.address, "protocol": "mqtt", "proto_ver": client.version,
            "listener": client.listener, "cert_common_name": _cert_cn(client),
        }, port

    async def authenticate(self, client, connect):
        body, port = self._body(client, connect)
        data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        key = hashlib.sha256(data).digest()
        ttl = self.cfg.cache_seconds
        now = time.monotonic()
        if ttl:
            hit = self._cache.get(key)
            if hit is not None:
                if hit[0] > now:
                    self.cache_hits += 1
                    self._cache.move_to_end(key)
                    return self._decided(client, hit[1], hit[2])
                del self._cache[key]
        pending = self._asking.get(key)
        if pending is None:
            pending = asyncio.get_running_loop().create_future()
            self._asking[key] = pending
            try:
                answer, grant, cacheable = await self._ask(data, body, port)
            except BaseException:
                pending.cancel()  # identical logins waiting ask again for themselves
                raise
            finally:
                del self._asking[key]
            if cacheable and ttl:
                cache = self._cache
                cache[key] = (time.monotonic() + ttl, answer, grant)
                if len(cache) > self.cfg.cache_size:
                    cache.popitem(last=False)
            pending.set_result((answer, grant))
        else:
            try:
                answer, grant = await asyncio.shield(pending)
            except asyncio.CancelledError:
                if not pending.cancelled():
                    raise
                return await self.authenticate(client, connect)  # the first asker went away
        return self._decided(client, answer, grant)

    def _decided(self, client, answer, grant):
        if answer is True and grant is not None:
            self.accepted(client, grant)
        return answer

    async def _ask(self, data, body, port):
        """(answer for authenticate, Grant or None, whether to cache it)."""
        self.requests += 1
        body_for_port = dict(body, peerport=int(port)) if port.isdigit() else body
        try:
            async with self.session.post(self.cfg.url, data=json.dumps(body_for_port).encode(),
                                         headers={"Content-Type": "application/json"}) as resp:
                status = resp.status
                raw = await resp.read()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # connection refused, reset, timeout, bad TLS
            return self._failed(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__), None, False
        if status == 204:
            return True, None, True
        if status != 200:
            return self._failed(f"HTTP {status}"), None, False
        try:
            answer = json.loads(raw)
            result = answer.get("result") if isinstance(answer, dict) else None
        except ValueError:
            result = None
        if result == "deny":
            log.info("HTTP auth denied user %r (client %s)", body["username"], body["clientid"],
                     extra={"event": "auth.failed", "client_id": body["clientid"],
                            "username": body["username"], "address": body["peerhost"], "reason": "HTTP auth: deny"})
            return False, None, True
        if result != "allow":
            return None, None, True  # "ignore", or not the contract's JSON
        try:
            rules = parse_rules(answer.get("acl"))
        except RulesError as e:
            log.warning("HTTP auth allowed client %s with rules that cannot be read (%s): refusing it",
                        body["clientid"], e)
            return C.NOT_AUTHORIZED, None, False
        expire_at = answer.get("expire_at")
        if isinstance(expire_at, bool) or not isinstance(expire_at, (int, float)):
            expire_at = None
        if expire_at is not None and expire_at > 1e11:
            expire_at /= 1000.0  # milliseconds, as some services send
        grant = Grant(rules, expire_at, answer.get("is_superuser") is True)
        return True, grant, True

    def _failed(self, why):
        self.errors += 1
        now = time.monotonic()
        if now - self._last_error_log >= 1.0:
            log.warning("HTTP auth service %s: %s (%d failures unlogged); logins it should decide are %s",
                        self.cfg.url, why, self._errors_unlogged,
                        "refused (0x88 server unavailable)" if self.cfg.on_error == "deny" else "passed on",
                        extra={"event": "auth.http.error", "reason": why})
            self._last_error_log = now
            self._errors_unlogged = 0
        else:
            self._errors_unlogged += 1
        return C.SERVER_UNAVAILABLE if self.cfg.on_error == "deny" else None


def _cert_cn(client):
    cert = getattr(client, "peercert", None)
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return value
    return None
