"""The protocol that reads a PROXY header in front of a listener's own protocol.

With `proxy_protocol = true` a listener puts a `ProxyReader` first on every accepted
socket. It reads until the header is complete (proxy.py parses it), says what it
found (`on_header`, which gives the inner protocol the client's real address), then
hands the transport to the inner protocol - a Connection, the TLS acceptor (the
header precedes the ClientHello) or websockets' connection - and the bytes after the
header with it. A socket that sends no header, or a malformed one, or none within
`timeout` seconds, is closed, and `on_refused(why)` counts and logs it.
"""

import asyncio

from .proxy import ProxyError, ProxyHeaderReader


class ProxyReader(asyncio.Protocol):
    def __init__(self, inner, timeout, on_header, on_refused, on_done=None):
        self.inner = inner
        self.timeout = timeout
        self.on_header = on_header
        self.on_refused = on_refused
        self.on_done = on_done  # called once, when the reader is out of the way (either way)
        self.reader = ProxyHeaderReader()
        self.reading = True  # until the header is read or the connection refused
        self.transport = None
        self.address = "?"  # the proxy's own, for what on_refused logs
        self._timer = None

    def __getattr__(self, name):
        # websockets looks at `connection.protocol` of what its create_connection returned.
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def connection_made(self, transport):
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.address = f"{peer[0]}:{peer[1]}"
        self._timer = asyncio.get_running_loop().call_later(self.timeout, self._late)

    def _done(self):
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        done, self.on_done = self.on_done, None
        if done is not None:
            done()

    def _refuse(self, why):
        self.reading = False
        self._done()
        self.on_refused(self, why)
        self.transport.abort()

    def _late(self):
        self._timer = None
        self._refuse(f"no PROXY protocol header within {self.timeout:g} s")

    def data_received(self, data):
        if not self.reading:
            return  # refused already
        try:
            found = self.reader.feed(data)
        except ProxyError as e:
            self._refuse(f"PROXY protocol: {e}")
            return
        if found is None:
            return
        header, rest = found
        self.reading = False
        self._done()
        self.on_header(header)
        inner = self.inner
        t = self.transport
        t.set_protocol(inner)
        inner.connection_made(t)
        if rest and not t.is_closing():
            inner.data_received(rest)

    def eof_received(self):
        return False

    def connection_lost(self, exc):
        self._done()
        # The inner protocol never saw the connection: a websockets connection that
        # counts itself from its accept is told, as after a failed TLS handshake.
        abandoned = getattr(self.inner, "abandoned", None)
        if abandoned is not None:
            abandoned()
