"""`type = "metrics"`: Prometheus's scrape over HTTP(S), no MQTT.

`websockets` parses the HTTP request (with its limits and timeout) and every request gets
a plain HTTP answer, never an upgrade: the $SYS figures in Prometheus's text format at
`path` (broker/metrics.py), `GET /health` (a probe the event loop answers), 404
elsewhere. With `users`, the figures need HTTP Basic credentials from the broker's
password file.
"""

import asyncio
import hashlib
import hmac
import http
import logging
import time
import urllib.parse

from ...net.websocket import QuietLogger, counted
from .base import Listener, Refused

log = logging.getLogger("wrenmq.listeners")

DEFAULT_METRICS_PATH = "/metrics"
# Also answered by a metrics listener, without credentials: a probe (Kubernetes liveness
# and readiness) that the broker's event loop answers, with what stops it taking messages.
HEALTH_PATH = "/health"
# Connections a metrics listener holds at once. Prometheus scrapes over one; the bound
# keeps what a flood of idle connections (each kept up to the 5 s request timeout) holds.
METRICS_MAX_OPEN = 64


class MetricsListener(Listener):
    type = "metrics"
    serves_mqtt = False

    def __init__(self, broker, cfg, index):
        super().__init__(broker, cfg, index)
        self.open_requests = 0  # its open connections
        self._logins = {}  # users: user -> (password file entry, sha256 of the password)

    @property
    def kind(self):
        return "metrics (HTTPS)" if self.cfg.tls else "metrics (HTTP)"

    def _listening_as(self):
        return f" (Prometheus metrics over {'HTTPS' if self.cfg.tls else 'HTTP'}, path " \
               f"{self.cfg.path or DEFAULT_METRICS_PATH})"

    async def _listen(self):
        from websockets.asyncio.server import ServerConnection, basic_auth, serve

        from ..metrics import CONTENT_TYPE, render

        path = self.cfg.path or DEFAULT_METRICS_PATH
        sys_topics = self.broker.sys_topics
        # `users`: HTTP Basic authentication against the broker's password file (the one
        # SIGHUP reloads), as websockets' basic_auth asks it.
        login = basic_auth(realm="wrenmq metrics", check_credentials=self._login) \
            if self.cfg.users else None

        def request_over():
            self.open_requests -= 1

        MetricsConnection = counted(ServerConnection, request_over)  # (in open_requests until closed)

        def create_connection(*args, **kwargs):
            if self.open_requests >= METRICS_MAX_OPEN:
                return Refused(self.broker, self._conn_name, f"{METRICS_MAX_OPEN} metrics requests open")
            self.open_requests += 1
            return self._front(MetricsConnection(*args, **kwargs))

        def answer(connection, request, code, body, content_type):
            """`body` as `content_type`; to HEAD, the GET's headers (its Content-Length too)."""
            response = connection.respond(code, body)
            del response.headers["Content-Type"]
            response.headers["Content-Type"] = content_type
            if request.method == "HEAD":
                response.body = b""
            return response

        async def process_request(connection, request):
            asked = urllib.parse.urlsplit(request.path).path
            if asked == HEALTH_PATH and asked != path and request.method in ("GET", "HEAD"):
                return answer(connection, request, *self._health(), "application/json")
            if asked != path:
                return connection.respond(http.HTTPStatus.NOT_FOUND, "Not Found\n")
            if login is not None:
                refused = await login(connection, request)
                if refused is not None:
                    return refused
            if request.method not in ("GET", "HEAD"):
                response = connection.respond(http.HTTPStatus.METHOD_NOT_ALLOWED, "Method Not Allowed\n")
                response.headers["Allow"] = "GET, HEAD"
                return response
            return answer(connection, request, http.HTTPStatus.OK, render(sys_topics), CONTENT_TYPE)

        async def never(ws):  # (every request is answered by process_request)
            await ws.close()

        self.server = await serve(
            never, self.cfg.bind, self.cfg.port, process_request=process_request,
            create_connection=create_connection, server_header=None, open_timeout=5,
            close_timeout=1, logger=QuietLogger(logging.getLogger("wrenmq.metrics"), {}),
            backlog=128, reuse_address=True)

    def _health(self):
        """GET /health, as (status code, JSON body): metrics.health."""
        from ..metrics import health
        return health(self.broker)

    async def _login(self, user, password):
        """A metrics listener's `users` check: a listed user whose password the password
        file confirms. Hashing runs in a thread; a refusal waits [auth] failed_login_delay,
        as an MQTT login's does. A confirmed password is remembered until the file's entry
        for the user changes (a reload), so a scrape every few seconds hashes once."""
        auth = self.broker.auth
        entry = auth.passwords.get(user) if user in self.cfg.users and auth.passwords is not None else None
        token = hashlib.sha256(password.encode(errors="surrogateescape")).digest()
        known = self._logins.get(user)
        if entry is not None and known is not None and known[0] is entry and hmac.compare_digest(known[1], token):
            return True
        started = time.monotonic()
        if entry is not None and await asyncio.get_running_loop().run_in_executor(None, entry.verify, password):
            self._logins[user] = (entry, token)
            return True
        log.warning("%s (metrics): refused a request from user %r (%s)", self.where, user,
                    "wrong password" if entry is not None else "not one of its users, or not in the password file")
        await asyncio.sleep(max(0.0, auth.delay - (time.monotonic() - started)))
        return False
