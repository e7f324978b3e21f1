"""This node's filters, told to the other nodes.

The router reports each subscription counted in or out (`subscribed`, `unsubscribed`)
and each session going online or offline (`presence`, for shared groups). A filter
new to the node, or one gone from it, changes one etcd key (`LocalInterest` counts:
a thousand subscribers to one filter are one key) and goes over the links at once as
a ROUTE frame; the SUBACK of a new subscription waits until every linked node has
answered ROUTE_ACK (`after`), so what they publish after it reaches the subscription.
Each change has a number (`seq`), growing across restarts too, so the others keep the
newer of what a link and etcd told them (interest.py).
"""

import collections
import contextlib
import logging
import time

from . import frames as F
from .interest import LocalInterest, route_key, route_value

log = logging.getLogger("wrenmq.cluster")

_ROUTE_TIMEOUT = 1.0  # seconds a SUBACK waits for the other nodes to confirm its new filter
_REMOVAL_DELAY = 1.0  # seconds before a filter's removal goes to the links (Routes.unsubscribed)


class Routes:
    """This node's filters (counted), their etcd keys and ROUTE frames, and the SUBACKs
    waiting for the linked nodes' ROUTE_ACKs."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.local = LocalInterest()
        # The number of this node's last change of its filters; a new subscription's SUBACK
        # waits until the nodes linked to this one have applied the changes after the one
        # it saw before (a message published there after the SUBACK reaches it).
        self.seq = 0
        self.late = 0  # SUBACKs that stopped waiting for a node
        self._waits = []  # [{peer: seq still to be acknowledged}, callback, timer]
        # (when, group, filter, seq, etcd too) for the links (and etcd), oldest first
        self._removals = collections.deque()
        self._removals_timer = None
        self._later_in_etcd = ()  # (group, filter) of a session being handed over (`handing_over`)
        self._held = None  # ... and the list its removals wait in, if they wait (`handing_over`)

    def stop(self):
        if self._removals_timer is not None:
            self._removals_timer.cancel()

    def _next_seq(self):
        """The number of this node's next change of its filters: growing, across restarts
        too (microseconds of the wall clock, or one more than the last)."""
        self.seq = max(self.seq + 1, time.time_ns() // 1000)
        return self.seq

    def recount(self, sessions):
        """Count the filters of `sessions` (all of this node's, as the node (re)joins) anew;
        [(etcd key, value)] of each, to write."""
        cluster = self.cluster
        local = self.local = LocalInterest()
        for session in sessions.values():
            online = session.conn is not None
            for sub in session.subscriptions.values():
                local.add(sub.group, sub.filter, online)
        seq = self._next_seq()
        return [(route_key(cluster.prefix, cluster.node, group, flt), route_value(local.value(group, flt), seq))
                for group, flt in local.counts]

    # --- what the router tells ----------------------------------------------------

    def subscribed(self, group, flt, online=False):
        if self.local.add(group, flt, online):
            cluster = self.cluster
            flag = self.local.value(group, flt)
            seq = self._next_seq()
            cluster.membership.write(route_key(cluster.prefix, cluster.node, group, flt), route_value(flag, seq))
            self._to_links(group, flt, flag != b"0", False, seq)

    def unsubscribed(self, group, flt, online=False):
        change = self.local.remove(group, flt, online)
        if change is not None:
            cluster = self.cluster
            seq = self._next_seq()
            key = route_key(cluster.prefix, cluster.node, group, flt)
            if change != "delete":
                cluster.membership.write(key, route_value(self.local.value(group, flt), seq))
                self._to_links(group, flt, False, False, seq)
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
            later = (group, flt) in self._later_in_etcd
            if not later:
                cluster.membership.write(key, None)
            elif self._held is not None:
                self._held.append((group, flt, seq))
                return
            self._remove_later(group, flt, seq, later)

    def _remove_later(self, group, flt, seq, etcd_too):
        loop = self.cluster.loop
        self._removals.append((loop.time() + _REMOVAL_DELAY, group, flt, seq, etcd_too))
        if self._removals_timer is None:
            self._removals_timer = loop.call_later(_REMOVAL_DELAY, self._removals_due)

    @contextlib.contextmanager
    def handing_over(self, keys, held=None):
        """While a session's filters and groups (`keys`: (group, filter)) leave this node for
        another (moves.py): their removals leave etcd a second later, with the links'. With
        `held` (a list), that second starts only at `handed_over(held)`: with [cluster]
        replicas > 1 the session goes to the other node once committed here, which can take
        seconds, and until it is there no node may stop sending its messages here."""
        self._later_in_etcd = frozenset(keys)
        self._held = held
        try:
            yield
        finally:
            self._later_in_etcd = ()
            self._held = None

    def handed_over(self, held):
        """The session whose removals wait in `held` (`handing_over`) has gone out: they
        leave etcd and the links a second from now."""
        for group, flt, seq in held:
            self._remove_later(group, flt, seq, True)
        held.clear()

    def _removals_due(self):
        self._removals_timer = None
        cluster = self.cluster
        removals = self._removals
        now = cluster.loop.time()
        while removals and removals[0][0] <= now:
            _, group, flt, seq, etcd_too = removals.popleft()
            if (group, flt) not in self.local.counts:
                if etcd_too:
                    cluster.membership.write(route_key(cluster.prefix, cluster.node, group, flt), None)
                self._to_links(group, flt, False, True, seq)
        if removals:
            self._removals_timer = cluster.loop.call_later(removals[0][0] - now, self._removals_due)

    def presence(self, session, online):
        """`session`'s client connected (True) or went (False): its shared groups' keys
        say whether a member here can take a message now."""
        delta = 1 if online else -1
        local = self.local
        cluster = self.cluster
        for sub in session.subscriptions.values():
            if sub.group is not None and local.connected(sub.group, sub.filter, delta):
                cluster.membership.write(route_key(cluster.prefix, cluster.node, sub.group, sub.filter),
                                         route_value(local.value(sub.group, sub.filter), self._next_seq()))

    # --- ROUTE and ROUTE_ACK ------------------------------------------------------------

    def _to_links(self, group, flt, online, removed, seq):
        """The other nodes learn a change of this node's filters over the links now, and
        from etcd one round trip later (interest.py). A filter added and removed before
        etcd is written is never in etcd: without the removal here, the nodes linked
        would keep it."""
        if flt[:4] == "$SYS":
            return  # each node's own: never forwarded, nothing to wait for
        frame = F.encode_route(seq, group, flt, online, removed)
        links = self.cluster.links
        for peer in links.peers.values():
            if links.linked(peer):
                links.send_control(peer, frame)
                peer.route_sent = seq

    def after(self, since, callback):
        """Call `callback` once every linked node has applied this node's ROUTEs after seq
        `since` (at once if there are none; a node that does not answer within
        _ROUTE_TIMEOUT, or whose link goes, is not waited for)."""
        waiting = {peer: peer.route_sent for peer in self.cluster.links.peers.values() if peer.route_sent > since}
        if not waiting:
            callback()
            return
        entry = [waiting, callback, None]
        entry[2] = self.cluster.loop.call_later(_ROUTE_TIMEOUT, self._late, entry)
        self._waits.append(entry)

    def _late(self, entry):
        if entry in self._waits:
            self.late += 1
            if self.late & (self.late - 1) == 0:  # 1, 2, 4, 8...: a few lines
                log.warning("cluster: node(s) %s did not confirm a new subscription within %.0f s; its SUBACK "
                            "goes anyway (%d time(s) so far)", ", ".join(p.name for p in entry[0]),
                            _ROUTE_TIMEOUT, self.late)
            self._waits.remove(entry)
            entry[1]()

    def acked(self, peer, seq=None):
        """`peer` applied ROUTEs up to `seq` (None: its link is gone, wait no more for it)."""
        done = []
        for entry in self._waits:
            want = entry[0].get(peer)
            if want is not None and (seq is None or seq >= want):
                del entry[0][peer]
                if not entry[0]:
                    done.append(entry)
        for entry in done:
            self._waits.remove(entry)
            entry[2].cancel()
            entry[1]()
