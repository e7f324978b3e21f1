"""`[[listener]] type = "admin"`: the socket side of the admin API and dashboard.

It has what the broker asks of a listener (`address`, `label`, `cfg`, `serves_mqtt`,
`mqtt_over_tcp`, `close`, `wait_closed`, `reload_tls`), so `Broker.listener_types` can open
it like its own. TLS runs through net/'s acceptor (`accept_tls`: the handshake's failures
are logged as on the MQTT listeners, and SIGHUP's new certificate applies to new
handshakes; the listener is the acceptor's `TLSPort`); each
accepted socket is an `HttpConnection` serving `Admin` (app.py). At most MAX_OPEN
connections are held (a dashboard holds one for its live figures and one or two for its
calls); past that a new one is closed at once.

With `[cluster]`, the node says in etcd where its admin listener is (`Cluster.advertise_info`),
so any node's API can ask the others (peers.py).
"""

import asyncio
import functools
import ipaddress
import logging
import time

from ..net import ListenerError
from ..net.tls import accept_tls, build_ssl_context
from .app import Admin
from .feed import Feed
from .http import HttpConnection

log = logging.getLogger("wrenmq.admin")

MAX_OPEN = 128


class _Refused(asyncio.Protocol):
    def connection_made(self, transport):
        transport.abort()


class AdminListener:
    serves_mqtt = False
    mqtt_over_tcp = False

    def __init__(self, broker, cfg, index):
        self.broker = broker
        self.cfg = cfg
        self.index = index
        self.where = f"listener[{index}]"
        self.loop = None
        self.server = None
        self.address = None
        self.ssl_context = None
        self.admin = None
        self.feed = None
        self.connections = set()
        self.refused = 0
        self._refused_logged = float("-inf")

    @property
    def label(self):
        if not self.cfg.name and self.address is not None:
            return f"{self.address[0]}:{self.address[1]}"
        return self.cfg.label

    @property
    def tls(self):
        return self.cfg.tls

    @property
    def handshake_timeout(self):
        return self.broker.config.limits.connect_timeout

    @property
    def min_tls_version(self):
        return self.cfg.min_tls_version

    def spawn(self, coro):
        return self.broker.spawn(coro)

    @property
    def url(self):
        """Where this listener is reached: its bound address, or with a wildcard bind the
        host of the cluster link's advertised address (what other nodes reach this one by)."""
        if self.address is None:
            return None
        host, port = self.address[0], self.address[1]
        try:
            wildcard = ipaddress.ip_address(host).is_unspecified
        except ValueError:
            wildcard = False
        cluster = self.broker.cluster
        if wildcard:
            host = cluster.advertise.rpartition(":")[0] if cluster is not None else "127.0.0.1"
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{'https' if self.cfg.tls else 'http'}://{host}:{port}"

    async def start(self):
        self.loop = asyncio.get_running_loop()
        cfg = self.cfg
        if cfg.tls:
            self.ssl_context = build_ssl_context(cfg, self.where)
        try:
            self.admin = Admin(self.broker, cfg, self.where, self)
        except OSError as e:
            raise ListenerError(f"{self.where}: {e}") from None
        self.feed = self.admin.feed = Feed(self.broker, self.admin.node)
        try:
            self.server = await self.loop.create_server(self._accept, cfg.bind, cfg.port, backlog=128,
                                                        reuse_address=True)
        except OSError as e:
            self.admin.close()
            raise ListenerError(f"{self.where}: cannot listen on {cfg.bind}:{cfg.port}: {e.strerror or e}") from None
        addr = self.server.sockets[0].getsockname()
        self.address = (addr[0], addr[1])
        self.feed.start()
        for sock in self.server.sockets:
            a = sock.getsockname()
            log.info("listening on %s:%d (admin API and dashboard over %s)", a[0], a[1],
                     "HTTPS" if cfg.tls else "HTTP")
        cluster = self.broker.cluster
        if cluster is not None:
            cluster.advertise_info("admin", self.url)
        return self

    def _accept(self):
        if len(self.connections) >= MAX_OPEN:
            self.refused += 1
            now = time.monotonic()
            if now - self._refused_logged >= 1.0:
                self._refused_logged = now
                log.warning("admin listener %s: %d connections open, refusing more (%d so far)",
                            self.label, MAX_OPEN, self.refused)
            return _Refused()
        conn = HttpConnection(self.admin)
        conn.on_close = functools.partial(self.connections.discard, conn)
        self.connections.add(conn)
        if self.cfg.tls:
            return accept_tls(conn, self)
        return conn

    def reload_tls(self):
        if not self.cfg.tls:
            return True
        try:
            ctx = build_ssl_context(self.cfg, self.where)
        except ListenerError as e:
            log.error("TLS reload failed, listener %s keeps its previous certificate: %s", self.label, e)
            return False
        self.ssl_context = ctx
        log.info("listener %s: TLS certificate reloaded from %s", self.label, self.cfg.certfile)
        return True

    def close(self):
        if self.server is None:
            return
        self.server.close()
        if self.feed is not None:
            self.feed.stop()
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()
        if self.admin is not None:
            self.admin.close()

    async def wait_closed(self):
        if self.server is not None:
            await self.server.wait_closed()

    async def peer_admins(self):
        """{node: admin URL} of the cluster's other nodes, as they told etcd."""
        cluster = self.broker.cluster
        if cluster is None:
            return {}
        info = await cluster.read_info("admin")
        info.pop(cluster.node, None)
        return info


async def open_admin_listener(broker, cfg, index):
    return await AdminListener(broker, cfg, index).start()
