"""The links between nodes: one TCP connection per direction per pair of nodes.

This node opens one link to each other node it knows of (`Peer`, `OutLink`) and
accepts theirs on its link port (`InLink`); with [cluster] tls both sides present
certificates. What goes out on a link in one loop turn is gathered and written once
at the turn's end (`Links.append_out`); a live link more than [cluster] link_buffer
behind is not written to any more and catches up from the log (replay.py).

The links carry frames.py's frames; what a frame means is decided where it is handed:
forward.py (FORWARD), moves.py (SESSION_ASK, SESSION, RELAY), routes.py (ROUTE,
ROUTE_ACK) and replay.py (HELLO, RESUME, MARK).
"""

import asyncio
import logging
import ssl
import time

from ..net.tls import TLSPort, accept_tls
from . import RETRY, ClusterError
from . import frames as F

log = logging.getLogger("wrenmq.cluster")

_HELLO_BYTES = 4096  # the largest frame before a link has said who it is
_HELLO_TIMEOUT = 5.0  # seconds a link may stay silent before its HELLO
MAX_INLINKS = 256  # links from other nodes open at once, TLS handshakes included (one per node is the norm)


class Peer:
    """Another node and this node's outgoing link to it."""

    __slots__ = ("name", "address", "link", "queue", "queued", "task", "dropped", "sent", "up", "out", "out_bytes",
                 "backlog", "resume_from", "known_from", "replayed", "catch_up", "route_sent")

    def __init__(self, name, address, resume_from, known_from):
        self.name = name
        self.address = address
        self.link = None  # OutLink once connected
        self.queue = []  # frames waiting for the link to come up
        self.queued = 0
        self.task = None  # the connecting task
        self.dropped = 0
        self.sent = 0
        self.up = False
        self.out = []  # frames of this loop turn, written together at its end
        self.out_bytes = 0
        self.backlog = 0  # what the link's transport held after the last write
        # The first offset of this node's log not handed to the peer's link (set when the
        # link stops being live, and as a replay goes): where a replay starts if the peer
        # does not say in RESUME.
        self.resume_from = resume_from
        self.known_from = known_from  # the log's end when this node learned of the peer (this time)
        self.replayed = 0
        self.catch_up = None  # the task replaying to a link that fell behind
        self.route_sent = 0  # the last ROUTE seq written to its link


class OutLink(asyncio.Protocol):
    """This node's frames to one peer; the peer answers the HELLO with RESUME, each
    ROUTE with ROUTE_ACK, and says once a second how far it got (MARK)."""

    def __init__(self, cluster, peer):
        self.cluster = cluster
        self.peer = peer
        self.transport = None
        loop = asyncio.get_running_loop()
        self.closed = loop.create_future()
        self.resume = loop.create_future()  # the peer's RESUME: the last offset of our log it has
        self.reader = F.FrameReader(_HELLO_BYTES)

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        cluster = self.cluster
        cluster.links.heard[self.peer.name] = time.monotonic()
        try:
            for kind, body in self.reader.feed(data):
                if kind == F.ROUTE_ACK and self.resume.done():
                    cluster.routes.acked(self.peer, F.decode_route_ack(body))
                elif kind == F.MARK and self.resume.done():
                    cluster.replay.marked(self.peer.name, body)
                elif kind == F.RESUME and not self.resume.done():
                    self.resume.set_result(F.decode_resume(body))
                else:
                    raise F.FrameError(f"unexpected frame kind {kind}")
        except F.FrameError as e:
            log.warning("closing the link to %s: %s", self.peer.name, e)
            self.transport.abort()

    def connection_lost(self, exc):
        if not self.closed.done():
            self.closed.set_result(exc)
        self.cluster.links.link_lost(self.peer, self, exc)


