"""What an external login source grants a client: rules, an expiry, superuser.

`GrantingSource` is the base of the `[auth.jwt]` and `[auth.http]` hooks. Its
`authenticate` (in the subclass) records a `Grant` for the connection it accepts;
when that connection's session comes online the grant moves to the session:

- its rules (rules.py) answer `authorize_publish` / `authorize_subscribe` for that
  session: allow ends the question, deny refuses, no rule leaves it to the hooks
  behind and the broker's default. The [auth] ACL file is asked before (it can only
  refuse), so a token cannot grant what the file refuses;
- `superuser` (HTTP's `is_superuser`) skips the grant's rules: allowed;
- its expiry (a JWT's `exp`, HTTP's `expire_at`) closes the connection then
  (5.0: DISCONNECT 0x87 not authorized); the client logs in again with fresh
  credentials.

A session not logged in by this source has no grant here and costs a dict lookup.
"""

import logging
import time

from ..broker.hooks import Hook
from ..mqtt import constants as C
from .rules import PUBLISH, SUBSCRIBE

log = logging.getLogger("wrenmq.auth")

_PENDING_MAX = 100_000  # accepted logins whose session is not online yet


class Grant:
    __slots__ = ("rules", "expire_at", "superuser", "timer")

    def __init__(self, rules=None, expire_at=None, superuser=False):
        self.rules = rules
        self.expire_at = expire_at  # seconds since the epoch, or None
        self.superuser = superuser
        self.timer = None


class GrantingSource(Hook):
    #: what logs call this source ("JWT", "HTTP auth")
    source = ""

    def __init__(self):
        self._pending = {}  # (client id, address) -> Grant, from authenticate to on_connect
        self._grants = {}  # session -> Grant
        self.loop = None
        self.expired = 0  # connections closed because their credentials expired

    async def start(self, broker):
        import asyncio
        self.loop = asyncio.get_running_loop()

    def accepted(self, client, grant):
        """The login of `client` (a ClientInfo) succeeded here with `grant`."""
        if grant.rules is None and grant.expire_at is None and not grant.superuser:
            return
        if len(self._pending) >= _PENDING_MAX:
            self._pending.clear()  # logins whose CONNECT was refused after all, piled up
        self._pending[(client.client_id, client.address)] = grant

    def on_connect(self, client):
        old = self._grants.pop(client, None)
        if old is not None and old.timer is not None:
            old.timer.cancel()
        grant = self._pending.pop((client.client_id, client.address), None)
        if grant is None:
            return
        self._grants[client] = grant
        if grant.expire_at is not None and self.loop is not None:
            conn = client.conn
            delay = max(0.0, grant.expire_at - time.time())
            grant.timer = self.loop.call_later(delay, self._expire, client, conn)

    def on_disconnect(self, client, reason):
        grant = self._grants.pop(client, None)
        if grant is not None and grant.timer is not None:
            grant.timer.cancel()

    def _expire(self, session, conn):
        if session.conn is not conn or conn is None or conn.closing:
            return
        self.expired += 1
        log.info("client %s: its %s credentials expired: disconnecting", session.client_id, self.source,
                 extra={"event": "auth.expired", "client_id": session.client_id,
                        "address": session.address, "username": session.username})
        conn.close(C.NOT_AUTHORIZED)

    def authorize_publish(self, client, topic, qos, retain):
        grant = self._grants.get(client)
        if grant is None:
            return None
        if grant.superuser:
            return True
        rules = grant.rules
        if rules is None:
            return None
        return rules.check(PUBLISH, topic, qos, retain, client.client_id, client.username)

    def authorize_subscribe(self, client, topic_filter, qos):
        grant = self._grants.get(client)
        if grant is None:
            return None
        if grant.superuser:
            return True
        rules = grant.rules
        if rules is None:
            return None
        return rules.check(SUBSCRIBE, topic_filter, qos, False, client.client_id, client.username)
