"""What a node sees of its links to the others, in etcd for `wrenmq cluster status`.

etcd keeps a node's registration for as long as its lease, `lease_ttl` seconds after the
node died; the nodes linked to it know within moments (its link's TCP connection closes,
or it goes silent: every node sends each node linked to it a MARK a second). So each node
writes its view of its links to `links/<node>` (on its lease, like its other keys):

    {"at": <wall time of the view>, "silent_after": 5.0, "etcd": "<host:port>",
     "peers": {"<node>": {"state": "up", "since": <wall time>, "heard": <wall time>}, ...}}

`state` is "up" (both links live), "catching up" (this node's link to it is replaying
from the log before it goes live), "out only" / "in only" (one of the two links is
missing), "silent" (a link is open but nothing came over it for `silent_after` seconds)
or "down" (no link). `heard` is when the last frame came from that node, over either
link, `since` when the state began. `etcd` is the etcd endpoint the node's session uses
(which member: an operator about to restart one sees whose session moves). The key is
written when a state or that endpoint changes (looked at twice a second), not
periodically: a steady cluster writes nothing, and a state that is not "silent" or
"down" means heard within `silent_after`.
"""

import asyncio
import json
import logging
import time

log = logging.getLogger("wrenmq.cluster")

LINKS = "links/"
SILENT_AFTER = 5.0  # seconds without a frame from a linked node: "silent" (MARKs come every second)
_LOOK_EVERY = 0.5  # seconds between looks at the links' states
_RETRY_AFTER = 2.0  # seconds before a write that failed (etcd away) is tried again


def link_states(links, now):
    """{node: state} of the other nodes a Cluster's `links` (links.py) know (see the module
    docstring); `now`: time.monotonic(), the clock of `links.heard`."""
    inlinks = {link.peer for link in links.inlinks
               if link.peer is not None and link.transport is not None and not link.transport.is_closing()}
    states = {}
    for name, peer in links.peers.items():
        linked = links.linked(peer)
        out = "up" if peer.up and linked else ("catching up" if linked else None)
        inbound = name in inlinks
        if out is None and not inbound:
            state = "down"
        elif now - links.heard.get(name, float("-inf")) > SILENT_AFTER:
            state = "silent"
        elif out == "up":
            state = "up" if inbound else "out only"
        else:
            state = out or "in only"
        states[name] = state
    return states


class LinkReporter:
    """Writes `links/<node>` for a Cluster: at its start, when a link's state or the etcd
    endpoint in use changes, and again after the node's lease changed (a rejoin: the old
    lease took the key along)."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.key = f"{cluster.prefix}{LINKS}{cluster.node}".encode()
        self.states = {}  # node -> (state, since)
        self.written = None  # ({node: state}, lease, etcd endpoint) last written
        self.failed_at = float("-inf")  # time.monotonic() of the last failed write
        self.task = None

    def start(self):
        self.task = self.cluster.loop.create_task(self._run())

    def stop(self):
        if self.task is not None:
            self.task.cancel()
            self.task = None

    def view(self, wall, now):
        """The JSON of the key, from the states as last looked at (`wall`: time.time(),
        `now`: time.monotonic(), both of the same moment)."""
        heard = self.cluster.links.heard

        def at(name):
            t = heard.get(name)
            return None if t is None else round(wall - (now - t), 3)

        return json.dumps({"at": round(wall, 3), "silent_after": SILENT_AFTER,
                           "etcd": self.cluster.etcd_endpoint, "peers": {
            name: {"state": state, "since": since, "heard": at(name)}
            for name, (state, since) in sorted(self.states.items())}}).encode()

    def look(self, wall, now):
        """Bring `states` up to date (a new state's `since` is `wall`)."""
        current = link_states(self.cluster.links, now)
        for name, state in current.items():
            old = self.states.get(name)
            if old is None or old[0] != state:
                self.states[name] = (state, round(wall, 3))
        for name in set(self.states) - current.keys():
            del self.states[name]

    async def _run(self):
        membership = self.cluster.membership
        while True:
            wall, now = time.time(), time.monotonic()
            self.look(wall, now)
            lease = membership.lease
            snapshot = ({n: s for n, (s, _) in self.states.items()}, lease, membership.endpoint)
            if (snapshot != self.written and lease is not None and membership.etcd_up
                    and now - self.failed_at >= _RETRY_AFTER):
                try:
                    await membership.etcd.put(self.key, self.view(wall, now), lease=lease)
                    self.written = snapshot
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # etcd away: the session code says so and rejoins; try again later
                    self.failed_at = now
                    log.debug("cluster: writing this node's view of its links failed: %s", e)
            await asyncio.sleep(_LOOK_EVERY)
