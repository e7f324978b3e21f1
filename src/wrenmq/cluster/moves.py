"""Sessions that change node: a client that reconnects elsewhere takes its session along.

A client that connects with clean start 0 to a node that does not hold its session
makes that node ask the one that does (`claim`: `clients/<client id>` in etcd says
which), which ends it there and sends it over the link (`session_asked`, as data:
handover.py); the asking node takes it in (`session_answered`) before the CONNACK.

The other nodes learn where the session went a link round trip later, from the new
node's ROUTEs. Meanwhile the old node passes on what they still send it for the
session, or for the shared groups it was the last member of there, to the new node
(RELAY, `relay`, `relay_groups`) for _RELAY_FOR seconds; the new node remembers, for
twice as long, which messages (sending log, offset) the session got (`got`), so one
that arrives both ways is delivered once (`relay_arrived`). What a third node sent the old
node for the session reaches the new node a hop later than what it sends the new node
directly once it has learned where the session went: the new node holds the direct ones
back until the old node's passing on has caught up with them (`_MovedIn`), so the session
gets each node's messages in that node's order.
"""

import asyncio
import collections
import itertools
import logging

from . import frames as F
from ..broker.topics import TopicTrie
from .handover import build_session, session_state

log = logging.getLogger("wrenmq.cluster")

_HANDOVER_TIMEOUT = 2.0  # seconds a CONNECT waits for another node to hand its session over
# A session handed to another node: for this long its old node passes on (RELAY) what other
# nodes still send it for the session (they learn where it went a link round trip later),
# and the new node remembers, for twice as long, which messages the session got, so a
# message that came both ways is delivered once: at most _SEEN_MAX messages for all such
# sessions together, past which the oldest session's memory goes first (later RELAYs
# for it are dropped).
_RELAY_FOR = 5.0
# A session just taken in: for this long, a third node's messages that come here directly
# may wait for the old node to pass on (RELAY) that node's earlier ones (`_MovedIn`). Past
# it (the old node dead, stopped, or long done passing on) they are delivered as they come.
_HOLD_FOR = 2.0
# With replicas > 1, seconds a SESSION_ASK may wait for this node to have every other
# node's replay of its log (Moves.session_asked).
_ASK_WAITS = 5.0
_ASK_RETRY = 0.1
# With replicas > 1, seconds a node remembers where it handed a session, to send a later
# ask for it there (a client that gave up its CONNECT while it waited for the hand-over,
# and connected to a third node), at most _HANDED_MAX sessions.
_HANDED_KEPT = 60.0
_HANDED_MAX = 100_000
_HOPS = 4  # nodes an ask follows a session to (`_ask_partition`)
# Records of this node's log a session taken in reads for what its old node had not taken
# (`Moves._deliver_own`): as many as a session handed over reads back from its log.
_OWN_READ_MAX = 200_000


class _Moved:
    """An ask's answer: the session was handed to `node` (ask there)."""

    __slots__ = ("node",)

    def __init__(self, node):
        self.node = node
_SEEN_MAX = 1_000_000


class _MovedIn:
    """A session just taken in from another node (`Moves.moved_in`), while messages may
    still come for it both directly and passed on by its old node (RELAY).

    A third node sends the old node the session's messages until it learns (ROUTE) where
    the session went, then this node directly: the last ones it sent the old node come
    passed on, a hop and (with replicas > 1) a commit later, behind the first ones it sent
    here. So, until `hold_until`, a third node's direct messages for the session wait in
    `held` (per sending log, in its order) until the old node's passing on of that log has
    caught up with them: a RELAY of one of them, or of a later one, or a direct message
    the RELAY brought first. That log is then in `caught_up`, and its messages go through
    as they come."""

    __slots__ = ("session", "seen", "until", "hold_until", "held", "caught_up", "timer", "behind")

    def __init__(self, session, until, hold_until):
        self.session = session
        self.seen = set()  # (log id, offset) of the messages the session got here
        self.until = until  # when this is forgotten
        self.hold_until = hold_until  # 0: nothing is held (no filters of its own to pass on)
        self.held = {}  # sending log id -> [(offset, Message)] waiting for the old node's RELAYs
        self.caught_up = set()  # sending log ids whose passing on has caught up
        self.timer = None  # the call that delivers what is still held at `hold_until`
        # {log id: the last offset of it the old node had taken when it handed the session
        # over, past this node's mark then}: a FORWARD of one of those that comes here
        # afterwards is not for the session (`Moves.got`, `Moves._behind_old_node`).
        self.behind = None


