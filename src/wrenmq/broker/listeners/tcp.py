"""`type = "mqtt"`: MQTT over TCP, plain or TLS, optionally behind a PROXY protocol header.

Plain, nothing stands in front of the `Connection`: it looks at the first bytes itself
when they are not a CONNECT, so a TLS ClientHello or an HTTP request on a plain MQTT port
gets a clear log line and the connection is closed, instead of a confusing "protocol
error" (or a client waiting for a handshake that never comes). With `tls = true` the
handshake runs in `net.tls.TLSAcceptor` first, and with `proxy_protocol = true` a
`net.proxied.ProxyReader` reads the header before anything else; a connection in either
counts against `max_connections` (in `Broker.handshakes`) as one waiting for its CONNECT
does.
"""

from ...net.tls import accept_tls
from .base import Listener, Refused


class TcpListener(Listener):
    type = "mqtt"
    mqtt_over_tcp = True

    @property
    def kind(self):
        return "MQTT/TLS" if self.cfg.tls else "MQTT"

    def _accept(self):
        """The protocol of an accepted connection. One still in its TLS handshake counts
        against max_connections, as one waiting for its CONNECT does
        (Connection.connection_made refuses those past the limit)."""
        cfg = self.cfg
        # A plain one sniffs its own first bytes (Connection._foreign).
        if not (cfg.tls or cfg.proxy_protocol):
            return self._connection(sniff=True)
        if self._at_connection_limit():
            return Refused(self.broker, self._conn_name, "max_connections reached")
        conn = front = self._connection(sniff=not cfg.tls)
        if cfg.tls:
            broker = self.broker
            broker.handshakes += 1

            def handshake_over():
                broker.handshakes -= 1  # the Connection counts itself from here on

            front = accept_tls(conn, self, handshake_over)
        if not cfg.proxy_protocol:
            return front

        def given(host, port):
            conn.address = f"{host}:{port}"
            if front is not conn:
                front.peer = conn.address  # the TLS acceptor's log lines
        return self._behind_proxy(front, given, count=not cfg.tls)

    async def _listen(self):
        cfg = self.cfg
        self.server = await self.loop.create_server(self._accept, cfg.bind, cfg.port,
                                                    backlog=4096, reuse_address=True)

    def _listening_as(self):
        return " (TLS)" if self.cfg.tls else ""
