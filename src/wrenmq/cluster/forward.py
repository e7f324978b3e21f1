"""Messages to the other nodes and from them.

A PUBLISH accepted on one node is delivered there as always and written to each other
node with a matching filter, once per node however many subscribers it has (`route`);
a retained message (or a clear) goes to every node. A shared group gets each message
once across the cluster: the accepting node picks one node among those with a
connected member and a live link (any with members if none; if none has members, a
node that left with some, which the log keeps the message for), round robin. The
receiving node delivers what arrives to its matching subscribers and never forwards
it again (`receive`).
"""

from . import frames as F
from .interest import SharedPicker


class Forwarding:
    """`route` and `wanted` for the router (as `Cluster.route`, `Cluster.wanted`), and the
    FORWARD frames that arrive (`receive`)."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.router = cluster.router
        self.persist = cluster.persist
        self.remote = cluster.remote
        self.links = cluster.links
        self.peers = cluster.links.peers
        self.replay = cluster.replay
        self.moves = cluster.moves
        self.picker = SharedPicker()
        self.received = 0  # FORWARDs taken (not duplicates)

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
        replay = self.replay
        moves = self.moves
        if moves.moved_in and off >= 0:
            moves.got(replay.log_id, off, hit)  # (a node it went to may pass it back: RELAY)
        nodes, shared = remote.match(topic)
        left = remote.left_groups(topic) if off >= 0 else None
        groups_for = None
        if shared or left:
            groups_for = {}
            local_groups = hit[1]
            keep = []
            seen = set()
            me = self.cluster.node
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
        links = self.links
        if not retain:
            targets = nodes | groups_for.keys() if groups_for else nodes
        else:
            targets = peers.keys() | groups_for.keys() if groups_for else peers
        for name in targets:
            peer = peers.get(name)
            if peer is None:
                if off >= 0 and groups_for and name in groups_for:  # (a node that left: it gets them back)
                    replay.chose(name, False, off, groups_for[name])
                    delivered = True
                continue
            groups = groups_for.get(name, ()) if groups_for else ()
            to_subs = name in nodes
            flags = (F.TO_SUBSCRIBERS if to_subs else 0) | (F.SET_RETAINED if retain else 0)
            if to_subs or groups:
                delivered = True
            if off >= 0:  # in the log: a link that cannot take it now gets it by replay
                if groups:  # (and the groups chosen there with it)
                    replay.chose(name, peer.up, off, groups)
                if peer.up and not links.send_live(
                        peer, F.encode_forward(body, flags, msg.client_id, msg.timestamp, groups, off)):
                    replay.fall_behind(peer, off)
                continue
            links.send(peer, F.encode_forward(body, flags, msg.client_id, msg.timestamp, groups))
        return delivered

    def receive(self, body, decoder, mark):
        """A FORWARD from the node whose link's `mark` (Replay.applied) is given: deliver
        it here (never onwards), unless this node took its offset before."""
        flags, cid, ts, groups, pkt, off = F.decode_forward(body, decoder)
        if off >= 0 and not self.replay.take(mark, off):
            return
        router = self.router
        msg = F.message_from(pkt, cid, ts, router.clock())
        self.received += 1
        if not pkt.qos and not pkt.retain and msg.expiry is None:
            msg.packet = pkt  # 5.0 subscribers get the PUBLISH bytes as they came
        skip = None
        moves = self.moves
        if off >= 0 and flags & F.TO_SUBSCRIBERS:
            if moves.moved_in:
                if flags & F.REPLAYED:  # (sent again from its log, for the subscriptions older than it: not held)
                    skip = moves.got(mark[0], off, router.matching(pkt.topic))
                else:
                    skip = moves.got(mark[0], off, router.matching(pkt.topic), pkt, cid, ts)
            if moves.relays_due:
                moves.relay(body, mark[0], pkt.topic)
        if groups and off >= 0 and moves.group_relays:
            moves.relay_groups(body, mark[0], pkt.topic, groups)
        router.receive_forwarded(msg, flags & F.TO_SUBSCRIBERS, flags & F.SET_RETAINED, flags & F.SYNC,
                                 frozenset(groups) if groups else (), flags & F.REPLAYED, skip)
        msg.packet = None
        persist = self.persist
        if pkt.qos == 2 and off >= 0 and persist is not None and persist.store.must_hold:
            # It went to a persistent session here: its delivery state is in this epoch,
            # and so are the marks that say it was taken. A crash loses both or neither,
            # so a restart never takes it again from its sender's log (a second copy).
            self.replay.save_marks()
