"""One node of a cluster: its etcd registration and its links to the other nodes.

This is the cluster layer's I/O edge (asyncio, the etcd client, sockets); what it
decides with is sans-IO: interest.py (who wants what) and frames.py (the link).

In etcd, under `/wrenmq/<cluster name>/`, every key of a node hangs on that node's
lease, so a node that dies leaves the cluster when its lease runs out:

    nodes/<node>                     {"link": "host:port"}: where its link listens
    routes/<node>/n/<filter>         it has subscribers to <filter> (value @<change number>)
    routes/<node>/s/<share>/<filter> it has members of $share/<share>/<filter>
                                     (value 1@<n> while one of them is connected, else 0@<n>)
    clients/<client id>              <node>: the client's last connection is there
    links/<node>                     its view of its links to the others (linkview.py)

Every node watches the prefix. A PUBLISH accepted on one node is written to each
node with a matching filter over a link (one TCP connection per direction), once
per node; a retained message (or a clear) goes to every node, and a link that comes
up first sends the retained messages its node holds. A shared group gets each
message once across the cluster: the accepting node picks one node among those
with a connected member (any with members if none; if none has members, a node that
left with some, which the log keeps it for), round robin. A client that
connects to a node with clean start 0 has its session handed over from the node
that held it (handover.py); with clean start 1 its session elsewhere ends (a live
connection there is closed with 0x8E, session taken over).

What the commit log records reaches the other nodes at least once, and each node
takes it once: a FORWARD carries the message's offset in the sender's log, and
the receiver remembers the last offset it took from each sender's log (in its
state database too, with disk storage) and drops any it has had. When a link
comes up (after a failure, a restart of either side, or a `kill -9` of the
sender), the receiver says in RESUME how far it got, and the sender replays from
its log what matches the receiver's filters from there before it goes live, and
the shared groups' messages it had chosen that node for (GroupsSent). The receiver
answers the HELLO once its filters are in etcd, and the sender makes sure it knows
them before the replay passes over anything (`_routes_known`). A link that
falls behind by [cluster] link_buffer does the same once it drains, instead of
dropping: the log, not memory, holds the backlog.
"""

import asyncio
import collections
import itertools
import json
import logging
import socket
import ssl
import time
import uuid

from . import ClusterError, etcd_client, etcd_failure
from . import frames as F
from .handover import build_session, session_state
from .linkview import LinkReporter
from ..broker.topics import TopicTrie
from .interest import (CLIENTS, NODES, ROUTES, LocalInterest, RemoteInterest, SharedPicker, parse_route_key,
                       parse_route_value, route_key, route_value)

log = logging.getLogger("wrenmq.cluster")

_TXN_OPS = 100  # etcd's default --max-txn-ops is 128
_TXN_BYTES = 1 << 20  # and its default --max-request-bytes 1.5 MiB
_SYNC_CHUNK = 1000  # retained messages sent per loop turn when a link comes up
_REPLAY_SLICE = 100  # log records made into frames per loop turn by a replay
_RETRY = (0.2, 0.5, 1.0, 2.0, 5.0)
_HELLO_BYTES = 4096  # the largest frame before a link has said who it is
_HELLO_TIMEOUT = 5.0  # seconds a link may stay silent before its HELLO
_MAX_INLINKS = 256  # links from other nodes open at once, TLS handshakes included (one per node is the norm)
_HANDOVER_TIMEOUT = 2.0  # seconds a CONNECT waits for another node to hand its session over
_ROUTE_TIMEOUT = 1.0  # seconds a SUBACK waits for the other nodes to confirm its new filter
_REMOVAL_DELAY = 1.0  # seconds before a filter's removal goes to the links (Cluster.unsubscribed)
_MARKS_EVERY = 1.0  # seconds between writes of how far this node got in each sender's log
_MARKS_KEY = "cluster_applied"  # ... in the state database's meta table
_GROUPS_KEPT = 100_000  # shared-group choices remembered per node, for its replays (GroupsSent)
# A session handed to another node: for this long its old node passes on (RELAY) what other
# nodes still send it for the session (they learn where it went a link round trip later),
# and the new node remembers, for twice as long, which messages the session got, so a
# message that came both ways is delivered once: at most _SEEN_MAX messages for all such
# sessions together, past which the oldest session's memory goes first (later RELAYs
# for it are dropped).
_RELAY_FOR = 5.0
_SEEN_MAX = 1_000_000


class Peer:
    """Another node and this node's outgoing link to it."""

    __slots__ = ("name", "address", "link", "queue", "queued", "task", "dropped", "sent", "up", "out", "out_bytes",
                 "backlog", "resume_from", "known_from", "replayed", "catch_up", "route_sent")

    def __init__(self, name, address, resume_from, known_from):
        self.name = name
        self.address = address
        self.link = None  # _OutLink once connected
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


class GroupsSent:
    """The shared groups that logged messages sent to one node were chosen for there,
    by offset: until the node says it has them (MARK, `forget_before`), at most the
    last `kept` (_GROUPS_KEPT).

    A replay to that node (its link failed or fell behind, or it restarted) reads the
    log, which does not say which node a group's member was picked on: this does, so
    the node gets its groups' messages again as it gets its subscribers'. Kept per node
    name, across the node leaving and coming back; lost with this node's process.
    """

    __slots__ = ("groups", "order", "kept", "_same")

    def __init__(self, kept=_GROUPS_KEPT):
        self.kept = kept
        self.groups = {}  # offset -> tuple of (share name, filter)
        self.order = collections.deque()  # the offsets in `groups`, oldest first
        self._same = {}  # one tuple per distinct set of groups, shared by its offsets

    def add(self, off, groups):
        """Remember `groups` for offset `off`; return the offset it forgot for room, or -1."""
        key = tuple(groups)
        same = self._same
        kept = same.get(key)
        if kept is None:
            if len(same) >= 1024:
                same.clear()
            kept = same[key] = key
        self.groups[off] = kept
        order = self.order
        order.append(off)
        if len(order) > self.kept:
            old = order.popleft()
            self.groups.pop(old, None)
            return old
        return -1

    def get(self, off):
        return self.groups.get(off, ())

    def forget_before(self, off):
        """The node has everything before `off` (its RESUME said so)."""
        order = self.order
        groups = self.groups
        while order and order[0] < off:
            groups.pop(order.popleft(), None)


def _written_at(responses):
    """The etcd revision of a transaction's writes (from its responses), 0 if none."""
    revision = 0
    for r in responses:
        for field in ("response_put", "response_delete_range"):
            if r.HasField(field):
                revision = max(revision, getattr(r, field).header.revision)
    return revision


def _own_filters(session):
    """A session's filters that are its own (not a shared group's, not $SYS)."""
    return tuple(sub.filter for sub in session.subscriptions.values()
                 if sub.group is None and sub.filter[:4] != "$SYS")


def _shared_filters(session):
    """The (share name, filter) of the shared groups a session is a member of."""
    return tuple((sub.group, sub.filter) for sub in session.subscriptions.values()
                 if sub.group is not None)


class _OutLink(asyncio.Protocol):
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
        self.cluster.heard[self.peer.name] = time.monotonic()
        try:
            for kind, body in self.reader.feed(data):
                if kind == F.ROUTE_ACK and self.resume.done():
                    self.cluster._route_acked(self.peer, F.decode_route_ack(body))
                elif kind == F.MARK and self.resume.done():
                    sent = self.cluster.groups_sent.get(self.peer.name)
                    if sent is not None:
                        sent.forget_before(F.decode_mark(body) + 1)
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
        self.cluster._link_lost(self.peer, self, exc)


