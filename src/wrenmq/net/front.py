"""Protocols that stand in front of a listener's own protocol for a while.

A listener's protocol factory may return a `Front` around the protocol that will serve
the connection: it sees the first bytes (or runs a handshake) and then sets the inner
protocol on the transport, so from there on the transport talks to it directly and the
front costs nothing per read.
"""

import asyncio
import logging

log = logging.getLogger("wrenmq.listeners")

TLS_HANDSHAKE = 0x16  # first byte of a TLS record carrying a handshake (ClientHello)
HTTP_METHODS = (b"GET ", b"POST", b"HEAD", b"PUT ", b"OPTI")


def peer_name(transport):
    """The transport's peer as "host:port" for log lines ("?" when unknown)."""
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer) if peer else "?"


class Front(asyncio.Protocol):
    """Base of the protocols that stand in front of the real one (`inner`) for a while.

    `port` is what accepted the connection; its `label` names it in log lines."""

    def __init__(self, inner, port):
        self.inner = inner
        self.port = port
        self.transport = None

    def __getattr__(self, name):
        # websockets looks at `connection.protocol` of what its create_connection returned.
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


class PlainSniffer(Front):
    """Look at the first bytes on a plain (not TLS) HTTP-based port, then get out of the way:
    a TLS ClientHello there is logged and closed, instead of the HTTP parser answering it
    with a "bad request" that the TLS client cannot read. `port.kind` names the listener's
    kind in that line ("WebSocket", "metrics (HTTP)")."""

    def connection_made(self, transport):
        self.transport = transport
        self.inner.connection_made(transport)

    def data_received(self, data):
        t = self.transport
        port = self.port
        if data[0] == TLS_HANDSHAKE:
            log.warning("%s sent a TLS ClientHello to plain %s listener %s; closing (connect without "
                        "TLS, or use a listener with tls = true)", peer_name(t), port.kind, port.label)
            t.abort()
            return
        inner = self.inner
        t.set_protocol(inner)  # from now on the transport talks to the inner protocol directly
        inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def connection_lost(self, exc):
        self.inner.connection_lost(exc)

    def pause_writing(self):
        self.inner.pause_writing()

    def resume_writing(self):
        self.inner.resume_writing()