class InLink(asyncio.Protocol):
    """Frames from one peer: a HELLO that names it, then messages."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.reader = F.FrameReader(_HELLO_BYTES)  # until HELLO: what a stranger can make us hold
        self.decoder = F.forward_decoder()
        self.peer = None
        self.live = False  # the sender has replayed its log here (LIVE)
        self.mark = None  # [sender's log id, last offset of it taken, its run] (Replay.applied)
        self.mark_saving = None  # (epoch id, mark[1]) saved with that epoch, not yet known durable
        self.mark_told = -1  # the last MARK sent back
        self.transport = None
        self.timer = None
        self.handshaking = False  # counted in Links.handshakes (behind the TLS handshake)

    def connection_made(self, transport):
        self.transport = transport
        cluster = self.cluster
        self._handshake_over()
        cluster.links.inlinks.add(self)
        self.timer = cluster.loop.call_later(_HELLO_TIMEOUT, self._silent)

    def _handshake_over(self):
        """No longer counted in Links.handshakes (its TLS handshake is over, or there was none)."""
        if self.handshaking:
            self.handshaking = False
            self.cluster.links.handshakes -= 1

    abandoned = _handshake_over  # (the TLS handshake failed; no connection_made comes)

    def _silent(self):
        log.warning("cluster: closing a link from %s: no HELLO within %.0f s",
                    self.transport.get_extra_info("peername"), _HELLO_TIMEOUT)
        self.transport.abort()

    def data_received(self, data):
        cluster = self.cluster
        forwarding = cluster.forwarding
        try:
            for kind, body in self.reader.feed(data):
                if kind == F.FORWARD and self.peer is not None:
                    forwarding.receive(body, self.decoder, self.mark)
                elif kind == F.SESSION_ASK and self.peer is not None:
                    cluster.moves.session_asked(self.peer, body, self)
                elif kind == F.LIVE and self.peer is not None:
                    self.live = True
                elif kind == F.SESSION and self.peer is not None:
                    cluster.moves.session_answered(body, self.mark[0] if self.mark else None)
                elif kind == F.RELAY and self.peer is not None:
                    cluster.moves.relay_arrived(body, self.decoder)
                elif kind == F.ROUTE and self.peer is not None:
                    seq, group, flt, online, removed = F.decode_route(body)
                    cluster.remote.linked(self.peer, group, flt, online, removed, seq)
                    self.transport.write(F.encode_route_ack(seq))
                elif kind == F.HELLO and self.peer is None:
                    self.peer, self.mark, resume = cluster.replay.hello_received(body)
                    cluster.replay.resume(self, resume)
                    self.timer.cancel()
                    self.reader.max_frame = max(cluster.max_frame, cluster.link_buffer + 65536)
                else:
                    raise F.FrameError(f"unexpected frame kind {kind}")
        except F.FrameError as e:
            log.warning("closing the link from %s: %s", self.peer or self.transport.get_extra_info("peername"), e)
            self.transport.abort()
            return
        if self.peer is not None:
            cluster.links.heard[self.peer] = time.monotonic()

    def connection_lost(self, exc):
        if self.timer is not None:
            self.timer.cancel()
        self.cluster.links.inlinks.discard(self)


class _RefusedLink(asyncio.Protocol):
    """An accepted link socket past MAX_INLINKS: closed at once, before any TLS."""

    def __init__(self, links):
        self.links = links

    def connection_made(self, transport):
        links = self.links
        links.refused += 1
        now = time.monotonic()
        if now - links.refused_logged >= 1.0:  # (a flood of them is a line a second)
            links.refused_logged = now
            log.warning("cluster: refusing a link from %s: %d links open, %d in their TLS handshake "
                        "(%d refused so far)", transport.get_extra_info("peername"), len(links.inlinks),
                        links.handshakes, links.refused)
        transport.abort()


# --- TLS ---------------------------------------------------------------------------


def tls_contexts(cfg):
    """(server, client) SSL contexts of mutual TLS between nodes ([cluster] tls)."""
    try:
        server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=cfg.cafile)
        server.load_cert_chain(cfg.certfile, cfg.keyfile or None)
        server.verify_mode = ssl.CERT_REQUIRED
        client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cfg.cafile)
        client.load_cert_chain(cfg.certfile, cfg.keyfile or None)
    except (OSError, ssl.SSLError) as e:
        raise ClusterError(f"[cluster] tls: cannot load certfile/keyfile/cafile: {e}") from None
    for ctx in (server, client):
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return server, client


# --- the links -----------------------------------------------------------------------


class Links:
    """This node's link port, its outgoing link to each other node (`peers`), and the
    frames written on them: `send_live`, `send` and `send_control` by what may be
    dropped, all gathered per loop turn into one write per link."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.link_buffer = cluster.link_buffer
        self.peers = {}  # node name -> Peer
        self.inlinks = set()
        self.handshakes = 0  # accepted links in their TLS handshake: they count against MAX_INLINKS
        self.refused = 0  # sockets closed at once: MAX_INLINKS open or in their handshake
        self.refused_logged = float("-inf")  # when _RefusedLink last logged
        self.server = None
        self.tls_server = None
        self.tls_client = None
        self.forwarded = 0  # messages handed to a link (or its queue)
        self.dropped = 0  # messages dropped: the link full, or its queue while it is down
        # Node name -> time.monotonic() of the last frame from it over either link (what
        # `wrenmq cluster status` shows, linkview.py).
        self.heard = {}
        # Node name -> Peer.resume_from of a node that left: if it comes back not knowing
        # where it got to (it restarted), what its subscribers missed since is replayed.
        self._left = {}
        self._port = None  # with TLS: the port as the TLS acceptor sees it (net.tls.TLSPort)
        # With [cluster] replicas > 1 the process owns the node's link port (cluster/ha/port.py)
        # and hands this node's links over while its broker runs.
        self.shared_port = None
        self._dirty = []  # peers with frames in `out`
        self._flush_scheduled = False

    # --- the link port ----------------------------------------------------------------

    async def listen(self):
        """Bind the link port, not accepting yet (`serve`); return the port bound.

        Bound now (its port is the advertised address), accepting once the node name is
        this node's (membership.py): a node restarted after a crash waits for its old
        registration to run out first, and the others, which still count that one in,
        are refused meanwhile rather than kept waiting for a RESUME."""
        cluster = self.cluster
        cfg = cluster.cfg
        if cfg.tls:
            self.tls_server, self.tls_client = tls_contexts(cfg)
            broker = cluster.broker
            self._port = TLSPort(f"cluster link port {cfg.bind}:{cfg.port}", self.tls_server,
                                 broker.config.limits.connect_timeout, broker.spawn)
        services = cluster.services
        if services is not None and services.link_port is not None:
            self.shared_port = services.link_port
            return self.shared_port.port
        self.server = await cluster.loop.create_server(self._accept, cfg.bind, cfg.port, start_serving=False)
        return self.server.sockets[0].getsockname()[1]

    async def serve(self):
        """Accept links (the node name is this node's now)."""
        if self.shared_port is not None:
            self.shared_port.serve_links(self)
        elif not self.server.is_serving():
            await self.server.start_serving()

    def close_port(self):
        if self.shared_port is not None:
            self.shared_port.stop_links(self)
        else:
            self.server.close()

    def accept_link(self):
        """The protocol of a link the shared port accepted (its TLS, if any, done there)."""
        if len(self.inlinks) + self.handshakes >= MAX_INLINKS:
            return _RefusedLink(self)
        return InLink(self.cluster)

    def _accept(self):
        """The protocol of an accepted link socket. With TLS its handshake runs first, and
        counts against MAX_INLINKS while it does: with create_server(ssl=...) a socket in
        its handshake would be invisible until the handshake is over."""
        if len(self.inlinks) + self.handshakes >= MAX_INLINKS:
            return _RefusedLink(self)
        link = InLink(self.cluster)
        if self.tls_server is None:
            return link
        # The server side of the TLS handshake, run and logged as the TLS listeners run
        # theirs (a failure is logged with its reason): the link's connection_made comes
        # once it is over, its `abandoned` if it fails.
        link.handshaking = True
        self.handshakes += 1
        return accept_tls(link, self._port)

    def close(self):
        """Every link, and the port."""
        for peer in self.peers.values():
            self._close_peer(peer)
        for link in list(self.inlinks):
            link.transport.abort()
        if self.server is not None or self.shared_port is not None:
            self.close_port()

    # --- the other nodes ----------------------------------------------------------------

    def add_peer(self, name, address):
        """Node `name` is registered with its link at `address`: link to it."""
        peer = self.peers.get(name)
        if peer is not None:
            if peer.address == address:
                return
            self._close_peer(peer)
            resume = peer.resume_from
        persist = self.cluster.persist
        now = persist.next_offset if persist is not None else 0
        if peer is None:
            resume = self._left.pop(name, now)
        peer = self.peers[name] = Peer(name, address, resume, now)
        peer.task = self.cluster.loop.create_task(self._connect(peer))

    def drop_peer(self, name):
        """Node `name` left the cluster: close its link, remember where it got to."""
        peer = self.peers.pop(name, None)
        self.heard.pop(name, None)
        if peer is not None:
            self._close_peer(peer)
            if self.cluster.gate is not None:
                self.cluster.gate.forget(peer)
            self._left[name] = peer.resume_from
            log.info("cluster: node %s left", name)

    def _down(self, peer):
        """`peer`'s link stops being live: if it was, the peer had everything of the log so
        far handed to its link (what a peer that says nothing in RESUME is replayed from)."""
        persist = self.cluster.persist
        if peer.up and persist is not None:
            peer.resume_from = persist.next_offset
        peer.up = False

    def _close_peer(self, peer):
        self._down(peer)
        if peer.task is not None:
            peer.task.cancel()
            peer.task = None
        if peer.catch_up is not None:
            peer.catch_up.cancel()
            peer.catch_up = None
        if peer.link is not None and peer.link.transport is not None:
            peer.link.transport.close()
        peer.link = None
        peer.queue = []
        peer.queued = 0

    async def _connect(self, peer):
        """Connect (and reconnect while the peer is registered) to `peer`'s link."""
        cluster = self.cluster
        replay = cluster.replay
        host, _, port = peer.address.rpartition(":")
        attempt = 0
        while self.peers.get(peer.name) is peer:
            tls = {"ssl": self.tls_client, "server_hostname": host,
                   "ssl_handshake_timeout": _HELLO_TIMEOUT} if self.tls_client is not None else {}
            try:
                _, link = await cluster.loop.create_connection(lambda: OutLink(cluster, peer), host, int(port),
                                                               **tls)
            except (OSError, ssl.SSLError) as e:
                delay = RETRY[min(attempt, len(RETRY) - 1)]
                if attempt == 2:
                    log.warning("cluster: cannot connect to node %s at %s (%s); retrying", peer.name,
                                peer.address, e)
                attempt += 1
                await asyncio.sleep(delay)
                continue
            attempt = 0
            peer.link = link
            t = link.transport
            t.write(replay.hello())
            await asyncio.wait((link.resume, link.closed), timeout=_HELLO_TIMEOUT,
                               return_when=asyncio.FIRST_COMPLETED)
            if not link.resume.done():
                if not t.is_closing():
                    log.warning("cluster: node %s did not answer the link's HELLO; reconnecting", peer.name)
                t.abort()
                await link.closed
                await asyncio.sleep(RETRY[0])
                continue
            known, announced = link.resume.result()
            await replay.bring_up(peer, link, known, announced)
            if t.is_closing() or peer.link is not link:  # lost while it caught up: again, shortly
                await asyncio.sleep(RETRY[0])
                continue
            self.go_live(peer, link)
            cluster.remote.back(peer.name)  # (its filters are known now: Replay.bring_up)
            log.info("cluster: link to node %s (%s) up", peer.name, peer.address)
            await link.closed
            self._down(peer)
            peer.link = None
            if self.peers.get(peer.name) is peer:
                log.warning("cluster: link to node %s lost; reconnecting", peer.name)
                await asyncio.sleep(RETRY[0])

    def link_lost(self, peer, link, exc):
        if peer.link is link:
            self._down(peer)
        self.cluster.routes.acked(peer)  # (none of its ROUTE_ACKs is waited for any more)

    def go_live(self, peer, link):
        """The link has everything up to the log's end: the queued frames (not in the log)
        follow, and from now on messages go straight to it. The peer is told (LIVE): with
        replicas > 1 a session it hands over waits for that (Moves.session_asked)."""
        if peer.queue:
            self.write(peer, link, peer.queue)
            peer.queue = []
            peer.queued = 0
        peer.up = True
        self.write(peer, link, [F.encode_live()])

    def replayed_here(self, name):
        """Node `name` has a link to this node whose replay of its log is over (LIVE)."""
        return any(link.peer == name and link.live and not link.transport.is_closing() for link in self.inlinks)

    @staticmethod
    def linked(peer):
        """`peer`'s link is open and has answered its HELLO (live, or replaying)."""
        link = peer.link
        return link is not None and link.resume.done() and not link.transport.is_closing()

    # --- writing --------------------------------------------------------------------------

    def send_live(self, peer, frame):
        """`frame` on `peer`'s live link, if the link holds less than [cluster] link_buffer:
        True; else False, and nothing is written."""
        if peer.out_bytes + peer.backlog < self.link_buffer or \
                peer.out_bytes + self._refresh_backlog(peer) < self.link_buffer:
            self.append_out(peer, frame)
            peer.sent += 1
            self.forwarded += 1
            return True
        return False

    def send(self, peer, frame):
        """A message that is not in the log: on the live link if it has room, else into the
        queue of a link that is not live (up to link_buffer), else dropped and counted."""
        link = peer.link
        if peer.up and link is not None:
            if self.send_live(peer, frame):
                return
        elif peer.queued < self.link_buffer:
            peer.queue.append(frame)
            peer.queued += len(frame)
            self.forwarded += 1
            return
        peer.dropped += 1
        self.dropped += 1
        if peer.dropped & (peer.dropped - 1) == 0:  # 1, 2, 4, 8...: a flood is a few lines
            log.warning("cluster: link to node %s is %s; %d message(s) for it dropped so far", peer.name,
                        "full" if peer.up else "down", peer.dropped)

    def send_control(self, peer, frame):
        """A frame that is never dropped for space (small, or a session): after this turn's
        other frames for the peer, at once on a link that is replaying (a session's
        hand-over does not wait behind a backlog), or queued for its link."""
        if peer.up and peer.link is not None:
            self.append_out(peer, frame)
        elif self.linked(peer):
            self.write(peer, peer.link, [frame])
        else:
            peer.queue.append(frame)
            peer.queued += len(frame)

    def append_out(self, peer, frame):
        """Into the peer's frames of this loop turn (written by `_flush` at its end)."""
        if not peer.out:
            self._dirty.append(peer)
            if not self._flush_scheduled:
                self._flush_scheduled = True
                self.cluster.loop.call_soon(self._flush)
        peer.out.append(frame)
        peer.out_bytes += len(frame)

    def write(self, peer, link, frames, eid=None):
        """Write `frames` on `link` (peer's) now, or with [cluster] replicas > 1 once the
        epoch they follow (`eid`: the current one if None, 0 for committed records) is
        committed (ha/gate.py)."""
        gate = self.cluster.gate
        if gate is not None:
            gate.write(peer, link, frames, eid)
        elif len(frames) == 1:
            link.transport.write(frames[0])
        else:
            link.transport.writelines(frames)

    def backlog_of(self, peer, link):
        """What waits to go out on `peer`'s `link`: in its transport, and held for the HW."""
        gate = self.cluster.gate
        n = link.transport.get_write_buffer_size()
        return n + gate.pending(peer) if gate is not None else n

    def _refresh_backlog(self, peer):
        """The link's transport may have drained since the last write: ask it again."""
        peer.backlog = self.backlog_of(peer, peer.link)
        return peer.backlog

    def _flush(self):
        """End of a loop turn: one write per link for all its frames of the turn."""
        self._flush_scheduled = False
        dirty = self._dirty
        self._dirty = []
        for peer in dirty:
            out = peer.out
            peer.out = []
            peer.out_bytes = 0
            link = peer.link
            if link is not None and not link.transport.is_closing():
                if self.cluster.gate is not None:
                    self.write(peer, link, out)
                    peer.backlog = self.backlog_of(peer, link)
                    continue
                t = link.transport
                t.write(b"".join(out) if len(out) > 1 else out[0])
                peer.backlog = t.get_write_buffer_size()
            else:
                peer.queue.extend(out)  # lost its link this turn: sent once it is back
                peer.queued += sum(map(len, out))