class _InLink(asyncio.Protocol):
    """Frames from one peer: a HELLO that names it, then messages."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.reader = F.FrameReader(_HELLO_BYTES)  # until HELLO: what a stranger can make us hold
        self.decoder = F.forward_decoder()
        self.peer = None
        self.mark = None  # [sender's log id, last offset of it taken, its run] (Cluster.applied)
        self.mark_saving = None  # (epoch id, mark[1]) saved with that epoch, not yet known durable
        self.mark_told = -1  # the last MARK sent back
        self.transport = None
        self.timer = None
        self.handshaking = False  # counted in Cluster.handshakes (behind accept_tls)

    def connection_made(self, transport):
        self.transport = transport
        cluster = self.cluster
        self._handshake_over()
        cluster.inlinks.add(self)
        self.timer = cluster.loop.call_later(_HELLO_TIMEOUT, self._silent)

    def _handshake_over(self):
        """No longer counted in Cluster.handshakes (its TLS handshake is over, or there was none)."""
        if self.handshaking:
            self.handshaking = False
            self.cluster.handshakes -= 1

    abandoned = _handshake_over  # (accept_tls: the handshake failed; no connection_made comes)

    def _silent(self):
        log.warning("cluster: closing a link from %s: no HELLO within %.0f s",
                    self.transport.get_extra_info("peername"), _HELLO_TIMEOUT)
        self.transport.abort()

    def data_received(self, data):
        cluster = self.cluster
        try:
            for kind, body in self.reader.feed(data):
                if kind == F.FORWARD and self.peer is not None:
                    cluster._received(body, self.decoder, self.mark)
                elif kind == F.SESSION_ASK and self.peer is not None:
                    cluster._session_asked(self.peer, body)
                elif kind == F.SESSION and self.peer is not None:
                    cluster._session_answered(body)
                elif kind == F.RELAY and self.peer is not None:
                    cluster._relayed(body, self.decoder)
                elif kind == F.ROUTE and self.peer is not None:
                    seq, group, flt, online, removed = F.decode_route(body)
                    cluster.remote.linked(self.peer, group, flt, online, removed, seq)
                    self.transport.write(F.encode_route_ack(seq))
                elif kind == F.HELLO and self.peer is None:
                    self.peer, self.mark, resume = cluster._hello(body)
                    cluster._resume(self, resume)
                    self.timer.cancel()
                    self.reader.max_frame = max(cluster.max_frame, cluster.link_buffer + 65536)
                else:
                    raise F.FrameError(f"unexpected frame kind {kind}")
        except F.FrameError as e:
            log.warning("closing the link from %s: %s", self.peer or self.transport.get_extra_info("peername"), e)
            self.transport.abort()
            return
        if self.peer is not None:
            cluster.heard[self.peer] = time.monotonic()

    def connection_lost(self, exc):
        if self.timer is not None:
            self.timer.cancel()
        self.cluster.inlinks.discard(self)


class _RefusedLink(asyncio.Protocol):
    """An accepted link socket past _MAX_INLINKS: closed at once, before any TLS."""

    def __init__(self, cluster):
        self.cluster = cluster

    def connection_made(self, transport):
        cluster = self.cluster
        cluster.links_refused += 1
        now = time.monotonic()
        if now - cluster.refused_logged >= 1.0:  # (a flood of them is a line a second)
            cluster.refused_logged = now
            log.warning("cluster: refusing a link from %s: %d links open, %d in their TLS handshake "
                        "(%d refused so far)", transport.get_extra_info("peername"), len(cluster.inlinks),
                        cluster.handshakes, cluster.links_refused)
        transport.abort()


class _LinkPort:
    """The link port as `listeners.accept_tls` asks a listener to be."""

    def __init__(self, cluster):
        self.broker = cluster.broker
        self.loop = cluster.loop
        self.ssl_context = cluster.tls_server
        self.label = f"cluster link port {cluster.cfg.bind}:{cluster.cfg.port}"
        self.cfg = self  # (the acceptor reads cfg.type and cfg.min_tls_version)
        self.type = "cluster"
        self.min_tls_version = "1.2"


def _tls_contexts(cfg):
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


class Cluster:
    def __init__(self, broker, cfg):
        self.broker = broker
        self.router = broker.router
        self.cfg = cfg
        self.name = cfg.name
        self.prefix = f"/wrenmq/{cfg.name}/"
        self.node = cfg.node
        self.secret = cfg.secret
        self.max_frame = broker.config.limits.max_packet_size + 65536
        self.link_buffer = cfg.link_buffer
        self.local = LocalInterest()
        self.remote = RemoteInterest()
        self.picker = SharedPicker()
        self.peers = {}  # node name -> Peer
        self.inlinks = set()
        self.handshakes = 0  # accepted links in their TLS handshake: they count against _MAX_INLINKS
        self.links_refused = 0  # sockets closed at once: _MAX_INLINKS open or in their handshake
        self.refused_logged = float("-inf")  # when _RefusedLink last logged
        self._link_port = None  # with TLS: what accept_tls asks of the port (_LinkPort)
        self.server = None
        self.advertise = None
        self.etcd = None
        self.lease = None
        self.loop = None
        self._pending = {}  # etcd key -> value to put, or None to delete
        self._pending_clients = set()  # client ids whose registration is in _pending or in flight
        self._owned = {}  # client id -> revision of this node's registration
        self._foreign = {}  # client id -> newest revision of another node's, seen while ours was in flight
        self._flushing = None
        self._main = None
        self._stopping = False
        self.forwarded = 0
        self.received = 0
        self.dropped = 0
        self.takeovers = 0
        self.handed_over = 0  # sessions this node gave to another
        self.taken_over = 0  # sessions this node took from another
        self.etcd_up = False
        self.revision = 0  # how far this node has read etcd (the watch, or a full read)
        self.written = 0  # the etcd revision of this node's last write there
        # The etcd revision by which this node's filters were all in etcd when it last
        # (re)joined; None while it (re)joins: HELLOs wait for it (`_resume`), so a node
        # replaying to this one can know its filters first (`_routes_known`).
        self.announced = None
        self._resumes_due = []  # (_InLink, offset) of HELLOs waiting for `announced`
        self._asks = {}  # request id -> (future of a SESSION answer, the client id asked for)
        self._dirty = []  # peers with frames in `out`
        self._flush_scheduled = False
        self._ids = itertools.count(1)
        # The commit log, when there is one: links replay from it (see the module docstring).
        self.persist = broker.router.persist
        store = self.persist.store if self.persist is not None else None
        self.log_id = store.log_id if store is not None else ""
        self.log_from = store.opened_at if store is not None else 0
        self.run_id = uuid.uuid4().hex  # this process, in HELLO: a restart is told from a reconnect
        # Sender node -> [its log id, last offset of it taken here, its run]; with disk
        # storage kept in the state database (a second behind at most, and never behind
        # a QoS 2 message a persistent session here was given: _received), so a restart
        # still knows where to resume each sender's log from.
        self.applied = self._load_marks()
        self._marks_dirty = False
        self._saver = None
        self.replayed = 0  # records sent again from the log (link up, or drained)
        self.duplicates = 0  # FORWARDs dropped here: their offset was taken before
        self.replay_lost = 0  # records a replay needed that retention had deleted, or whose group it forgot
        self.groups_sent = {}  # node name -> GroupsSent
        self.fell_behind = 0  # times a live link was full past link_buffer and went to replay
        # ROUTE frames: a new subscription's SUBACK waits until the nodes linked to this
        # one have it (a message published there after the SUBACK reaches it).
        self.route_seq = 0
        self._route_waits = []  # [{peer: seq still to be acknowledged}, callback, timer]
        self.route_timeouts = 0
        # Node name -> Peer.resume_from of a node that left: if it comes back not knowing
        # where it got to (it restarted), what its subscribers missed since is replayed.
        self._left = {}
        # (when, group, filter, seq, etcd too) for the links (and etcd), oldest first
        self._removals = collections.deque()
        self._moving_out = ()  # (group, filter) of a session being handed over (_session_asked)
        self._removals_timer = None
        # Sessions that just changed node, each until _RELAY_FOR (old node) or twice that
        # (new node) has passed, in deques in that order. On the old node: the sessions'
        # filters -> {client id: (the new node, until when)}, and the same for its shared
        # groups by (share name, filter); on the new one: client id -> (session, {(log
        # id, offset) it got}, until when).
        self._relays = TopicTrie()
        self._group_relays = {}
        self._relays_due = collections.deque()  # (until, client id, filters, groups)
        self._moved_in = {}
        self._moved_due = collections.deque()  # (until, client id)
        self._seen_total = 0  # messages remembered in _moved_in
        self.relayed = 0  # messages passed on to the node a session moved to
        # Node name -> time.monotonic() of the last frame from it over either link, and what
        # writes this node's view of its links to etcd for `wrenmq cluster status`.
        self.heard = {}
        self.link_view = None
        # What this node tells the others besides its link address (advertise_info), in its
        # registration: put again with it when the node re-joins.
        self.info = {}

    # --- lifecycle -------------------------------------------------------------

    async def start(self):
        """Listen for links, join through etcd; raises ClusterError if that fails."""
        self.loop = asyncio.get_running_loop()
        cfg = self.cfg
        self.tls_server = self.tls_client = None
        if cfg.tls:
            self.tls_server, self.tls_client = _tls_contexts(cfg)
            self._link_port = _LinkPort(self)
        # Bound now (its port is the advertised address), accepting once the node name is
        # this node's (`_register`): a node restarted after a crash waits for its old
        # registration to run out first, and the others, which still count that one in,
        # are refused meanwhile rather than kept waiting for a RESUME.
        self.server = await self.loop.create_server(self._accept, cfg.bind, cfg.port, start_serving=False)
        port = self.server.sockets[0].getsockname()[1]
        self.advertise = cfg.advertise or f"{cfg.bind}:{port}"
        if not self.node:
            from ..config import cluster_node_name
            config = self.broker.config
            self.node = cluster_node_name(config) if config.listener[0].port else f"{socket.gethostname()}-{port}"
        last = None
        for endpoint in cfg.etcd:
            client = None
            try:
                client = etcd_client(cfg, endpoint)
                await client.connect()
                await client.status()
                self.etcd = client
                self.endpoint = endpoint
                break
            except Exception as e:  # any failure (no etcd client installed included): the next endpoint
                last = e
                if client is not None:
                    await client.close()
        if self.etcd is None:
            self.server.close()
            raise ClusterError(f"cannot reach etcd at {', '.join(cfg.etcd)} ([cluster] etcd): "
                               f"{etcd_failure(cfg, last)}")
        try:
            await self._register()
        except BaseException as e:
            self.server.close()
            await self.etcd.close()
            if isinstance(e, Exception) and not isinstance(e, ClusterError):
                raise ClusterError(f"joining through etcd {self.endpoint} failed: {type(e).__name__}: {e}") from e
            raise
        self._main = self.loop.create_task(self._run())
        self._saver = self.loop.create_task(self._marks_every(_MARKS_EVERY))
        self.link_view = LinkReporter(self)
        self.link_view.start()
        log.info("cluster %s: node %s joined through etcd %s; links on %s; %d other node(s)",
                 self.name, self.node, self.endpoint, self.advertise, len(self.peers))

    async def stop(self):
        """Leave at once (revoke the lease: the others drop this node's keys now)."""
        self._stopping = True
        self.router.cluster = None
        if self._main is not None:
            self._main.cancel()
        if self._saver is not None:
            self._saver.cancel()
            if self.persist is not None:
                self._save_marks()
        if self.link_view is not None:
            self.link_view.stop()
        if self._flushing is not None:
            self._flushing.cancel()
        if self._removals_timer is not None:
            self._removals_timer.cancel()
        for peer in self.peers.values():
            self._close_peer(peer)
        for link in list(self.inlinks):
            link.transport.abort()
        if self.server is not None:
            self.server.close()
        if self.etcd is not None:
            try:
                if self.lease is not None:
                    await asyncio.wait_for(self.lease.revoke(), self.cfg.etcd_timeout)
            except Exception as e:
                log.warning("cluster: could not revoke the lease on leaving (%s); the node's keys "
                            "go when it runs out", e)
            await self.etcd.close()

    def _accept(self):
        """The protocol of an accepted link socket. With TLS its handshake runs first
        (accept_tls, as on the TLS listeners, so a failure is logged with its reason), and
        counts against _MAX_INLINKS while it does: with create_server(ssl=...) a socket in
        its handshake would be invisible until the handshake is over."""
        if len(self.inlinks) + self.handshakes >= _MAX_INLINKS:
            return _RefusedLink(self)
        link = _InLink(self)
        if self.tls_server is None:
            return link
        from ..broker.listeners import accept_tls

        link.handshaking = True
        self.handshakes += 1
        return accept_tls(link, self._link_port)

    async def _register(self):
        """Take a lease, claim the node name, publish interest and clients, read the rest."""
        etcd = self.etcd
        self.announced = None  # (the links' HELLOs wait until the filters are written)
        self.lease = await etcd.lease(self.cfg.lease_ttl)
        key = f"{self.prefix}{NODES}{self.node}".encode()
        tx = etcd.transactions
        # A node restarted right after a crash finds its old registration until the old
        # lease runs out: wait that long before calling the name taken.
        deadline = time.monotonic() + self.cfg.lease_ttl + 2
        waited = False
        while True:
            ok, responses = await etcd.transaction(
                compare=[tx.create(key) == 0],
                success=[tx.put(key, self._registration(), lease=self.lease)],
                failure=[])
            if ok or time.monotonic() >= deadline:
                break
            if not waited:
                log.info("cluster: node name %r is registered; waiting up to %d s for that registration "
                         "to expire (a restart after a crash)", self.node, self.cfg.lease_ttl)
                waited = True
            await asyncio.sleep(0.5)
            await self.lease.refresh()  # ours must outlive the wait
        if not ok:
            await self.lease.revoke()
            self.lease = None
            raise ClusterError(f"node name {self.node!r} is already taken in cluster {self.name!r} "
                               f"(a live node holds it; set [cluster] node)")
        if not self.server.is_serving():
            await self.server.start_serving()  # (the links' HELLOs are answered once the filters are written)
        # This node's interest and clients as they are now; from here on the router
        # reports changes (router.cluster is set in the same step: nothing is missed).
        router = self.router
        local = self.local = LocalInterest()
        self._pending.clear()
        self._owned.clear()
        self._pending_clients.clear()
        for cid, session in router.sessions.items():
            for sub in session.subscriptions.values():
                local.add(sub.group, sub.filter, session.conn is not None)
            self._register_client(cid)
        seq = self._next_seq()
        for group, flt in local.counts:
            self._pending[route_key(self.prefix, self.node, group, flt)] = route_value(local.value(group, flt), seq)
        router.cluster = self
        self.written = max(self.written, _written_at(responses))
        await self._flush_pending()
        self._announce()
        await self._resync()

    def _registration(self):
        return json.dumps({**self.info, "link": self.advertise}).encode()

    def advertise_info(self, key, value):
        """Tell the other nodes `key` = `value` about this node (where its admin listener is,
        say), in its registration in etcd; `read_info` reads them back."""
        self.info[key] = value
        if self.lease is not None:
            self.loop.create_task(self._put_registration())

    async def _put_registration(self):
        try:
            await self.etcd.put(f"{self.prefix}{NODES}{self.node}".encode(), self._registration(),
                                lease=self.lease)
        except Exception as e:  # the next re-join writes it again
            log.warning("cluster: could not update this node's registration in etcd: %s", e)

    async def read_info(self, key):
        """{node: value} of `key` as each node told it (advertise_info), read from etcd now."""
        got = await asyncio.wait_for(self.etcd.get_prefix(f"{self.prefix}{NODES}".encode()),
                                     self.cfg.etcd_timeout)
        out = {}
        start = len(self.prefix) + len(NODES)
        for kv in got:
            try:
                value = json.loads(kv.value).get(key)
            except (ValueError, AttributeError):
                continue
            if value is not None:
                out[kv.key.decode("utf-8", "replace")[start:]] = value
        return out

    async def _resync(self):
        """Read every key of the cluster (the other nodes, their interest, the clients) and
        the revision the watch goes on from."""
        got = await self.etcd.get_prefix(self.prefix.encode())
        nodes = f"{self.prefix}{NODES}".encode()
        registered = {kv.key[len(nodes):].decode("utf-8", "replace") for kv in got if kv.key.startswith(nodes)}
        for name in [name for name in self.peers if name not in registered]:
            self._drop_peer(name)  # (left while this node did not watch: before clear() forgets its groups)
        self.remote.clear()
        seen = set()
        for kv in got:
            name = self._apply(kv.key, kv.value, kv.mod_revision, True)
            if name:
                seen.add(name)
        self.remote.restore_told()
        for name in list(self.peers):
            if name not in seen:
                self._drop_peer(name)
        self.revision = got.header.revision
        self.etcd_up = True

    # --- the etcd session: keepalive, watch, reconnect --------------------------

    async def _run(self):
        while not self._stopping:
            try:
                await self._watch_and_keep_alive()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.etcd_up = False
                log.warning("cluster: etcd session lost (%s: %s); routing with what is known, rejoining",
                            type(e).__name__, e)
            await self._rejoin()

    async def _rejoin(self):
        """Back to etcd: resync if the lease lived, else join again; retried with a backoff,
        a log line a minute while it fails."""
        attempt = 0
        said = 0.0
        while not self._stopping:
            await asyncio.sleep(_RETRY[min(attempt, len(_RETRY) - 1)])
            attempt += 1
            try:
                alive = self.lease is not None and (await self.lease.remaining_ttl()) > 0
                if alive:
                    await self._flush_pending()
                    if self.announced is None:  # (a _register that failed after its claim)
                        self._announce()
                    await self._resync()
                else:
                    log.warning("cluster: this node's lease ran out; joining again")
                    await self._register()
                log.info("cluster: etcd session back (after %d attempt(s))", attempt)
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                now = time.monotonic()
                if now - said >= 60:
                    said = now
                    log.warning("cluster: rejoining through etcd failed (%s: %s); retrying", type(e).__name__, e)

    async def _watch_and_keep_alive(self):
        watch = await self.etcd.watch_prefix(self.prefix.encode(), start_revision=self.revision + 1, prev_kv=True)
        keepalive = self.loop.create_task(self._keep_alive())
        try:
            events = watch.__aiter__()
            while True:
                nxt = asyncio.ensure_future(events.__anext__())
                done, _ = await asyncio.wait((nxt, keepalive), return_when=asyncio.FIRST_COMPLETED)
                if keepalive in done:
                    nxt.cancel()
                    keepalive.result()  # raises what stopped it
                    raise ConnectionError("keepalive stopped")
                ev = nxt.result()
                kv = ev.kv
                self.revision = kv.mod_revision
                if ev.kind == "PUT":
                    self._apply(kv.key, kv.value, kv.mod_revision, False)
                else:
                    self._apply(kv.key, None, kv.mod_revision, False, ev.prev_kv.value if ev.prev_kv else None)
        finally:
            keepalive.cancel()
            try:
                await watch.cancel()
            except Exception:
                pass

    async def _keep_alive(self):
        period = max(0.5, self.cfg.lease_ttl / 3)
        while True:
            await asyncio.sleep(period)
            reply = await self.lease.refresh()
            ttl = getattr(reply[0] if isinstance(reply, list) and reply else reply, "TTL", 1)
            if ttl <= 0:
                raise ConnectionError("lease expired")

    # --- what etcd says ------------------------------------------------------------

    def _apply(self, key, value, revision, initial, deleted_value=None):
        """One key of the cluster prefix was put (`value`) or deleted (None; `deleted_value`:
        what it held, if etcd said). Returns the node name when the key is a node's
        registration."""
        rest = key.decode("utf-8", "replace")[len(self.prefix):]
        if rest.startswith(NODES):
            name = rest[len(NODES):]
            if name == self.node:
                if value is None and not self._stopping and not initial:
                    log.warning("cluster: etcd dropped this node's registration")
                    raise ConnectionError("registration lost")
                return name
            if value is None:
                self._drop_peer(name)
                return None
            try:
                address = json.loads(value)["link"]
            except (ValueError, KeyError, TypeError):
                log.warning("cluster: ignoring node %s with a malformed registration", name)
                return None
            self._add_peer(name, address)
            return name
        if rest.startswith(ROUTES):
            parsed = parse_route_key(rest[len(ROUTES):])
            if parsed is None or parsed[0] == self.node:
                return None
            node, group, flt = parsed
            if value is None:
                self.remote.deleted(node, group, flt,
                                    parse_route_value(deleted_value)[1] if deleted_value is not None else -1)
            else:
                self.remote.put(node, group, flt, *parse_route_value(value))
            return None
        if rest.startswith(CLIENTS) and value is not None:
            cid = rest[len(CLIENTS):]
            if value.decode("utf-8", "replace") != self.node:
                self._client_elsewhere(cid, revision)
        return None

    def _client_elsewhere(self, cid, revision):
        if cid in self._pending_clients:
            if revision > self._foreign.get(cid, 0):
                self._foreign[cid] = revision
            return
        mine = self._owned.get(cid)
        if mine is not None and revision < mine:
            return
        self._owned.pop(cid, None)
        if cid in self.router.sessions:
            self.takeovers += 1
            self.router.moved_away(cid)

    # --- what the router tells ----------------------------------------------------

    def _next_seq(self):
        """The number of this node's next change of its filters: growing, across restarts
        too (microseconds of the wall clock, or one more than the last)."""
        self.route_seq = max(self.route_seq + 1, time.time_ns() // 1000)
        return self.route_seq

    def subscribed(self, group, flt, online=False):
        if self.local.add(group, flt, online):
            flag = self.local.value(group, flt)
            seq = self._next_seq()
            self._pending[route_key(self.prefix, self.node, group, flt)] = route_value(flag, seq)
            self._kick()
            self._route_to_links(group, flt, flag != b"0", False, seq)

    def _route_to_links(self, group, flt, online, removed, seq):
        """The other nodes learn a change of this node's filters over the links now, and
        from etcd one round trip later (interest.py). A filter added and removed before
        etcd is written is never in etcd: without the removal here, the nodes linked
        would keep it."""
        if flt[:4] == "$SYS":
            return  # each node's own: never forwarded, nothing to wait for
        frame = F.encode_route(seq, group, flt, online, removed)
        for peer in self.peers.values():
            if self._linked(peer):
                self._send_control(peer, frame)
                peer.route_sent = seq

    def after_routes(self, since, callback):
        """Call `callback` once every linked node has applied this node's ROUTEs after seq
        `since` (at once if there are none; a node that does not answer within
        _ROUTE_TIMEOUT, or whose link goes, is not waited for)."""
        waiting = {peer: peer.route_sent for peer in self.peers.values() if peer.route_sent > since}
        if not waiting:
            callback()
            return
        entry = [waiting, callback, None]
        entry[2] = self.loop.call_later(_ROUTE_TIMEOUT, self._routes_late, entry)
        self._route_waits.append(entry)

    def _routes_late(self, entry):
        if entry in self._route_waits:
            self.route_timeouts += 1
            if self.route_timeouts & (self.route_timeouts - 1) == 0:  # 1, 2, 4, 8...: a few lines
                log.warning("cluster: node(s) %s did not confirm a new subscription within %.0f s; its SUBACK "
                            "goes anyway (%d time(s) so far)", ", ".join(p.name for p in entry[0]),
                            _ROUTE_TIMEOUT, self.route_timeouts)
            self._route_waits.remove(entry)
            entry[1]()

    def _route_acked(self, peer, seq=None):
        """`peer` applied ROUTEs up to `seq` (None: its link is gone, wait no more for it)."""
        done = []
        for entry in self._route_waits:
            want = entry[0].get(peer)
            if want is not None and (seq is None or seq >= want):
                del entry[0][peer]
                if not entry[0]:
                    done.append(entry)
        for entry in done:
            self._route_waits.remove(entry)
            entry[2].cancel()
            entry[1]()

    def unsubscribed(self, group, flt, online=False):
        change = self.local.remove(group, flt, online)
        if change is not None:
            seq = self._next_seq()
            key = route_key(self.prefix, self.node, group, flt)
            if change != "delete":
                self._pending[key] = route_value(self.local.value(group, flt), seq)
                self._kick()
                self._route_to_links(group, flt, False, False, seq)
                return
            # The removal goes to the links a second later, and only if the filter is still
            # gone then: etcd tells the other nodes first, as it always has. A session
            # that moves to another node drops its filters here while that node adds
            # them: its ROUTEs must reach the others before this removal does, or what
            # they publish in between goes nowhere. So such a filter leaves etcd a second
            # later too: a node that saw etcd's delete before the new node's ROUTE would
            # take (and acknowledge) messages for the session and send them nowhere, while
            # a node that still sends them here has them passed on (RELAY). What the links
            # still need is a filter added and removed before etcd was written, which
            # etcd never tells.
            later = (group, flt) in self._moving_out
            if not later:
                self._pending[key] = None
                self._kick()
            self._removals.append((self.loop.time() + _REMOVAL_DELAY, group, flt, seq, later))
            if self._removals_timer is None:
                self._removals_timer = self.loop.call_later(_REMOVAL_DELAY, self._removals_due)

    def _removals_due(self):
        self._removals_timer = None
        removals = self._removals
        now = self.loop.time()
        while removals and removals[0][0] <= now:
            _, group, flt, seq, etcd_too = removals.popleft()
            if (group, flt) not in self.local.counts:
                if etcd_too:
                    self._pending[route_key(self.prefix, self.node, group, flt)] = None
                    self._kick()
                self._route_to_links(group, flt, False, True, seq)
        if removals:
            self._removals_timer = self.loop.call_later(removals[0][0] - now, self._removals_due)

    def presence(self, session, online):
        """`session`'s client connected (True) or went (False): its shared groups' keys
        say whether a member here can take a message now."""
        delta = 1 if online else -1
        local = self.local
        for sub in session.subscriptions.values():
            if sub.group is not None and local.connected(sub.group, sub.filter, delta):
                self._pending[route_key(self.prefix, self.node, sub.group, sub.filter)] = \
                    route_value(local.value(sub.group, sub.filter), self._next_seq())
                self._kick()

    def _register_client(self, cid):
        self._pending[f"{self.prefix}{CLIENTS}{cid}".encode()] = self.node.encode()
        self._pending_clients.add(cid)

    def client_connected(self, cid):
        self._register_client(cid)
        self._kick()

    def client_gone(self, cid):
        if self._owned.pop(cid, None) is not None or cid in self._pending_clients:
            self._pending[f"{self.prefix}{CLIENTS}{cid}".encode()] = None
            self._kick()

    def _kick(self):
        if self._flushing is None and self.etcd_up and not self._stopping:
            self._flushing = self.loop.create_task(self._flush_soon())

    async def _flush_soon(self):
        try:
            await asyncio.sleep(0)  # the rest of this loop turn's changes go in the same request
            await self._flush_pending()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("cluster: writing to etcd failed (%s: %s); retried when etcd is back",
                        type(e).__name__, e)
        finally:
            self._flushing = None

    async def _flush_pending(self):
        """Write what changed, in transactions of at most _TXN_OPS keys."""
        etcd = self.etcd
        tx = etcd.transactions
        client_keys = f"{self.prefix}{CLIENTS}".encode()
        skip = len(client_keys)
        while self._pending:
            batch = []
            size = 0
            for key in list(self._pending)[:_TXN_OPS]:
                value = self._pending[key]
                size += len(key) + len(value or b"")
                if batch and size > _TXN_BYTES:
                    break
                batch.append((key, self._pending.pop(key)))
            ops = [tx.put(k, v, lease=self.lease) if v is not None else tx.delete(k) for k, v in batch]
            try:
                _, responses = await etcd.transaction(compare=[], success=ops, failure=[])
            except BaseException:
                for k, v in batch:  # a newer change to the same key wins
                    self._pending.setdefault(k, v)
                raise
            revision = _written_at(responses)
            self.written = max(self.written, revision)
            for k, v in batch:
                if k.startswith(client_keys):
                    cid = k[skip:].decode()
                    if self._pending.get(k, v) is not v:
                        continue  # changed again meanwhile: that write decides
                    self._pending_clients.discard(cid)
                    foreign = self._foreign.pop(cid, 0)
                    if v is None:
                        continue
                    self._owned[cid] = revision
                    if foreign > revision:
                        self._client_elsewhere(cid, foreign)

    # --- links ----------------------------------------------------------------------

    def _add_peer(self, name, address):
        peer = self.peers.get(name)
        if peer is not None:
            if peer.address == address:
                return
            self._close_peer(peer)
            resume = peer.resume_from
        now = self.persist.next_offset if self.persist is not None else 0
        if peer is None:
            resume = self._left.pop(name, now)
        peer = self.peers[name] = Peer(name, address, resume, now)
        peer.task = self.loop.create_task(self._connect(peer))

    def _down(self, peer):
        """`peer`'s link stops being live: if it was, the peer had everything of the log so
        far handed to its link (what a peer that says nothing in RESUME is replayed from)."""
        if peer.up and self.persist is not None:
            peer.resume_from = self.persist.next_offset
        peer.up = False

    def _drop_peer(self, name):
        peer = self.peers.pop(name, None)
        self.heard.pop(name, None)
        if peer is not None:
            self._close_peer(peer)
            self._left[name] = peer.resume_from
            log.info("cluster: node %s left", name)
        self.remote.left(name)  # (its shared groups are kept until it is back: route)

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
        host, _, port = peer.address.rpartition(":")
        attempt = 0
        while self.peers.get(peer.name) is peer:
            tls = {"ssl": self.tls_client, "server_hostname": host,
                   "ssl_handshake_timeout": _HELLO_TIMEOUT} if self.tls_client is not None else {}
            try:
                _, link = await self.loop.create_connection(lambda: _OutLink(self, peer), host, int(port), **tls)
            except (OSError, ssl.SSLError) as e:
                delay = _RETRY[min(attempt, len(_RETRY) - 1)]
                if attempt == 2:
                    log.warning("cluster: cannot connect to node %s at %s (%s); retrying", peer.name,
                                peer.address, e)
                attempt += 1
                await asyncio.sleep(delay)
                continue
            attempt = 0
            peer.link = link
            t = link.transport
            t.write(F.encode_hello(self.name, self.node, self.secret, self.log_id, self.log_from, self.run_id))
            await asyncio.wait((link.resume, link.closed), timeout=_HELLO_TIMEOUT,
                               return_when=asyncio.FIRST_COMPLETED)
            if not link.resume.done():
                if not t.is_closing():
                    log.warning("cluster: node %s did not answer the link's HELLO; reconnecting", peer.name)
                t.abort()
                await link.closed
                await asyncio.sleep(_RETRY[0])
                continue
            known, announced = link.resume.result()
            await self._send_retained(link)
            if not t.is_closing() and self.persist is not None:
                if known >= 0:
                    start = known + 1
                elif known == -2:  # (it started after this node last knew it: nothing older is for it)
                    start = max(peer.resume_from, peer.known_from)
                else:
                    start = peer.resume_from
                if start >= self.persist.next_offset or await self._routes_known(peer, link, announced):
                    await self._replay(peer, link, start)
            if t.is_closing() or peer.link is not link:  # lost while it caught up: again, shortly
                await asyncio.sleep(_RETRY[0])
                continue
            self._go_live(peer, link)
            self.remote.back(peer.name)  # (its filters are known now: _routes_known)
            log.info("cluster: link to node %s (%s) up", peer.name, peer.address)
            await link.closed
            self._down(peer)
            peer.link = None
            if self.peers.get(peer.name) is peer:
                log.warning("cluster: link to node %s lost; reconnecting", peer.name)
                await asyncio.sleep(_RETRY[0])

    def _link_lost(self, peer, link, exc):
        if peer.link is link:
            self._down(peer)
        if self._route_waits:
            self._route_acked(peer)

    async def _send_retained(self, link):
        """The retained messages this node holds (not $SYS: each node has its own), a
        chunk per loop turn. Live messages for the peer wait in its queue meanwhile and
        follow, so a retained message changed during the sync ends up as changed."""
        t = link.transport
        retained = list(self.router.retained.values())
        for i in range(0, len(retained), _SYNC_CHUNK):
            now = self.router.clock()
            for msg in retained[i:i + _SYNC_CHUNK]:
                if msg.topic.startswith("$SYS") or msg.expired(now):
                    continue
                t.write(F.encode_forward(F.publish_bytes(msg, now), F.SYNC, msg.client_id, msg.timestamp))
            if t.is_closing():
                return
            await asyncio.sleep(0)

    def _hello(self, body):
        """A link's HELLO: (the sending node, its mark in `applied`, the offset RESUME tells
        it: the mark's, or for a log not heard from before -1 (the sender decides where
        to start) or, on a node that keeps nothing across restarts, -2 (nothing from
        before the sender last learned of this node is for it: every session here is
        newer))."""
        cluster, node, secret, log_id, log_from, run = F.decode_hello(body)
        if cluster != self.name or secret != self.secret:
            raise F.FrameError(f"HELLO from node {node!r} of cluster {cluster!r}: wrong cluster or secret")
        mark = self.applied.get(node)
        if mark is None or not log_id or mark[0] != log_id:
            mark = self.applied[node] = [log_id, -1, run]
            return node, mark, -1 if self.persist is not None else -2
        if mark[2] != run:
            mark[2] = run
            if mark[1] >= log_from:
                # The sender restarted, and what it had sent from `log_from` on had not
                # reached its disk: those offsets now belong to other messages.
                mark[1] = log_from - 1
        log.info("cluster: link from node %s up", node)
        return node, mark, mark[1]

    def _announce(self):
        """This node's filters are all in etcd (it has just (re)joined): answer the HELLOs
        that waited for it."""
        self.announced = self.written
        due, self._resumes_due = self._resumes_due, []
        for link, offset in due:
            if not link.transport.is_closing():
                self._resume(link, offset)

    def _resume(self, link, offset):
        """Answer a link's HELLO with RESUME: `offset`, and the revision by which this
        node's filters are in etcd. While it (re)joins, once they are written (`_register`):
        the sender replays what they match, and must be able to know them first."""
        if self.announced is None:
            self._resumes_due.append((link, offset))
        else:
            link.transport.write(F.encode_resume(offset, self.announced))

    async def _routes_known(self, peer, link, announced):
        """Make sure this node knows `peer`'s filters before it replays to it (it sends only
        what they match, and a record passed over is not sent again): they are in etcd by
        revision `announced` (its RESUME). Known if this node's watch has gone past it;
        else (the peer has just (re)joined, and its link came up before the watch brought
        its filters) read from etcd, again while that fails. False if the link went."""
        if self.revision > announced:
            return True
        key = f"{self.prefix}{ROUTES}{peer.name}/".encode()
        attempt = 0
        while not link.transport.is_closing() and peer.link is link:
            try:
                got = await asyncio.wait_for(self.etcd.get_prefix(key), self.cfg.etcd_timeout)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if attempt == 0:
                    log.warning("cluster: cannot read node %s's subscriptions from etcd (%s: %s); its replay "
                                "waits until they are read", peer.name, type(e).__name__, e)
                await asyncio.sleep(_RETRY[min(attempt, len(_RETRY) - 1)])
                attempt += 1
                continue
            for kv in got:
                parsed = parse_route_key(kv.key.decode("utf-8", "replace")[len(self.prefix) + len(ROUTES):])
                if parsed is not None and parsed[0] == peer.name:
                    self.remote.read(*parsed, *parse_route_value(kv.value))
            return True
        return False

    def _go_live(self, peer, link):
        """The link has everything up to the log's end: the queued frames (not in the log)
        follow, and from now on messages go straight to it."""
        t = link.transport
        if peer.queue:
            t.writelines(peer.queue)
            peer.queue = []
            peer.queued = 0
        peer.up = True

    async def _replay(self, peer, link, start):
        """Write to `peer` what this node's log holds for it from offset `start` on, a
        chunk per loop turn and only as fast as the link drains; True once it has reached
        the log's end (the caller goes live in the same step), False if the link went."""
        persist = self.persist
        t = link.transport
        cursor = start
        half = self.link_buffer // 2
        first = True
        sent = self._groups_sent_to(peer.name)  # (choices made while it replays are found as it goes)
        sent.forget_before(start)
        while True:
            if t.is_closing() or peer.link is not link:
                return False
            if t.get_write_buffer_size() > half:
                await asyncio.sleep(0.01)
                continue
            end = persist.next_offset
            if cursor >= end:
                peer.resume_from = end
                return True
            if cursor < persist.start_offset:
                lost = persist.start_offset - cursor
                self.replay_lost += lost
                log.warning("cluster: %d record(s) for node %s were deleted by [log] retention before "
                            "its link could take them", lost, peer.name)
                cursor = persist.start_offset
                continue
            if first:
                first = False
                if peer.catch_up is None:  # (a link behind is logged by _fall_behind)
                    log.info("cluster: replaying node %s's messages from offset %d (log end %d)", peer.name,
                             cursor, end)
            recs = persist.read(cursor, 500)
            if not recs:  # a damaged stretch of the log (logged by the reader): skip it
                cursor = min(cursor + 500, end)
                continue
            # The frames in slices, a loop turn each: the read costs a turn 1.5-2.5 ms
            # (4 KiB records), each slice's frames 0.5 ms more (docs/BENCHMARKS.md).
            for i in range(0, len(recs), _REPLAY_SLICE):
                if i and (t.is_closing() or peer.link is not link):
                    return False
                now = self.router.clock()
                frames = []
                for rec in recs[i:i + _REPLAY_SLICE]:
                    cursor = rec.offset + 1
                    frame = self._replay_frame(peer.name, rec, now, sent)
                    if frame is not None:
                        frames.append(frame)
                if frames:
                    t.writelines(frames)
                    peer.replayed += len(frames)
                    self.replayed += len(frames)
                peer.resume_from = cursor
                await asyncio.sleep(0)

    def _replay_frame(self, name, rec, now, sent=None):
        """The FORWARD of one log record for node `name`, if it is for it (its filters as
        they are now; a retained message for every node; the shared groups `sent` says
        were chosen there when it was published), else None."""
        if rec.private:
            return None
        nodes, _ = self.remote.match(rec.topic)
        to_subs = name in nodes
        groups = sent.get(rec.offset) if sent is not None else ()
        if not to_subs and not rec.retain and not groups:
            return None
        msg = self.persist.message_from_record(rec)
        if msg.expired(now):
            return None
        flags = F.REPLAYED | (F.TO_SUBSCRIBERS if to_subs else 0) | (F.SET_RETAINED if rec.retain else 0)
        return F.encode_forward(F.publish_bytes(msg, now), flags, msg.client_id, msg.timestamp, groups, rec.offset)

    def _load_marks(self):
        if self.persist is None:
            return {}
        raw = self.persist.store.meta_at_open.get(_MARKS_KEY)
        try:
            marks = json.loads(raw) if raw else {}
            return {str(k): [str(v[0]), int(v[1]), str(v[2])] for k, v in marks.items()}
        except (ValueError, TypeError, IndexError, AttributeError):
            log.warning("cluster: ignoring an unreadable %s in the state database", _MARKS_KEY)
            return {}

    def _save_marks(self):
        """How far this node got in each sender's log, to the state database with the
        records of this epoch (so never ahead of what it stored of those messages)."""
        if self._marks_dirty:
            self._marks_dirty = False
            self.persist.store.set_meta(_MARKS_KEY, json.dumps(self.applied))

    async def _marks_every(self, period):
        while True:
            await asyncio.sleep(period)
            try:
                self._marks_now()
            except Exception:  # (a bug here must not stop the saves for good)
                log.exception("cluster: saving or telling how far this node got failed")

    def _marks_now(self):
        """Once a second: save the marks, and tell each sender how far this node got (MARK)."""
        store = self.persist.store if self.persist is not None else None
        if store is not None:
            self._save_marks()
        for link in self.inlinks:
            mark = link.mark
            if mark is None or link.transport is None or link.transport.is_closing():
                continue
            # Tell the sender how far this node got: with disk storage, as far as a
            # save that is durable now says (a restart resumes from there), else what
            # it took.
            if store is None:
                told = mark[1]
            else:
                told = link.mark_told
                saving = link.mark_saving
                if saving is not None and store.durable_id >= saving[0]:
                    told = saving[1]
                    saving = None
                if saving is None:
                    link.mark_saving = (store.epoch_id, mark[1])
            # Every second, also when it has not moved: the sender hears this node is there
            # (Cluster.heard; a link open but silent shows in `wrenmq cluster status`).
            link.mark_told = max(told, link.mark_told)
            link.transport.write(F.encode_mark(link.mark_told))

    def _fall_behind(self, peer, off):
        """A live link is full past [cluster] link_buffer at offset `off`: stop writing to
        it, and replay from the log what it missed from there once it drains."""
        peer.up = False
        peer.resume_from = off
        self.fell_behind += 1
        if self.fell_behind & (self.fell_behind - 1) == 0:  # 1, 2, 4, 8...: a slow node is a few lines
            log.warning("cluster: link to node %s is full; its messages wait in the log until it drains "
                        "(%d time(s) a link fell behind so far)", peer.name, self.fell_behind)
        peer.catch_up = self.loop.create_task(self._catch_up(peer, peer.link))

    async def _catch_up(self, peer, link):
        try:
            if await self._replay(peer, link, peer.resume_from):
                self._go_live(peer, link)
        finally:
            if peer.catch_up is asyncio.current_task():
                peer.catch_up = None

    # --- messages ----------------------------------------------------------------------

    def wanted(self, topic):
        """True if another node has a filter (or a shared group) matching `topic`, or a
        node that left had a shared group matching it (`route`)."""
        if topic[:4] == "$SYS":
            return False
        if self.peers:
            nodes, shared = self.remote.match(topic)
            if nodes or shared:
                return True
        return bool(self.remote.left_groups(topic))

    def route(self, msg, hit):
        """Router.publish with a cluster: deliver here what is for here, forward the rest.

        True if anyone anywhere matched."""
        topic = msg.topic
        router = self.router
        remote = self.remote
        if topic[:4] == "$SYS" or not self.peers and not remote.left_nodes:
            return router.route(msg, hit)
        off = msg.offset  # taken before delivery here, which may record it as a private record
        if self._moved_in and off >= 0:
            self._got(self.log_id, off, hit)  # (a node it went to may pass it back: RELAY)
        nodes, shared = remote.match(topic)
        left = remote.left_groups(topic) if off >= 0 else None
        groups_for = None
        if shared or left:
            groups_for = {}
            local_groups = hit[1]
            keep = []
            seen = set()
            me = self.node
            # One node per group: among those with a connected member and a live link,
            # round robin (a node whose link is down or behind would get it only by a
            # later replay, so it gets none while another can take it now); if none has
            # one, among all that have members (the message waits in a queue, or in the
            # log for that node's replay).
            peers = self.peers
            live_of = lambda online: tuple(n for n in online if n in peers and peers[n].up)  # noqa: E731
            for g in local_groups:
                key = (g.name, g.filter)
                seen.add(key)
                others = shared.get(key)
                if others:
                    online, every = others
                    live = live_of(online)
                    if any(m.session.conn is not None for m in g.members):
                        nodes_for = (me,) + live
                    else:
                        nodes_for = live or online or (me,) + every
                    choice = self.picker.pick(key, nodes_for)
                    if choice != me:
                        groups_for.setdefault(choice, []).append(key)
                        continue
                keep.append(g)
            for key, (online, every) in shared.items():
                if key not in seen:
                    groups_for.setdefault(self.picker.pick(key, live_of(online) or online or every), []).append(key)
            if left:
                # A group no node has a member of now, that a node which left had members
                # of: that node's, which comes back with its sessions (the log keeps the
                # message, GroupsSent the choice, for its replay then).
                for key, gone in left.items():
                    if key not in seen and key not in shared:
                        groups_for.setdefault(self.picker.pick(key, gone), []).append(key)
            if len(keep) != len(local_groups):
                hit = (hit[0], tuple(keep))
        delivered = router.route(msg, hit)
        retain = msg.retain
        if not nodes and not groups_for and not retain:
            return delivered
        now = router.clock()
        if msg.expired(now):
            return delivered
        body = F.publish_bytes(msg, now)
        peers = self.peers
        if not retain:
            targets = nodes | groups_for.keys() if groups_for else nodes
        else:
            targets = peers.keys() | groups_for.keys() if groups_for else peers
        for name in targets:
            peer = peers.get(name)
            if peer is None:
                if off >= 0 and groups_for and name in groups_for:  # (a node that left: it gets them back)
                    self._groups_chosen(name, False, off, groups_for[name])
                    delivered = True
                continue
            groups = groups_for.get(name, ()) if groups_for else ()
            to_subs = name in nodes
            flags = (F.TO_SUBSCRIBERS if to_subs else 0) | (F.SET_RETAINED if retain else 0)
            if to_subs or groups:
                delivered = True
            if off >= 0:  # in the log: a link that cannot take it now gets it by replay
                if groups:  # (and the groups chosen there with it)
                    self._groups_chosen(name, peer.up, off, groups)
                if peer.up:
                    frame = F.encode_forward(body, flags, msg.client_id, msg.timestamp, groups, off)
                    if self._room(peer):
                        self._append_out(peer, frame)
                        peer.sent += 1
                        self.forwarded += 1
                        continue
                    self._fall_behind(peer, off)
                continue
            self._send(peer, F.encode_forward(body, flags, msg.client_id, msg.timestamp, groups))
        return delivered

    def _groups_sent_to(self, name):
        sent = self.groups_sent.get(name)
        if sent is None:
            sent = self.groups_sent[name] = GroupsSent()
        return sent

    def _groups_chosen(self, name, up, off, groups):
        """Remember that the logged message `off` went to node `name` for `groups`; count a
        choice forgotten for room while its link was not live (`up`: its replay cannot give it)."""
        if self._groups_sent_to(name).add(off, groups) >= 0 and not up:
            self.replay_lost += 1
            if self.replay_lost & (self.replay_lost - 1) == 0:
                log.warning("cluster: node %s is down with more than %d shared-group messages owed to it; "
                            "the oldest are forgotten (%d record(s) replays could not give so far)",
                            name, _GROUPS_KEPT, self.replay_lost)

    def _room(self, peer):
        """The peer's live link holds less than [cluster] link_buffer."""
        return peer.out_bytes + peer.backlog < self.link_buffer or \
            peer.out_bytes + self._refresh_backlog(peer) < self.link_buffer

    def _send(self, peer, frame):
        link = peer.link
        if peer.up and link is not None:
            if self._room(peer):
                self._append_out(peer, frame)
                peer.sent += 1
                self.forwarded += 1
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

    def _append_out(self, peer, frame):
        """Into the peer's frames of this loop turn (written by `_flush_links` at its end)."""
        if not peer.out:
            self._dirty.append(peer)
            if not self._flush_scheduled:
                self._flush_scheduled = True
                self.loop.call_soon(self._flush_links)
        peer.out.append(frame)
        peer.out_bytes += len(frame)

    @staticmethod
    def _refresh_backlog(peer):
        """The link's transport may have drained since the last write: ask it again."""
        peer.backlog = peer.link.transport.get_write_buffer_size()
        return peer.backlog

    def _flush_links(self):
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
                t = link.transport
                t.write(b"".join(out) if len(out) > 1 else out[0])
                peer.backlog = t.get_write_buffer_size()
            else:
                peer.queue.extend(out)  # lost its link this turn: sent once it is back
                peer.queued += sum(map(len, out))

    def _received(self, body, decoder, mark):
        flags, cid, ts, groups, pkt, off = F.decode_forward(body, decoder)
        if off >= 0:
            last = mark[1]
            if off <= last:
                self.duplicates += 1
                return
            mark[1] = off
            self._marks_dirty = True
            if last < 0 and self.persist is not None:
                # The first message from this log: write the mark now, not within the
                # second. A restart that finds none lets the sender start from where it
                # last saw the link up, past what was still on its way here.
                self._save_marks()
        router = self.router
        msg = F.message_from(pkt, cid, ts, router.clock())
        self.received += 1
        if not pkt.qos and not pkt.retain and msg.expiry is None:
            msg.packet = pkt  # 5.0 subscribers get the PUBLISH bytes as they came
        skip = None
        if off >= 0 and flags & F.TO_SUBSCRIBERS:
            if self._moved_in:
                skip = self._got(mark[0], off, router.matching(pkt.topic))
            if self._relays_due:
                self._relay(body, mark[0], pkt.topic)
        if groups and off >= 0 and self._group_relays:
            self._relay_groups(body, mark[0], pkt.topic, groups)
        router.receive_forwarded(msg, flags & F.TO_SUBSCRIBERS, flags & F.SET_RETAINED, flags & F.SYNC,
                                 frozenset(groups) if groups else (), flags & F.REPLAYED, skip)
        msg.packet = None
        if pkt.qos == 2 and off >= 0 and self.persist is not None and self.persist.store.must_hold:
            # It went to a persistent session here: its delivery state is in this epoch,
            # and so are the marks that say it was taken. A crash loses both or neither,
            # so a restart never takes it again from its sender's log (a second copy).
            self._save_marks()

    # --- sessions that change node ----------------------------------------------------

    async def claim(self, cid):
        """Before a CONNECT with clean start 0 whose session is not here: ask the node
        that holds it (`clients/<cid>`) to hand it over, and take it in. False if there
        was nothing to take (or no answer within _HANDOVER_TIMEOUT)."""
        if not self.peers or not self.etcd_up:
            return False
        try:
            got = await asyncio.wait_for(self.etcd.get(f"{self.prefix}{CLIENTS}{cid}".encode()),
                                         self.cfg.etcd_timeout)
        except (asyncio.TimeoutError, Exception) as e:
            log.warning("cluster: cannot ask etcd where %s's session is (%s); it starts anew here", cid, e)
            return False
        if got is None:
            return False
        owner = got.value.decode("utf-8", "replace")
        peer = self.peers.get(owner)
        if owner == self.node or peer is None:
            return False
        rid = next(self._ids)
        fut = self.loop.create_future()
        self._asks[rid] = (fut, cid)
        self._send_control(peer, F.encode_session_ask(rid, cid))
        try:
            taken = await asyncio.wait_for(fut, _HANDOVER_TIMEOUT)
        except asyncio.TimeoutError:
            log.warning("cluster: node %s did not hand %s's session over within %.0f s; it starts anew here",
                        owner, cid, _HANDOVER_TIMEOUT)
            return False
        finally:
            self._asks.pop(rid, None)
        if taken is None:
            return False
        session, moved, dropped = taken
        self.taken_over += 1
        log.info("cluster: took %s's session over from node %s (%d subscription(s), %d message(s)%s)",
                 cid, owner, len(session.subscriptions), moved,
                 f"; {dropped} beyond [cluster] link_buffer not moved" if dropped else "")
        return True

    def _session_asked(self, requester, body):
        rid, cid = F.decode_session_ask(body)
        peer = self.peers.get(requester)
        if peer is None:
            return
        router = self.router
        session = router.release_session(cid)
        if session is None:
            self._send_control(peer, F.encode_session({"id": rid, "cid": cid, "found": False, "msgs": []}, ()))
            return
        state, pubs = session_state(session, rid, router.clock(), self.link_buffer)
        self._owned.pop(cid, None)  # the asking node registers the client next
        # From now on the session's filters are the asking node's: what this node takes
        # for them goes there (on the link, after the session), not nowhere until that
        # node's own ROUTEs arrive.
        for sub in session.subscriptions.values():
            if sub.filter[:4] != "$SYS":
                self.remote.add(requester, sub.group, sub.filter, True)
        # And what other nodes still send here for it, until they learn where it went,
        # is passed on to that node (RELAY), which keeps the session from getting a
        # message twice.
        filters = _own_filters(session)
        groups = _shared_filters(session)
        self._expire_moves()
        if filters or groups:
            until = self.loop.time() + _RELAY_FOR
            for f in filters:
                self._relays.insert(f, cid, (requester, until))
            for key in groups:
                self._group_relays.setdefault(key, {})[cid] = (requester, until)
            self._relays_due.append((until, cid, filters, groups))
        # (they leave etcd with the links' removal: unsubscribed)
        self._moving_out = frozenset([(None, f) for f in filters] + list(groups))
        try:
            router.end_session(session, publish_will=False)
        finally:
            self._moving_out = ()
        self.handed_over += 1
        self._send_control(peer, F.encode_session(state, pubs))

    def _session_answered(self, body):
        state, pkts = F.decode_session(body)
        ask = self._asks.get(state.get("id"))
        if ask is None or ask[0].done():
            log.warning("cluster: %s's session arrived after its CONNECT stopped waiting; dropped",
                        state.get("cid"))
            return
        fut, cid = ask
        if not state.get("found") or state.get("cid") != cid:
            fut.set_result(None)
            return
        # Taken in now, before the frames that follow on this link: the old node sends
        # on what it takes for the session after handing it over (_session_asked).
        router = self.router
        since = router.persist.next_offset if router.persist is not None else 0
        session, queued = build_session(state, pkts, router.clock, since)
        router.adopt_session(session, queued)
        held = router.sessions.get(cid)
        self._forget_moved(cid)  # (moved here before: that memory is for a session gone since)
        if held is not None and (_own_filters(held) or _shared_filters(held)):
            until = self.loop.time() + 2 * _RELAY_FOR
            self._moved_in[cid] = (held, set(), until)
            self._moved_due.append((until, cid))
        self._expire_moves()
        fut.set_result((session, len(pkts), state.get("dropped")))

    def _expire_moves(self):
        """Forget the sessions whose time for RELAY is over (oldest first)."""
        now = self.loop.time()
        due = self._relays_due
        while due and due[0][0] < now:
            until, cid, filters, groups = due.popleft()
            for f in filters:
                held = self._relays.get(f, cid)
                if held is not None and held[1] == until:  # (not a later move of the same client)
                    self._relays.remove(f, cid)
            for key in groups:
                by_cid = self._group_relays.get(key)
                if by_cid is not None and by_cid.get(cid, (None, None))[1] == until:
                    del by_cid[cid]
                    if not by_cid:
                        del self._group_relays[key]
        due = self._moved_due
        while due and (due[0][0] < now or self._seen_total >= _SEEN_MAX):
            until, cid = due.popleft()
            entry = self._moved_in.get(cid)
            if entry is not None and entry[2] == until:
                self._forget_moved(cid)

    def _forget_moved(self, cid):
        entry = self._moved_in.pop(cid, None)
        if entry is not None:
            self._seen_total -= len(entry[1])

    def _relay(self, body, origin, topic):
        """A FORWARD (body) from the node whose log is `origin`, taken here: pass it on to
        the node each session that just left for, if the session matches it."""
        self._expire_moves()
        to = {}
        for values in self._relays.match(topic):
            for cid, (node, _) in values.items():
                to[cid] = node
        for cid, node in to.items():
            peer = self.peers.get(node)
            if peer is not None:
                self._send(peer, F.encode_relay(cid, origin, body))
                self.relayed += 1

    def _relay_groups(self, body, origin, topic, groups):
        """A FORWARD taken here for shared `groups`: those with no member here any more,
        whose member was a session that just left, go on to that session's new node (one
        RELAY per such session, naming its groups), where the group has that member now."""
        self._expire_moves()
        here = {(g.name, g.filter) for g in self.router.matching(topic)[1] if g.members}
        to = {}
        for key in groups:
            by_cid = self._group_relays.get(key)
            if key in here or not by_cid:
                continue
            cid, (node, _) = next(iter(by_cid.items()))
            to.setdefault((cid, node), []).append(key)
        for (cid, node), keys in to.items():
            peer = self.peers.get(node)
            if peer is not None:
                self._send(peer, F.encode_relay(cid, origin, F.regroup_forward(body, 0, keys)))
                self.relayed += 1

    def _got(self, origin, off, hit):
        """Offset `off` of the log `origin` is being delivered here to the sessions of
        `hit` (the router's match): note it for each that just came here; return those
        that had it already (by RELAY), to be skipped, or None."""
        self._expire_moves()
        moved = self._moved_in
        skip = None
        key = (origin, off)
        for e in hit[0]:
            session = e[0]
            entry = moved.get(session.client_id)
            if entry is None or entry[0] is not session:
                continue
            seen = entry[1]
            if key in seen:
                skip = {session} if skip is None else skip | {session}
            else:
                seen.add(key)
                self._seen_total += 1
        return skip

    def _relayed(self, body, decoder):
        """A RELAY from a session's old node: deliver its message to that session only,
        unless the session had it already; or, one for shared groups (`_relay_groups`),
        to those groups here, where the session is a member now."""
        cid, origin, inner = F.decode_relay(body)
        flags, pcid, ts, groups, pkt, off = F.decode_forward(inner, decoder)
        self._expire_moves()
        entry = self._moved_in.get(cid)
        if entry is None or off < 0:
            return
        session, seen, until = entry
        router = self.router
        if router.sessions.get(cid) is not session:
            self._forget_moved(cid)
            return
        shared = not flags & F.TO_SUBSCRIBERS  # (_relay_groups: for the groups it names)
        key = (origin, off, "shared") if shared else (origin, off)
        if key in seen:
            self.duplicates += 1
            return
        seen.add(key)
        self._seen_total += 1
        msg = F.message_from(pkt, pcid, ts, router.clock())
        if shared:
            router.receive_forwarded(msg, 0, 0, 0, frozenset(groups))
        else:
            router.deliver_to(session, msg)

    @staticmethod
    def _linked(peer):
        """`peer`'s link is open and has answered its HELLO (live, or replaying)."""
        link = peer.link
        return link is not None and link.resume.done() and not link.transport.is_closing()

    def _send_control(self, peer, frame):
        """A frame that is never dropped for space (small, or a session): after this turn's
        other frames for the peer, at once on a link that is replaying (a session's
        hand-over does not wait behind a backlog), or queued for its link."""
        if peer.up and peer.link is not None:
            self._append_out(peer, frame)
        elif self._linked(peer):
            peer.link.transport.write(frame)
        else:
            peer.queue.append(frame)
            peer.queued += len(frame)

    # --- figures ----------------------------------------------------------------------

    def sys_values(self):
        return {
            "$SYS/broker/cluster/node": self.node,
            "$SYS/broker/cluster/nodes": 1 + len(self.peers),
            "$SYS/broker/cluster/links_up": sum(1 for p in self.peers.values() if p.up),
            "$SYS/broker/cluster/etcd/connected": int(self.etcd_up),
            "$SYS/broker/cluster/messages/forwarded": self.forwarded,
            "$SYS/broker/cluster/messages/received": self.received,
            "$SYS/broker/cluster/messages/dropped": self.dropped,
            "$SYS/broker/cluster/messages/replayed": self.replayed,
            "$SYS/broker/cluster/messages/duplicates": self.duplicates,
            "$SYS/broker/cluster/messages/relayed": self.relayed,
            "$SYS/broker/cluster/messages/replay_lost": self.replay_lost,
            "$SYS/broker/cluster/messages/groups_kept": sum(len(s.groups) for s in self.groups_sent.values()),
            "$SYS/broker/cluster/links/fell_behind": self.fell_behind,
            "$SYS/broker/cluster/links/refused": self.links_refused,
            "$SYS/broker/cluster/routes/late": self.route_timeouts,
            "$SYS/broker/cluster/takeovers": self.takeovers,
            "$SYS/broker/cluster/sessions/handed_over": self.handed_over,
            "$SYS/broker/cluster/sessions/taken_over": self.taken_over,
        }
