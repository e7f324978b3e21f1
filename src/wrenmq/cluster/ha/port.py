"""The node's link port, owned by the process rather than by a broker.

With `[cluster] replicas` > 1 a process may run no broker of its own for a while (its
partition is led elsewhere and it follows it), yet its followers' replication
connections must reach it. So the process binds `[cluster] port` itself and looks at the
first frame of every connection: a replication HELLO (replication_frames: a version byte
first) goes to the partitions' manager (wire.py), a node link's HELLO (frames.py: JSON)
to the links of this node's own broker while it runs (links.py `accept_link`), else the
connection is closed. Both HELLOs are frame kind 1; their bodies tell them apart.

With `[cluster] tls` every connection runs the mutual TLS handshake first (net/tls.py),
so replication and node links are both encrypted and both need a certificate the
cluster's CA signed; handshakes in progress count against MAX_UNSORTED.
"""

import asyncio
import logging
import struct

from ...net.tls import TLSPort, accept_tls
from .. import frames as F

log = logging.getLogger("wrenmq.cluster.ha")

_HEAD = struct.Struct(">IB")
_FIRST_TIMEOUT = 5.0  # seconds a connection may take to send its first frame
MAX_UNSORTED = 256  # connections accepted that have not said what they are yet


class _Sniffer(asyncio.Protocol):
    """A connection until its first frame's first body byte says what it is; then the
    protocol it is for gets `connection_made` and every byte, this one passing them on."""

    def __init__(self, port):
        self.port = port
        self.inner = None
        self.transport = None
        self.buf = b""
        self.timer = None

    def connection_made(self, transport):
        self.transport = transport
        port = self.port
        if port.unsorted + port.handshakes >= MAX_UNSORTED:
            log.warning("cluster: refusing a connection to the link port: %d have not said what they are",
                        port.unsorted)
            transport.abort()
            return
        port.unsorted += 1
        self.timer = asyncio.get_running_loop().call_later(_FIRST_TIMEOUT, self._silent)

    def _silent(self):
        self.timer = None
        log.warning("cluster: closing a connection to the link port from %s: no HELLO within %.0f s",
                    self.transport.get_extra_info("peername"), _FIRST_TIMEOUT)
        self.transport.abort()

    def _sorted(self):
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
            self.port.unsorted -= 1

    def data_received(self, data):
        inner = self.inner
        if inner is not None:
            inner.data_received(data)
            return
        self.buf += data
        if len(self.buf) <= _HEAD.size:
            if len(self.buf) > 4096:
                self.transport.abort()
            return
        n, kind = _HEAD.unpack_from(self.buf, 0)
        if kind != F.HELLO or n < 2:
            self._sorted()
            log.warning("cluster: closing a connection to the link port from %s: it did not start with HELLO",
                        self.transport.get_extra_info("peername"))
            self.transport.abort()
            return
        self._sorted()
        first = self.buf[_HEAD.size]
        inner = self.port.link_protocol() if first == ord("{") else self.port.replication_protocol()
        if inner is None:  # (no broker of this node takes links now: the other node retries)
            self.transport.abort()
            return
        self.inner = inner
        buf, self.buf = self.buf, b""
        inner.connection_made(self.transport)
        if not self.transport.is_closing():
            inner.data_received(buf)

    def eof_received(self):
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self):
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self):
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc):
        self._sorted()
        if self.inner is not None:
            self.inner.connection_lost(exc)


class _Refused(asyncio.Protocol):
    """A socket accepted past MAX_UNSORTED: closed at once, before any TLS."""

    def connection_made(self, transport):
        transport.abort()


class LinkPort:
    """`[cluster] bind`:`port`, for the process: replication connections go to
    `replication_protocol()` (a factory the manager gives), node links to the Links that
    `serve_links` named (the own broker's), while it does. `tls_server`: the server SSL
    context of [cluster] tls (links.tls_contexts), or None; `handshake_timeout`: seconds
    a TLS handshake may take."""

    def __init__(self, cfg, replication_protocol, tls_server=None, handshake_timeout=10.0):
        self.cfg = cfg
        self.replication_protocol = replication_protocol
        self.server = None
        self.port = None
        self.unsorted = 0
        self.handshakes = 0  # accepted sockets in their TLS handshake
        self._links = None
        self._tasks = set()
        self._tls = None if tls_server is None else \
            TLSPort(f"cluster link port {cfg.bind}:{cfg.port}", tls_server, handshake_timeout, self._spawn)

    async def listen(self):
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(self._accept, self.cfg.bind, self.cfg.port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    def _accept(self):
        if self.unsorted + self.handshakes >= MAX_UNSORTED:
            log.warning("cluster: refusing a connection to the link port: %d have not said what they are "
                        "(%d in their TLS handshake)", self.unsorted + self.handshakes, self.handshakes)
            return _Refused()
        if self._tls is None:
            return _Sniffer(self)
        self.handshakes += 1
        return accept_tls(_Sniffer(self), self._tls, self._handshake_over)

    def _handshake_over(self):
        self.handshakes -= 1

    def _spawn(self, coro):
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def link_protocol(self):
        links = self._links
        return None if links is None else links.accept_link()

    def serve_links(self, links):
        """Hand node links to `links` (links.Links) from now on."""
        self._links = links

    def stop_links(self, links):
        if self._links is links:
            self._links = None

    def close(self):
        if self.server is not None:
            self.server.close()
        for task in list(self._tasks):
            task.cancel()
