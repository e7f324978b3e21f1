"""`type = "ws"`: MQTT over WebSocket (ws and wss).

The `websockets` library speaks HTTP/WebSocket; `net.websocket.WebSocketTransport` adapts
each WebSocket connection to the asyncio Transport the `Connection` expects. For wss the
TLS handshake runs in `net.tls.TLSAcceptor` under websockets (through its
`create_connection` hook); on a plain listener a `net.front.PlainSniffer` closes TLS
clients with a clear log line; with `proxy_protocol = true` a `net.proxied.ProxyReader`
reads the PROXY header first. A connection counts against `max_connections` (in
`Broker.handshakes`) from its accept until its WebSocket handshake is over.
"""

import http
import logging
import urllib.parse
import weakref

from ...net import ListenerError
from ...net.front import peer_name
from ...net.websocket import QuietLogger, WebSocketTransport, counted
from .base import Listener, Refused

log = logging.getLogger("wrenmq.listeners")

DEFAULT_WS_PATH = "/mqtt"
WS_SUBPROTOCOLS = ("mqtt", "mqttv3.1")


def _select_subprotocol(connection, offered):
    for name in WS_SUBPROTOCOLS:
        if name in offered:
            return name
    if not offered:
        return None  # lenient, like Mosquitto: a client that names no subprotocol is served
    from websockets.exceptions import NegotiationError
    raise NegotiationError(f"unsupported subprotocol {', '.join(offered)}; expected mqtt")


class WebSocketListener(Listener):
    type = "ws"

    def __init__(self, broker, cfg, index):
        super().__init__(broker, cfg, index)
        self._opening = weakref.WeakSet()  # websockets connections, for close()

    @property
    def kind(self):
        return "WebSocket (wss)" if self.cfg.tls else "WebSocket"

    def _listening_as(self):
        return f" ({'wss' if self.cfg.tls else 'ws'}, path {self.cfg.path or DEFAULT_WS_PATH})"

    async def _listen(self):
        try:
            from websockets.asyncio.server import ServerConnection, serve
        except ImportError:  # pragma: no cover - it is a dependency
            raise ListenerError(f"{self.where}.type: \"ws\" needs the websockets package") from None
        cfg = self.cfg
        limits = self.broker.config.limits
        path = cfg.path or DEFAULT_WS_PATH

        broker = self.broker

        def handshake_over():
            broker.handshakes -= 1

        # Counted in the broker's handshakes until its handshake ends (_session) or it closes.
        WsConnection = counted(ServerConnection, handshake_over)

        def create_connection(*args, **kwargs):
            # A connection in its handshake counts against max_connections, as an MQTT
            # connection does before its CONNECT: else a flood of idle handshakes (each
            # kept up to connect_timeout) would hold memory past the limit.
            if self._at_connection_limit():
                return Refused(self.broker, self._conn_name, "max_connections reached")
            conn = WsConnection(*args, **kwargs)
            self.broker.handshakes += 1
            self._opening.add(conn)
            if cfg.proxy_protocol:
                def given(host, port):
                    conn.proxied_peer = (host, port)
                return self._behind_proxy(self._front(conn), given, count=False)
            return self._front(conn)

        origins = frozenset(o.rstrip("/") for o in cfg.origins)

        def process_request(connection, request):
            if urllib.parse.urlsplit(request.path).path != path:
                log.info("WebSocket listener %s: %s asked for %s, not %s: 404", self.label,
                         peer_name(connection.transport), request.path[:200], path)
                return connection.respond(http.HTTPStatus.NOT_FOUND, "Not Found\n")
            if origins:
                origin = request.headers.get("Origin")
                if origin is not None and origin not in origins:
                    log.info("WebSocket listener %s: %s came from origin %s, not an allowed one: 403",
                             self.label, peer_name(connection.transport), origin[:200])
                    return connection.respond(http.HTTPStatus.FORBIDDEN, "Forbidden origin\n")
            return None

        def process_response(connection, request, response):
            if response.status_code not in (101, 403, 404):
                exc = connection.protocol.handshake_exc
                log.info("WebSocket listener %s: handshake with %s refused (%d): %s", self.label,
                         peer_name(connection.transport), response.status_code, exc or response.reason_phrase)
            return None

        self.server = await serve(
            self._session, cfg.bind, cfg.port,
            subprotocols=list(WS_SUBPROTOCOLS), select_subprotocol=_select_subprotocol,
            process_request=process_request, process_response=process_response,
            create_connection=create_connection, compression=None, server_header=None,
            open_timeout=limits.connect_timeout, ping_interval=None, close_timeout=5,
            max_size=limits.max_packet_size + 65536, max_queue=4,
            logger=QuietLogger(logging.getLogger("wrenmq.websockets"), {}), backlog=4096,
            reuse_address=True)

    async def _session(self, ws):
        ws.uncount()  # its handshake is over: from now on the Connection counts itself
        await WebSocketTransport(ws, self._connection(), self.label).run()

    def close(self):
        server = self.server
        if server is None:
            return
        server.close(close_connections=False)  # the broker closes its connections itself
        # ... but not those still in their HTTP handshake: do not wait open_timeout for them.
        from websockets.protocol import State
        for conn in list(self._opening):
            t = getattr(conn, "transport", None)
            if conn.protocol.state is State.CONNECTING and t is not None:
                t.abort()
        self._opening.clear()