def _own_filters(session):
    """A session's filters that are its own (not a shared group's, not $SYS)."""
    return tuple(sub.filter for sub in session.subscriptions.values()
                 if sub.group is None and sub.filter[:4] != "$SYS")


def _shared_filters(session):
    """The (share name, filter) of the shared groups a session is a member of."""
    return tuple((sub.group, sub.filter) for sub in session.subscriptions.values()
                 if sub.group is not None)


class Moves:
    """Sessions handed to other nodes and taken from them, and the messages passed on
    for them while the other nodes learn where they went.

    `moved_in`, `relays_due` and `group_relays` are empty unless a session moved in the
    last seconds: Forwarding tests them before calling here, per message."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.router = cluster.router
        self.handed_over = 0  # sessions this node gave to another
        self.taken_over = 0  # sessions this node took from another
        self.relayed = 0  # messages passed on to the node a session moved to
        self.duplicates = 0  # messages passed on here that the session had already
        self._asks = {}  # request id -> (future of a SESSION answer, the client id asked for)
        self._ids = itertools.count(1)
        # Sessions that just changed node, each until _RELAY_FOR (old node) or twice that
        # (new node) has passed, in deques in that order. On the old node: the sessions'
        # filters -> {client id: (the new node, until when)}, and the same for its shared
        # groups by (share name, filter); on the new one: client id -> (session, {(log
        # id, offset) it got}, until when).
        self._relays = TopicTrie()
        self.group_relays = {}
        self.relays_due = collections.deque()  # (until, client id, filters, groups)
        self.moved_in = {}
        self._moved_due = collections.deque()  # (until, client id)
        self._seen_total = 0  # messages remembered in moved_in
        # client id -> the node its session was handed to, while the answer waits to be
        # committed here (with replicas > 1): what comes for it meanwhile is passed on.
        self._answers_held = {}
        self._handed = {}  # client id -> (the node its session went to, until when), oldest first
        self._claiming = set()  # client ids whose session `claim` is taking from another node
        self._claim_from = {}  # client id -> this node's log end when `claim` began asking for it

    @property
    def claim_timeout(self):
        """Seconds a CONNECT waits for `claim`: the etcd read that finds the session's
        node, then its ask (with replicas > 1, the time the partition's broker may take to
        come back). The CONNECT is refused past it; the claim may go on (`_ask_partition`)."""
        services = self.cluster.services
        wait = services.claim_wait if services is not None else _HANDOVER_TIMEOUT
        return self.cluster.cfg.etcd_timeout + wait

    async def claim(self, cid, gone=None):
        """Before a CONNECT with clean start 0 whose session is not here: ask the node
        that holds it (`clients/<cid>`) to hand it over, and take it in. False if there
        was nothing to take (or no answer within _HANDOVER_TIMEOUT). With replicas > 1
        (`_ask_partition`), TimeoutError if the session's partition did not hand it over
        in time: it keeps the session, which a new one here would end. `gone()`: whether
        the CONNECT is over (its client gave it up, or it was refused for taking too
        long)."""
        cluster = self.cluster
        peers = cluster.links.peers
        services = cluster.services
        if (not peers and services is None) or not cluster.membership.etcd_up:
            return False
        try:
            owner = await cluster.membership.client_node(cid)
        except (asyncio.TimeoutError, Exception) as e:
            log.warning("cluster: cannot ask etcd where %s's session is (%s); it starts anew here", cid, e)
            return False
        if owner is None or owner == cluster.node:
            return False
        peer = peers.get(owner)
        persist = self.router.persist
        self._claim_from[cid] = persist.next_offset if persist is not None else 0
        try:
            if services is None:
                if peer is None:
                    return False
                taken = await self._ask(peer, owner, cid, _HANDOVER_TIMEOUT)
            else:
                self._claiming.add(cid)
                try:
                    taken = await self._ask_partition(owner, cid, services.claim_wait, gone)
                finally:
                    self._claiming.discard(cid)
        finally:
            self._claim_from.pop(cid, None)
        if taken is False and services is not None:
            raise TimeoutError(f"node {owner} did not hand {cid}'s session over in time")
        if not taken:  # (False: no answer in time; None: no session there)
            return False
        # (A client that went meanwhile, to another node likely, leaves the session here
        # offline, registered here in this same loop turn (Router.park_adopted), so that its
        # CONNECT there takes it from here; an ask this node got for it meanwhile waited:
        # session_asked.)
        session, moved, dropped = taken
        self.taken_over += 1
        log.info("cluster: took %s's session over from node %s (%d subscription(s), %d message(s)%s)",
                 cid, owner, len(session.subscriptions), moved,
                 f"; {dropped} beyond [cluster] link_buffer not moved" if dropped else "")
        return True

    async def _ask(self, peer, owner, cid, timeout):
        """SESSION_ASK `peer` (node `owner`) for `cid`'s session: its answer (None: no
        session there), or False after `timeout` seconds."""
        cluster = self.cluster
        rid = next(self._ids)
        fut = cluster.loop.create_future()
        self._asks[rid] = (fut, cid)
        cluster.links.send_control(peer, F.encode_session_ask(rid, cid))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            log.warning("cluster: node %s did not hand %s's session over within %.0f s; it starts anew here",
                        owner, cid, timeout)
            return False
        finally:
            self._asks.pop(rid, None)

    async def _ask_partition(self, owner, cid, timeout, gone=None):
        """With [cluster] replicas > 1, `owner` is a partition: its broker may be being
        failed over or handed back (it comes back within the lease and a few seconds,
        elsewhere), and its answer, like all it sends, goes once its high watermark has
        passed the session's removal (ha/gate.py), which a leader that has just taken over
        may take seconds to reach. So the ask waits up to `timeout` seconds for a link to
        the partition's broker, and for its answer as long as that link stays up (an
        answer dropped for being late would lose the session: its old node has removed
        it), up to `timeout` seconds more: the CONNECT may have been refused meanwhile
        (`claim_timeout`), and the session is then kept here for the client's next one
        (Router.park_adopted); a link that goes before the answer came is asked again
        through the next. A
        node that handed the session on to another says where (a client that gave up a
        CONNECT that claimed it, and came here): that node is asked next, unless this
        CONNECT was given up too (`gone()`); so is the node etcd names for the client now,
        if another, when the node asked has no session and cannot say where it went
        (`_registered_elsewhere`)."""
        cluster = self.cluster
        links = cluster.links
        deadline = cluster.loop.time() + timeout
        late = deadline + timeout  # (for an answer on its way over a link that stays up)
        hops = 0
        asked = set()  # nodes that had no session and could not say where it went
        while True:
            peer = await self._linked(owner, deadline - cluster.loop.time())
            if peer is None:
                return False
            link = peer.link
            rid = next(self._ids)
            fut = cluster.loop.create_future()
            self._asks[rid] = (fut, cid)
            links.send_control(peer, F.encode_session_ask(rid, cid))
            try:
                while not fut.done():
                    if links.peers.get(owner) is not peer or peer.link is not link or not links.linked(peer):
                        break  # (the answer cannot come over that link any more: ask again)
                    if cluster.loop.time() >= late:
                        log.warning("cluster: node %s did not hand %s's session over within %.0f s",
                                    owner, cid, 2 * timeout)
                        return False
                    await asyncio.wait([fut], timeout=0.1)
            finally:
                self._asks.pop(rid, None)
            if fut.done():
                answer = fut.result()
                if answer is None:
                    asked.add(owner)
                    if gone is not None and gone():
                        return None
                    node = await self._registered_elsewhere(cid)
                    if node is None or node in asked:
                        return None
                    log.info("cluster: node %s has no session of %s, which etcd now says node %s holds: asking there",
                             owner, cid, node)
                elif type(answer) is _Moved:
                    node = answer.node
                    log.info("cluster: node %s handed %s's session to node %s: asking there", owner, cid, node)
                else:
                    return answer
                hops += 1
                if node == cluster.node or hops > _HOPS or (gone is not None and gone()):
                    return None
                owner = node
                continue
            log.info("cluster: the link to node %s went before it answered for %s's session; asking again",
                     owner, cid)

    async def _registered_elsewhere(self, cid):
        """The node asked holds no session for `cid` and knows of no node it went to: the
        node etcd names for the client now (None if none, this one, or etcd cannot tell).

        A partition's broker remembers where it handed a session only in memory: one
        hosted after a failover that hands the partition back to its node takes that
        memory along, and the node, back on a log from which the session was removed, has
        none of it. The node that took the session registered the client once it had it
        (its client may have left meanwhile: Router.park_adopted), after this node read
        etcd: reading it again finds it, where starting anew here would end it."""
        cluster = self.cluster
        try:
            node = await cluster.membership.client_node(cid)
        except (asyncio.TimeoutError, Exception) as e:
            log.warning("cluster: cannot ask etcd again where %s's session is (%s)", cid, e)
            return None
        return None if node == cluster.node else node

    async def _linked(self, node, timeout):
        """`node`'s peer once its link is up (None after `timeout` seconds)."""
        links = self.cluster.links
        deadline = self.cluster.loop.time() + timeout
        while True:
            peer = links.peers.get(node)
            if peer is not None and links.linked(peer):
                return peer
            if self.cluster.loop.time() >= deadline:
                log.warning("cluster: node %s, which holds a session asked for, did not come back within %.0f s",
                            node, timeout)
                return None
            await asyncio.sleep(0.1)

    def session_asked(self, requester, body, inlink=None, waited=0.0):
        """SESSION_ASK from node `requester` (on `inlink`): hand the session over (or say
        there is none).

        With replicas > 1 this node may be a broker that has just started (hosted after a
        failover, or back from one): the other nodes replay to it what their logs hold for
        its sessions, and what one of them has not replayed yet when the session leaves is
        lost to it (the replay matches this node's filters, which the session takes along).
        So the answer waits, up to _ASK_WAITS seconds, until every node known here has
        replayed its log (LIVE on its link here): the asker waits for it as long as its
        link stays up, and asks again through the next one (so an ask whose link went is
        dropped)."""
        cluster = self.cluster
        links = cluster.links
        rid, cid = F.decode_session_ask(body)
        peer = links.peers.get(requester)
        services = cluster.services
        if (cid in self._claiming or cluster.membership.registering(cid)) and \
                waited < (services.claim_wait if services is not None else _HANDOVER_TIMEOUT / 2):
            # (this node is taking the session from another: the ask is answered once it has;
            # or its registration of the client is still on its way to etcd (the client has
            # just connected here, or gave up a CONNECT whose session came here meanwhile):
            # answered once it is there, else the asking node's registration could be
            # written first, and then overwritten, or deleted as the session ends here)
            if inlink is None or not inlink.transport.is_closing():
                cluster.loop.call_later(_ASK_RETRY, self.session_asked, requester, body, inlink, waited + _ASK_RETRY)
            return
        if peer is None:
            return
        if cluster.gate is not None and cluster.stopping:
            # (This broker is stopping: a hosted one handing its partition back, say. Its
            # answer would wait for a commit its stop may not see go out, and the session,
            # ended here and committed, would be gone with it. Unanswered, the ask goes
            # again through the next link, to the partition's next broker, which has it.)
            return
        if services is not None and not all(map(links.replayed_here, links.peers)):
            if inlink is not None and inlink.transport.is_closing():
                return
            if waited < _ASK_WAITS:
                cluster.loop.call_later(_ASK_RETRY, self.session_asked, requester, body, inlink, waited + _ASK_RETRY)
                return
            log.warning("cluster: node %s asked for %s's session; answering without every other node's replay "
                        "after %.0f s", requester, cid, waited)
        router = self.router
        if self.moved_in:
            self.release_held(cid)  # (what waits here for it goes along)
        session = router.release_session(cid)
        if session is None:
            answer = {"id": rid, "cid": cid, "found": False, "msgs": []}
            handed = self._handed.get(cid)
            if handed is not None and handed[0] != requester and handed[1] > cluster.loop.time():
                answer["at"] = handed[0]
            cluster.links.send_control(peer, F.encode_session(answer, ()))
            return
        state, pubs = session_state(session, rid, router.clock(), cluster.link_buffer)
        # How far this node took the asking node's log: what the session holds of it ends
        # there, and the asking node gives it the rest itself (`_deliver_own`).
        mark = cluster.replay.applied.get(requester)
        if mark is not None:
            state["taken"] = [mark[0], mark[1]]
        state["marks"] = self._log_marks()
        cluster.membership.disown(cid)  # the asking node registers the client next
        # From now on the session's filters are the asking node's: what this node takes
        # for them goes there (on the link, after the session), not nowhere until that
        # node's own ROUTEs arrive.
        for sub in session.subscriptions.values():
            if sub.filter[:4] != "$SYS":
                cluster.remote.add(requester, sub.group, sub.filter, True)
        # And what other nodes still send here for it, until they learn where it went,
        # is passed on to that node (RELAY), which keeps the session from getting a
        # message twice.
        filters = _own_filters(session)
        groups = _shared_filters(session)
        self._expire()
        if filters or groups:
            self._relay_for(cid, requester, filters, groups)
        # (they leave etcd with the links' removal: Routes.unsubscribed. With replicas > 1
        # the answer waits here until committed (ha/gate.py), and the asking node sends
        # the session's filters only once it has it: so the removal, and the time its
        # messages are passed on, count from when the answer goes.)
        gate = cluster.gate
        held = [] if gate is not None else None
        with cluster.routes.handing_over([(None, f) for f in filters] + list(groups), held):
            router.end_session(session, publish_will=False)
        self.handed_over += 1
        cluster.links.send_control(peer, F.encode_session(state, pubs))
        if cluster.services is not None:
            handed = self._handed
            handed.pop(cid, None)
            handed[cid] = (requester, cluster.loop.time() + _HANDED_KEPT)
            now = cluster.loop.time()
            while handed and (len(handed) > _HANDED_MAX or next(iter(handed.values()))[1] <= now):
                del handed[next(iter(handed))]
        if gate is not None:
            self._answers_held[cid] = requester
            # (after this turn's flush, which hands the answer to the gate: Links._flush)
            cluster.loop.call_soon(gate.after_held, peer,
                                   lambda: self._answer_gone(cid, requester, filters, groups, held))

    def _relay_for(self, cid, requester, filters, groups):
        """Pass on what comes here for `cid`'s session (`filters` and shared `groups`) to
        node `requester`, where it went, for _RELAY_FOR seconds from now."""
        until = self.cluster.loop.time() + _RELAY_FOR
        for f in filters:
            self._relays.insert(f, cid, (requester, until))
        for key in groups:
            self.group_relays.setdefault(key, {})[cid] = (requester, until)
        self.relays_due.append((until, cid, filters, groups))

    def _answer_gone(self, cid, requester, filters, groups, held):
        """The session handed to `requester` went out (committed): its filters leave etcd a
        second from now, and what comes for it is passed on for _RELAY_FOR seconds more,
        unless the client moved again meanwhile."""
        self.cluster.routes.handed_over(held)
        self._answers_held.pop(cid, None)
        if not (filters or groups) or cid in self.router.sessions:
            return
        self._expire()
        self._relay_for(cid, requester, filters, groups)

    def session_answered(self, body, sender_log=None):
        """SESSION: the session `claim` asked for (or word that there is none), from the
        node whose log is `sender_log`."""
        state, pkts = F.decode_session(body)
        ask = self._asks.get(state.get("id"))
        if ask is None or ask[0].done():
            log.warning("cluster: %s's session arrived after its CONNECT stopped waiting; dropped",
                        state.get("cid"))
            return
        fut, cid = ask
        if not state.get("found") or state.get("cid") != cid:
            at = state.get("at")
            fut.set_result(_Moved(str(at)) if at and state.get("cid") == cid else None)
            return
        # Taken in now, before the frames that follow on this link: the old node sends
        # on what it takes for the session after handing it over (session_asked).
        router = self.router
        since = router.persist.next_offset if router.persist is not None else 0
        session, queued = build_session(state, pkts, router.clock, since)
        router.adopt_session(session, queued)
        held = router.sessions.get(cid)
        self._forget_moved(cid)  # (moved here before: that memory is for a session gone since)
        if held is not None and (_own_filters(held) or _shared_filters(held)):
            now = self.cluster.loop.time()
            until = now + 2 * _RELAY_FOR
            own = bool(_own_filters(held))
            entry = self.moved_in[cid] = _MovedIn(held, until, now + _HOLD_FOR if own else 0)
            if sender_log:  # (the old node's own messages come on the link the RELAYs come on)
                entry.caught_up.add(sender_log)
            entry.behind = self._behind_old_node(state.get("marks"))
            self._moved_due.append((until, cid))
            if held is session and own:
                self._deliver_own(session, entry.seen, state.get("taken"))
        self._expire()
        fut.set_result((session, len(pkts), state.get("dropped")))

    def _deliver_own(self, session, seen, taken):
        """A session just taken in: give it, from this node's log, the messages published here
        that its old node had not taken when it handed it over (`taken`: its mark of this
        node's log then; without one, from when this node began asking).

        This node sent those to the old node, where the session was: the old node passes on
        what it takes of them after the hand-over (RELAY), but a round trip and its commit
        later, behind what this node delivers to the session directly by then (out of order),
        and not at all if it stops first (a hosted broker handing its partition back). So
        they come from here, in log order, ahead of anything newer, and each is noted in
        `seen`: the old node's RELAY of it is then dropped as a copy."""
        persist = self.router.persist
        if persist is None:
            return
        log_id = self.cluster.replay.log_id
        end = persist.next_offset
        if taken and taken[0] == log_id and int(taken[1]) >= 0:
            start = int(taken[1]) + 1
        else:
            start = self._claim_from.get(session.client_id, end)
        start = max(start, persist.start_offset)
        router = self.router
        cid = session.client_id
        scanned = 0
        while start < end and scanned < _OWN_READ_MAX:
            recs, after = persist.read_span(start, min(500, end - start))
            if not recs:
                # Past a stretch of state records (replicas > 1), or one the log's reader
                # found damaged (and logged); an empty read for any other reason ends it
                # here (what is left comes by RELAY).
                past = after if after > start else persist.store.unreadable_end(start)
                if past is None:
                    break
                scanned += past - start
                start = past
                continue
            for rec in recs:
                off = rec.offset
                if off >= end:
                    break
                start = off + 1
                scanned += 1
                if rec.private:  # (another node's message, or one for a session here: not sent to the old node)
                    continue
                mine = [e for e in router.matching(rec.topic)[0] if e[0] is session]
                if not mine or (mine[0][4] and rec.client_id == cid):
                    continue
                router.deliver_to(session, persist.message_from_record(rec))
                seen.add((log_id, off))
                self._seen_total += 1
            # Past the state records after the last one too; a read past `end` (a limit
            # counts records, and state records are left out) ends it.
            start = min(after, end)

    def _log_marks(self):
        """[log id, last offset taken, run] of each log this node has taken messages from
        (`Replay.applied`), and of its own log: what a session it hands over has had of
        them is settled (delivered, or among the messages it takes along)."""
        replay = self.cluster.replay
        marks = [[m[0], m[1], m[2]] for m in replay.applied.values() if m[0] and m[1] >= 0]
        persist = self.router.persist
        if persist is not None and replay.log_id:
            marks.append([replay.log_id, persist.next_offset - 1, replay.run_id])
        return marks

    def _behind_old_node(self, marks):
        """{log id: offset} of the logs a session's old node had taken further than this
        node has (`marks`: its `_log_marks` when it handed the session over).

        Those records reach this node after it took the session in (a link behind, or
        replaying), each a message the session had at its old node already: delivered
        there, or queued or in flight among those it brought along (a QoS 2 one given again
        would come as a new message). Only for a log this node takes from the same run of
        its sender (a sender that restarted may have given the offsets past its disk to
        other messages), or, with replicas > 1, the same partition log, whose records go
        out only once committed."""
        if not marks:
            return None
        mine = {m[0]: m for m in self.cluster.replay.applied.values()}
        same_log_enough = self.cluster.services is not None
        behind = {}
        for entry in marks:
            try:
                log_id, off, run = str(entry[0]), int(entry[1]), str(entry[2])
            except (TypeError, ValueError, IndexError):
                continue
            mark = mine.get(log_id)
            if mark is not None and off > mark[1] and (mark[2] == run or same_log_enough):
                behind[log_id] = off
        return behind

    def _expire(self):
        """Forget the sessions whose time for RELAY is over (oldest first)."""
        now = self.cluster.loop.time()
        due = self.relays_due
        while due and due[0][0] < now:
            until, cid, filters, groups = due.popleft()
            to = self._answers_held.get(cid)
            if to is not None:  # (the session has not gone yet: what comes for it waits behind it)
                self._relay_for(cid, to, filters, groups)
                continue
            for f in filters:
                held = self._relays.get(f, cid)
                if held is not None and held[1] == until:  # (not a later move of the same client)
                    self._relays.remove(f, cid)
            for key in groups:
                by_cid = self.group_relays.get(key)
                if by_cid is not None and by_cid.get(cid, (None, None))[1] == until:
                    del by_cid[cid]
                    if not by_cid:
                        del self.group_relays[key]
        due = self._moved_due
        while due and (due[0][0] < now or self._seen_total >= _SEEN_MAX):
            until, cid = due.popleft()
            entry = self.moved_in.get(cid)
            if entry is not None and entry.until == until:
                self._forget_moved(cid)

    def _forget_moved(self, cid):
        entry = self.moved_in.pop(cid, None)
        if entry is not None:
            self._seen_total -= len(entry.seen)
            self._release(entry)

    def _release(self, entry):
        """Deliver what `entry` still holds (`_MovedIn`), in each sending log's order: its
        time to wait is over, it is forgotten, or its session moves on."""
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        held = entry.held
        if not held:
            return
        entry.held = {}
        session = entry.session
        if self.router.sessions.get(session.client_id) is not session:
            return  # (ended here meanwhile)
        deliver_to = self.router.deliver_to
        for waiting in held.values():
            for _, msg in waiting:
                deliver_to(session, msg)

    def _hold_over(self, cid, entry):
        entry.timer = None
        if self.moved_in.get(cid) is entry:
            self._release(entry)

    def release_held(self, cid):
        """Deliver at once what waits for `cid`'s session (`_MovedIn`): it is being handed
        on to another node, with what it holds."""
        entry = self.moved_in.get(cid)
        if entry is not None:
            self._release(entry)

    # --- on the old node: passing messages on -------------------------------------------

    def relay(self, body, origin, topic):
        """A FORWARD (body) from the node whose log is `origin`, taken here: pass it on to
        the node each session that just left for, if the session matches it."""
        self._expire()
        to = {}
        for values in self._relays.match(topic):
            for cid, (node, _) in values.items():
                to[cid] = node
        links = self.cluster.links
        for cid, node in to.items():
            peer = links.peers.get(node)
            if peer is not None:
                links.send(peer, F.encode_relay(cid, origin, body))
                self.relayed += 1

    def relay_groups(self, body, origin, topic, groups):
        """A FORWARD taken here for shared `groups`: those with no member here any more,
        whose member was a session that just left, go on to that session's new node (one
        RELAY per such session, naming its groups), where the group has that member now."""
        self._expire()
        here = {(g.name, g.filter) for g in self.router.matching(topic)[1] if g.members}
        to = {}
        for key in groups:
            by_cid = self.group_relays.get(key)
            if key in here or not by_cid:
                continue
            cid, (node, _) = next(iter(by_cid.items()))
            to.setdefault((cid, node), []).append(key)
        links = self.cluster.links
        for (cid, node), keys in to.items():
            peer = links.peers.get(node)
            if peer is not None:
                links.send(peer, F.encode_relay(cid, origin, F.regroup_forward(body, 0, keys)))
                self.relayed += 1

    # --- on the new node: each message once ---------------------------------------------

    def got(self, origin, off, hit, pkt=None, pcid=None, ts=0.0):
        """Offset `off` of the log `origin` is being delivered here to the sessions of
        `hit` (the router's match): note it for each that just came here; return those
        that had it already (by RELAY), or that wait for it (a FORWARD, as `pkt`, `pcid`,
        `ts`, from a node whose earlier messages the old node may still pass on:
        `_MovedIn`), to be skipped, or None."""
        self._expire()
        moved = self.moved_in
        skip = None
        key = (origin, off)
        for e in hit[0]:
            session = e[0]
            entry = moved.get(session.client_id)
            if entry is None or entry.session is not session:
                continue
            behind = entry.behind
            if behind is not None and off <= behind.get(origin, -1):
                # (its old node had taken it: the session got it there, or has it among the
                # messages it brought along)
                skip = {session} if skip is None else skip | {session}
                continue
            seen = entry.seen
            if key in seen:
                skip = {session} if skip is None else skip | {session}
                if pkt is not None:  # (passed on before it came directly: the passing on has caught up)
                    entry.caught_up.add(origin)
                continue
            seen.add(key)
            self._seen_total += 1
            if pkt is None or not entry.hold_until or origin in entry.caught_up:
                continue
            if self.cluster.loop.time() >= entry.hold_until:
                self._release(entry)  # (ahead of this one, whatever still waits)
                entry.hold_until = 0
                continue
            waiting = entry.held.get(origin)
            if waiting is None:
                waiting = entry.held[origin] = []
                if entry.timer is None:
                    entry.timer = self.cluster.loop.call_at(entry.hold_until, self._hold_over,
                                                            session.client_id, entry)
            waiting.append((off, F.message_from(pkt, pcid, ts, self.router.clock())))
            skip = {session} if skip is None else skip | {session}
        return skip

    def relay_arrived(self, body, decoder):
        """A RELAY from a session's old node: deliver its message to that session only,
        unless the session had it already; or, one for shared groups (`relay_groups`),
        to those groups here, where the session is a member now."""
        cid, origin, inner = F.decode_relay(body)
        flags, pcid, ts, groups, pkt, off = F.decode_forward(inner, decoder)
        self._expire()
        entry = self.moved_in.get(cid)
        if entry is None or off < 0:
            return
        session, seen = entry.session, entry.seen
        router = self.router
        if router.sessions.get(cid) is not session:
            self._forget_moved(cid)
            return
        shared = not flags & F.TO_SUBSCRIBERS  # (relay_groups: for the groups it names)
        key = (origin, off, "shared") if shared else (origin, off)
        waiting = None if shared else entry.held.get(origin)
        if waiting and off >= waiting[0][0]:
            # The passing on of `origin`'s log has caught up with what came from it
            # directly: the held messages before this one, this one (unless held too), then
            # the rest, in that log's order; from now on that log's messages go through.
            del entry.held[origin]
            entry.caught_up.add(origin)
            if not entry.held and entry.timer is not None:
                entry.timer.cancel()
                entry.timer = None
            n = 0
            while n < len(waiting) and waiting[n][0] < off:
                router.deliver_to(session, waiting[n][1])
                n += 1
            if key in seen:
                self.duplicates += 1
            else:
                seen.add(key)
                self._seen_total += 1
                router.deliver_to(session, F.message_from(pkt, pcid, ts, router.clock()))
            for _, msg in waiting[n:]:
                router.deliver_to(session, msg)
            return
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
