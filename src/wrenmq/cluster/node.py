"""One node of a cluster: the `Cluster` the broker starts and the router calls.

This is the cluster layer's I/O edge (asyncio, the etcd client, sockets); what it
decides with is sans-IO: interest.py (who wants what), frames.py (the link's format)
and handover.py (a session as data). Its parts, each owning its state:

- membership.py: the etcd lease, this node's registration and writes, the watch, and
  what etcd says of the other nodes, their filters and clients;
- links.py: the link port (and its TLS), one link to each other node, the frames
  written on them once per loop turn;
- routes.py: this node's filters, told to the others (etcd keys and ROUTE frames), and
  the SUBACKs waiting for them;
- forward.py: each message to the nodes that want it, and those that arrive;
- replay.py: HELLO / RESUME, the replay from the log when a link comes up or drains,
  how far this node got in each sender's log (marks), and the shared groups' choices
  kept for replays;
- moves.py: sessions that follow their client to another node, and what is passed on
  for them meanwhile (RELAY).

What the commit log records reaches the other nodes at least once, and each node
takes it once (replay.py); the links carry everything else at most once, up to
[cluster] link_buffer while a link is down or behind.
"""

import asyncio
import logging
import socket

from . import ClusterError
from .forward import Forwarding
from .interest import RemoteInterest
from .links import Links
from .linkview import LinkReporter
from .membership import Membership
from .moves import Moves
from .replay import Replay
from .routes import Routes

log = logging.getLogger("wrenmq.cluster")


