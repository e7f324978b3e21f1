"""What every listener type shares: the `Listener` base class, and what refuses a connection
as it is accepted.

A listener type is a `Listener` subclass with a `type` (the `[[listener]] type` it serves)
and a `_listen()` that opens its server; `Listener.open` is the opener that
`Broker.listener_types` maps the type to (listeners/__init__.py). A listener is also the
`net.tls.TLSPort` its TLS handshakes run on: `label`, `ssl_context` (replaced by
`reload_tls`), `handshake_timeout`, `min_tls_version`, `spawn`.
"""

import asyncio
import logging
import socket

from ...net import ListenerError
from ...net.front import PlainSniffer
from ...net.proxied import ProxyReader
from ...net.tls import accept_tls, build_ssl_context
from ..connection import Connection
from ..hooks import Hook
from .tls import CertConnection

log = logging.getLogger("wrenmq.listeners")


class Refused(asyncio.Protocol):
    """Stands in for a connection refused as it is accepted (a listener's bound): closes it
    at once, counted and logged as the broker counts refused MQTT connections."""

    def __init__(self, broker, listener_name, why):
        self.broker = broker
        self.listener_name = listener_name
        self.why = why
        self.address = None

    def connection_made(self, transport):
        peer = transport.get_extra_info("peername")
        self.address = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)
        self.broker.refused(self, self.why)
        transport.abort()


class Listener:
    """One `[[listener]]`: its server and, with tls, its current SSLContext."""

    type = None  # the [[listener]] type this class serves
    serves_mqtt = True  # its connections are MQTT clients (Broker.listener_connections counts them)
    mqtt_over_tcp = False  # written to the data dir's lock file as where MQTT clients reach this broker

    def __init__(self, broker, cfg, index):
        self.broker = broker
        self.cfg = cfg
        self.index = index
        self.where = f"listener[{index}]"
        self.loop = None
        self.server = None
        self.address = None  # (host, port); (path, None) for unix sockets
        self.ssl_context = None
        self._conn_name = cfg.label  # Connection.listener_name, built once per listener

    @classmethod
    async def open(cls, broker, cfg, index):
        """Start listening for one `[[listener]]`; returns the started listener."""
        return await cls(broker, cfg, index).start()

    @property
    def label(self):
        cfg = self.cfg
        if not cfg.name and self.address is not None:
            return f"{self.address[0]}:{self.address[1]}"  # the real port, also with port = 0
        return cfg.label

    @property
    def kind(self):
        """What the listener is, for log lines ("MQTT/TLS", "WebSocket (wss)", ...)."""
        raise NotImplementedError

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

    def _connection(self, sniff=False):
        """A new MQTT `Connection` for this listener (one that sees the client's certificate
        on a TLS listener with a CA); `sniff`: see Connection."""
        cfg = self.cfg
        if cfg.tls and cfg.cafile:
            return CertConnection(self.broker, self.cfg, self._conn_name, sniff)
        return Connection(self.broker, self.cfg, self._conn_name, sniff)

    def _at_connection_limit(self):
        broker = self.broker
        limit = broker.config.limits.max_connections
        return bool(limit) and len(broker.connections) + broker.handshakes >= limit

    def _behind_proxy(self, front, given, count):
        """`front` behind a ProxyReader ([[listener]] proxy_protocol): `given(host, port)`
        gets the client's address from the header (unless the proxy gave none: its own
        health checks). With `count`, the reader counts in the broker's handshakes until
        it hands over (for protocols that do not count themselves from the accept)."""
        broker = self.broker
        on_done = None
        if count:
            broker.handshakes += 1

            def on_done():
                broker.handshakes -= 1

        def on_header(header):
            if header.source is not None:
                given(*header.source)

        reader = ProxyReader(front, broker.config.limits.connect_timeout, on_header,
                             self._proxy_refused, on_done)
        return reader

    def _proxy_refused(self, reader, why):
        reader.listener_name = self._conn_name
        self.broker.refused(reader, why)

    def _front(self, inner):
        """What stands in front of `inner` on an HTTP-based listener: the TLS handshake, or
        on a plain one a look at the first bytes (a TLS client there is logged, closed)."""
        if self.cfg.tls:
            return accept_tls(inner, self)
        return PlainSniffer(inner, self)

    async def start(self):
        self.loop = asyncio.get_running_loop()
        cfg = self.cfg
        if cfg.tls:
            self.ssl_context = build_ssl_context(cfg, self.where)
        await self._listen()
        socks = self.server.sockets
        addr = socks[0].getsockname()
        self.address = (addr[0], addr[1])
        extra = self._listening_as()
        for sock in socks:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                a = sock.getsockname()
                log.info("listening on %s:%d%s", a[0], a[1], extra)
        return self

    async def _listen(self):
        """Open `self.server`."""
        raise NotImplementedError

    def _listening_as(self):
        """What the "listening on" log line adds after the address."""
        return ""

    def reload_tls(self):
        """Re-read certfile/keyfile/cafile; new handshakes use them. False (and the old
        certificate stays) if they cannot be loaded."""
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
        if self.server is not None:
            self.server.close()

    async def wait_closed(self):
        if self.server is not None:
            await self.server.wait_closed()


class TLSReloadHook(Hook):
    """Reload TLS certificates when the broker reloads (SIGHUP)."""

    def __init__(self, broker):
        self.broker = broker

    def on_reload(self):
        self.broker.reload_tls()