class Cluster:
    """This node in the cluster [cluster] describes.

    The broker calls `start`, `stop` and `sys_values`; the router reports its changes
    (`subscribed`, `unsubscribed`, `presence`, `client_connected`, `client_gone`), waits
    for a new subscription to reach the others (`route_seq`, `after_routes`), asks
    `wanted` and hands each message to `route`; a CONNECT with clean start 0 asks for
    its session (`claim`). The parts find each other here: `membership`, `links`,
    `routes`, `forwarding`, `replay`, `moves`, and `remote`, the other nodes' filters.
    """

    def __init__(self, broker, cfg, services=None):
        self.broker = broker
        # With [cluster] replicas > 1: what the process's partitions manager offers this node
        # (cluster/ha/services.py: the shared link port, commit gating, session claims that
        # wait for a node being failed over); None otherwise.
        self.services = services
        # With replicas > 1: the frames to other nodes held until the HW passes what they
        # follow (ha/gate.py); None otherwise.
        self.gate = None
        store = broker.store
        if services is not None and store is not None and store.replicated:
            from .ha.gate import CommitGate
            self.gate = CommitGate(store)
        self.router = broker.router
        self.cfg = cfg
        self.name = cfg.name
        self.prefix = f"/wrenmq/{cfg.name}/"
        self.node = cfg.node
        self.secret = cfg.secret
        self.max_frame = broker.config.limits.max_packet_size + 65536
        self.link_buffer = cfg.link_buffer
        self.persist = broker.router.persist  # the commit log, if any: links replay from it
        self.loop = None
        self.advertise = None  # "host:port" of this node's link port, as the others reach it
        self.remote = RemoteInterest()
        self.links = Links(self)
        self.peers = self.links.peers  # node name -> links.Peer
        self.membership = Membership(self)
        self.routes = Routes(self)
        self.replay = Replay(self)
        self.moves = Moves(self)
        self.forwarding = Forwarding(self)
        # Called per message by the router: straight to the part that does it.
        self.route = self.forwarding.route
        self.wanted = self.forwarding.wanted
        # What writes this node's view of its links to etcd for `wrenmq cluster status`.
        self.link_view = None
        self.stopping = False  # (stop() began: with replicas > 1 no session is handed over any more)

    @property
    def etcd_up(self):
        return self.membership.etcd_up

    @property
    def etcd_endpoint(self):
        """The etcd endpoint ("host:port") this node's session uses; None while none."""
        return self.membership.endpoint

    @property
    def route_seq(self):
        """The number of this node's last change of its filters (`after_routes`)."""
        return self.routes.seq

    # --- lifecycle -------------------------------------------------------------

    async def start(self):
        """Listen for links, join through etcd; raises ClusterError if that fails."""
        self.loop = asyncio.get_running_loop()
        cfg = self.cfg
        port = await self.links.listen()
        if cfg.advertise:
            self.advertise = cfg.advertise
        else:
            host = self.services.advertise_host if self.services is not None else None
            self.advertise = f"{host or cfg.bind}:{port}"
        if not self.node:
            from ..config import cluster_node_name
            config = self.broker.config
            self.node = cluster_node_name(config) if config.listener[0].port else f"{socket.gethostname()}-{port}"
        membership = self.membership
        try:
            await membership.connect()
        except ClusterError:
            self.links.close_port()
            raise
        try:
            await membership.register()
        except BaseException as e:
            self.links.close_port()
            await membership.close()
            if isinstance(e, Exception) and not isinstance(e, ClusterError):
                raise ClusterError(f"joining through etcd {membership.endpoint} failed: "
                                   f"{type(e).__name__}: {e}") from e
            raise
        membership.watch()
        self.replay.start()
        self.link_view = LinkReporter(self)
        self.link_view.start()
        log.info("cluster %s: node %s joined through etcd %s; links on %s; %d other node(s)",
                 self.name, self.node, membership.endpoint, self.advertise, len(self.peers))

    async def stop(self):
        """Leave at once (revoke the lease: the others drop this node's keys now)."""
        self.stopping = True
        if self.gate is not None:
            # (What waits for the HW, a session handed over say, goes before the links close.)
            await self.gate.drained(5.0)
        self.membership.halt()
        self.router.cluster = None
        self.replay.stop()
        if self.link_view is not None:
            self.link_view.stop()
        self.routes.stop()
        self.links.close()
        await self.membership.leave()

    # --- what the router tells and asks --------------------------------------------

    def subscribed(self, group, flt, online=False):
        self.routes.subscribed(group, flt, online)

    def unsubscribed(self, group, flt, online=False):
        self.routes.unsubscribed(group, flt, online)

    def after_routes(self, since, callback):
        """Call `callback` once every linked node has applied this node's filter changes
        after `since` (a `route_seq`), or stopped being waited for (routes.py)."""
        self.routes.after(since, callback)

    def presence(self, session, online):
        """`session`'s client connected (True) or went (False): for its shared groups."""
        self.routes.presence(session, online)

    def client_connected(self, cid):
        self.membership.client_connected(cid)

    def client_gone(self, cid):
        self.membership.client_gone(cid)

    def advertise_info(self, key, value):
        """Tell the other nodes `key` = `value` about this node, in its registration."""
        self.membership.advertise_info(key, value)

    async def read_info(self, key):
        """{node: value} of `key` as each node told it (`advertise_info`), read from etcd now."""
        return await self.membership.read_info(key)

    @property
    def claim_timeout(self):
        """Seconds a CONNECT may wait for `claim` before it is refused (moves.py)."""
        return self.moves.claim_timeout

    async def claim(self, cid, gone=None):
        """Take client `cid`'s session from the node that holds it, if another does: True
        if it is here now; with replicas > 1, TimeoutError if its partition did not hand
        it over in time (moves.py). `gone()`: whether the CONNECT is over."""
        return await self.moves.claim(cid, gone)

    # --- figures ----------------------------------------------------------------------

    def sys_values(self):
        links, replay, moves = self.links, self.replay, self.moves
        return {
            "$SYS/broker/cluster/node": self.node,
            "$SYS/broker/cluster/nodes": 1 + len(self.peers),
            "$SYS/broker/cluster/links_up": sum(1 for p in self.peers.values() if p.up),
            "$SYS/broker/cluster/etcd/connected": int(self.membership.etcd_up),
            "$SYS/broker/cluster/etcd/endpoint": self.etcd_endpoint or "",
            "$SYS/broker/cluster/etcd/switches": self.membership.etcd.switches if self.membership.etcd else 0,
            "$SYS/broker/cluster/messages/forwarded": links.forwarded,
            "$SYS/broker/cluster/messages/received": self.forwarding.received,
            "$SYS/broker/cluster/messages/dropped": links.dropped,
            "$SYS/broker/cluster/messages/replayed": replay.replayed,
            "$SYS/broker/cluster/messages/duplicates": replay.duplicates + moves.duplicates,
            "$SYS/broker/cluster/messages/relayed": moves.relayed,
            "$SYS/broker/cluster/messages/replay_lost": replay.lost,
            "$SYS/broker/cluster/messages/groups_kept": sum(len(s.groups) for s in replay.groups_sent.values()),
            "$SYS/broker/cluster/links/fell_behind": replay.fell_behind,
            "$SYS/broker/cluster/links/refused": links.refused,
            "$SYS/broker/cluster/routes/late": self.routes.late,
            "$SYS/broker/cluster/takeovers": self.membership.takeovers,
            "$SYS/broker/cluster/sessions/handed_over": moves.handed_over,
            "$SYS/broker/cluster/sessions/taken_over": moves.taken_over,
            **(self.services.sys_values(self.broker) if self.services is not None else {}),
        }
