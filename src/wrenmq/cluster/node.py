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
- `Replay` (below): HELLO / RESUME, the replay from the log when a link comes up or drains,
  how far this node got in each sender's log (marks), and the shared groups' choices
  kept for replays;
- `Moves` (below): sessions that follow their client to another node, and what is passed on
  for them meanwhile (RELAY).

What the commit log records reaches the other nodes at least once, and each node
takes it once (`Replay`); the links carry everything else at most once, up to
[cluster] link_buffer while a link is down or behind.
"""

import asyncio
import collections
import itertools
import json
import logging
import socket
import uuid

from . import RETRY, ClusterError
from . import frames as F
from .forward import Forwarding
from .handover import build_session, session_state
from .interest import RemoteInterest
from .links import Links
from .linkview import LinkReporter
from .membership import Membership
from .routes import Routes
from ..broker.topics import TopicTrie

log = logging.getLogger("wrenmq.cluster")


# ======================================================================================
# What the commit log records reaches the other nodes at least once, and each takes it once.
#
# A FORWARD carries the message's offset in the sender's log, and the receiver remembers
# the last offset it took from each sender's log (`Replay.applied`; in its state database
# too, with disk storage) and drops any it has had (`take`). When a link comes up (after
# a failure, a restart of either side, or a `kill -9` of the sender), the sender names
# its log in HELLO and the receiver says in RESUME how far it got; the sender then sends
# the retained messages it holds and replays from its log what matches the receiver's
# filters from there (`bring_up`), with the shared groups' messages it had chosen that
# node for (`GroupsSent`), before the link goes live. The receiver answers the HELLO once
# its filters are in etcd, and the sender makes sure it knows them before the replay
# passes over anything (`_routes_known`). A live link that falls [cluster] link_buffer
# behind does the same once it drains (`fall_behind`), instead of dropping: the log, not
# memory, holds the backlog. Once a second each receiver saves how far it got and tells
# the sender (MARK), which then forgets the group choices up to there.
# ======================================================================================

_SYNC_CHUNK = 1000  # retained messages sent per loop turn when a link comes up
_REPLAY_SLICE = 100  # log records made into frames per loop turn by a replay
_MARKS_EVERY = 1.0  # seconds between writes of how far this node got in each sender's log
_MARKS_KEY = "cluster_applied"  # ... in the state database's meta table
_GROUPS_KEPT = 100_000  # shared-group choices remembered per node, for its replays (GroupsSent)


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


class Replay:
    """This node's log as the other nodes see it (HELLO, the replays, the group choices
    kept for them) and how far this node got in theirs (RESUME, MARK, the marks saved)."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.router = cluster.router
        # The commit log, when there is one: links replay from it.
        persist = self.persist = cluster.persist
        store = persist.store if persist is not None else None
        self.log_id = store.log_id if store is not None else ""
        self.log_from = store.opened_at if store is not None else 0
        self.run_id = uuid.uuid4().hex  # this process, in HELLO: a restart is told from a reconnect
        # Sender node -> [its log id, last offset of it taken here, its run]; with disk
        # storage kept in the state database (a second behind at most, and never behind
        # a QoS 2 message a persistent session here was given: Forwarding.receive), so a
        # restart still knows where to resume each sender's log from.
        self.applied = self._load_marks()
        self.replayed = 0  # records sent again from the log (link up, or drained)
        self.duplicates = 0  # FORWARDs dropped here: their offset was taken before
        self.lost = 0  # records a replay needed that retention had deleted, or whose group it forgot
        self.groups_sent = {}  # node name -> GroupsSent
        self.fell_behind = 0  # times a live link was full past link_buffer and went to replay
        self._marks_dirty = False
        self._saver = None
        self._resumes_due = []  # (InLink, offset) of HELLOs waiting for Membership.announced

    def start(self):
        self._saver = self.cluster.loop.create_task(self._marks_every(_MARKS_EVERY))

    def stop(self):
        if self._saver is not None:
            self._saver.cancel()
            if self.persist is not None:
                self.save_marks()

    # --- HELLO and RESUME ----------------------------------------------------------

    def hello(self):
        """The first frame of a link this node opens: the cluster, this node, and its log."""
        cluster = self.cluster
        return F.encode_hello(cluster.name, cluster.node, cluster.secret, self.log_id, self.log_from, self.run_id)

    def hello_received(self, body):
        """A link's HELLO: (the sending node, its mark in `applied`, the offset RESUME tells
        it: the mark's, or for a log not heard from before -1 (the sender decides where
        to start) or, on a node that keeps nothing across restarts, -2 (nothing from
        before the sender last learned of this node is for it: every session here is
        newer))."""
        cluster, node, secret, log_id, log_from, run = F.decode_hello(body)
        if cluster != self.cluster.name or secret != self.cluster.secret:
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

    def resume(self, link, offset):
        """Answer a link's HELLO with RESUME: `offset`, and the revision by which this
        node's filters are in etcd. While it (re)joins, once they are written
        (`answer_waiting`): the sender replays what they match, and must be able to know
        them first."""
        announced = self.cluster.membership.announced
        if announced is None:
            self._resumes_due.append((link, offset))
        else:
            link.transport.write(F.encode_resume(offset, announced))

    def answer_waiting(self):
        """This node's filters are all in etcd now: answer the HELLOs that waited for it."""
        due, self._resumes_due = self._resumes_due, []
        for link, offset in due:
            if not link.transport.is_closing():
                self.resume(link, offset)

    # --- a link that comes up --------------------------------------------------------

    async def bring_up(self, peer, link, known, announced):
        """`peer`'s link answered its HELLO (RESUME: `known`, the last offset of this node's
        log it has, and `announced`, the etcd revision by which its filters are there):
        send it the retained messages this node holds, then replay from the log what it
        lacks. The caller makes the link live after, if it is still open."""
        await self._send_retained(link)
        persist = self.persist
        if not link.transport.is_closing() and persist is not None:
            if known >= 0:
                start = known + 1
            elif known == -2:  # (it started after this node last knew it: nothing older is for it)
                start = max(peer.resume_from, peer.known_from)
            else:
                start = peer.resume_from
            if start >= persist.next_offset or await self._routes_known(peer, link, announced):
                await self._replay(peer, link, start)

    async def _send_retained(self, link):
        """The retained messages this node holds (not $SYS: each node has its own), a
        chunk per loop turn. Live messages for the peer wait in its queue meanwhile and
        follow, so a retained message changed during the sync ends up as changed."""
        t = link.transport
        router = self.router
        retained = list(router.retained.values())
        for i in range(0, len(retained), _SYNC_CHUNK):
            now = router.clock()
            for msg in retained[i:i + _SYNC_CHUNK]:
                if msg.topic.startswith("$SYS") or msg.expired(now):
                    continue
                t.write(F.encode_forward(F.publish_bytes(msg, now), F.SYNC, msg.client_id, msg.timestamp))
            if t.is_closing():
                return
            await asyncio.sleep(0)

    async def _routes_known(self, peer, link, announced):
        """Make sure this node knows `peer`'s filters before it replays to it (it sends only
        what they match, and a record passed over is not sent again): they are in etcd by
        revision `announced` (its RESUME). Known if this node's watch has gone past it;
        else (the peer has just (re)joined, and its link came up before the watch brought
        its filters) read from etcd, again while that fails. False if the link went."""
        membership = self.cluster.membership
        if membership.revision > announced:
            return True
        attempt = 0
        while not link.transport.is_closing() and peer.link is link:
            try:
                routes = await membership.read_routes(peer.name)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if attempt == 0:
                    log.warning("cluster: cannot read node %s's subscriptions from etcd (%s: %s); its replay "
                                "waits until they are read", peer.name, type(e).__name__, e)
                await asyncio.sleep(RETRY[min(attempt, len(RETRY) - 1)])
                attempt += 1
                continue
            remote = self.cluster.remote
            for route in routes:
                remote.read(*route)
            return True
        return False

    async def _replay(self, peer, link, start):
        """Write to `peer` what this node's log holds for it from offset `start` on, a
        chunk per loop turn and only as fast as the link drains; True once it has reached
        the log's end (the caller goes live in the same step), False if the link went."""
        persist = self.persist
        t = link.transport
        cursor = start
        half = self.cluster.link_buffer // 2
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
                self.lost += lost
                log.warning("cluster: %d record(s) for node %s were deleted by [log] retention before "
                            "its link could take them", lost, peer.name)
                cursor = persist.start_offset
                continue
            if first:
                first = False
                if peer.catch_up is None:  # (a link behind is logged by fall_behind)
                    log.info("cluster: replaying node %s's messages from offset %d (log end %d)", peer.name,
                             cursor, end)
            recs = persist.read(cursor, 500)
            if not recs:  # a damaged stretch of the log (logged by the reader): skip it
                cursor = min(cursor + 500, end)
                continue
            # The frames in slices, a loop turn each: reading the records takes a turn
            # already, and their frames all at once would hold up every client of the node
            # for milliseconds more (scripts/replay-cost.py measures both).
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
        nodes, _ = self.cluster.remote.match(rec.topic)
        to_subs = name in nodes
        groups = sent.get(rec.offset) if sent is not None else ()
        if not to_subs and not rec.retain and not groups:
            return None
        msg = self.persist.message_from_record(rec)
        if msg.expired(now):
            return None
        flags = F.REPLAYED | (F.TO_SUBSCRIBERS if to_subs else 0) | (F.SET_RETAINED if rec.retain else 0)
        return F.encode_forward(F.publish_bytes(msg, now), flags, msg.client_id, msg.timestamp, groups, rec.offset)

    # --- a live link that falls behind ------------------------------------------------

    def fall_behind(self, peer, off):
        """A live link is full past [cluster] link_buffer at offset `off`: stop writing to
        it, and replay from the log what it missed from there once it drains."""
        peer.up = False
        peer.resume_from = off
        self.fell_behind += 1
        if self.fell_behind & (self.fell_behind - 1) == 0:  # 1, 2, 4, 8...: a slow node is a few lines
            log.warning("cluster: link to node %s is full; its messages wait in the log until it drains "
                        "(%d time(s) a link fell behind so far)", peer.name, self.fell_behind)
        peer.catch_up = self.cluster.loop.create_task(self._catch_up(peer, peer.link))

    async def _catch_up(self, peer, link):
        try:
            if await self._replay(peer, link, peer.resume_from):
                self.cluster.links.go_live(peer, link)
        finally:
            if peer.catch_up is asyncio.current_task():
                peer.catch_up = None

    # --- shared groups' choices, for replays -------------------------------------------

    def _groups_sent_to(self, name):
        sent = self.groups_sent.get(name)
        if sent is None:
            sent = self.groups_sent[name] = GroupsSent()
        return sent

    def chose(self, name, up, off, groups):
        """Remember that the logged message `off` went to node `name` for `groups`; count a
        choice forgotten for room while its link was not live (`up`: its replay cannot give it)."""
        if self._groups_sent_to(name).add(off, groups) >= 0 and not up:
            self.lost += 1
            if self.lost & (self.lost - 1) == 0:
                log.warning("cluster: node %s is down with more than %d shared-group messages owed to it; "
                            "the oldest are forgotten (%d record(s) replays could not give so far)",
                            name, _GROUPS_KEPT, self.lost)

    def marked(self, name, body):
        """A MARK from node `name`: it has this node's log up to the offset the frame
        says, and the group choices up to there are not needed for a replay any more."""
        sent = self.groups_sent.get(name)
        if sent is not None:
            sent.forget_before(F.decode_mark(body) + 1)

    # --- how far this node got in the others' logs ------------------------------------------

    def take(self, mark, off):
        """Offset `off` of the log of the link whose `mark` it is arrived: False if this node
        took it before (a duplicate, dropped), else True (the mark moves to it)."""
        last = mark[1]
        if off <= last:
            self.duplicates += 1
            return False
        mark[1] = off
        self._marks_dirty = True
        if last < 0 and self.persist is not None:
            # The first message from this log: write the mark now, not within the
            # second. A restart that finds none lets the sender start from where it
            # last saw the link up, past what was still on its way here.
            self.save_marks()
        return True

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

    def save_marks(self):
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
            self.save_marks()
        for link in self.cluster.links.inlinks:
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
            # (Links.heard; a link open but silent shows in `wrenmq cluster status`).
            link.mark_told = max(told, link.mark_told)
            link.transport.write(F.encode_mark(link.mark_told))


# ======================================================================================
# Sessions that change node: a client that reconnects elsewhere takes its session along.
#
# A client that connects with clean start 0 to a node that does not hold its session
# makes that node ask the one that does (`claim`: `clients/<client id>` in etcd says
# which), which ends it there and sends it over the link (`session_asked`, as data:
# handover.py); the asking node takes it in (`session_answered`) before the CONNACK.
#
# The other nodes learn where the session went a link round trip later, from the new
# node's ROUTEs. Meanwhile the old node passes on what they still send it for the
# session, or for the shared groups it was the last member of there, to the new node
# (RELAY, `relay`, `relay_groups`) for _RELAY_FOR seconds; the new node remembers, for
# twice as long, which messages (sending log, offset) the session got (`got`), so one
# that arrives both ways is delivered once (`relay_arrived`).
# ======================================================================================

_HANDOVER_TIMEOUT = 2.0  # seconds a CONNECT waits for another node to hand its session over
# A session handed to another node: for this long its old node passes on (RELAY) what other
# nodes still send it for the session (they learn where it went a link round trip later),
# and the new node remembers, for twice as long, which messages the session got, so a
# message that came both ways is delivered once: at most _SEEN_MAX messages for all such
# sessions together, past which the oldest session's memory goes first (later RELAYs
# for it are dropped).
_RELAY_FOR = 5.0
_SEEN_MAX = 1_000_000


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

    async def claim(self, cid):
        """Before a CONNECT with clean start 0 whose session is not here: ask the node
        that holds it (`clients/<cid>`) to hand it over, and take it in. False if there
        was nothing to take (or no answer within _HANDOVER_TIMEOUT)."""
        cluster = self.cluster
        peers = cluster.links.peers
        if not peers or not cluster.membership.etcd_up:
            return False
        try:
            owner = await cluster.membership.client_node(cid)
        except (asyncio.TimeoutError, Exception) as e:
            log.warning("cluster: cannot ask etcd where %s's session is (%s); it starts anew here", cid, e)
            return False
        if owner is None:
            return False
        peer = peers.get(owner)
        if owner == cluster.node or peer is None:
            return False
        rid = next(self._ids)
        fut = cluster.loop.create_future()
        self._asks[rid] = (fut, cid)
        cluster.links.send_control(peer, F.encode_session_ask(rid, cid))
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

    def session_asked(self, requester, body):
        """SESSION_ASK from node `requester`: hand the session over (or say there is none)."""
        cluster = self.cluster
        rid, cid = F.decode_session_ask(body)
        peer = cluster.links.peers.get(requester)
        if peer is None:
            return
        router = self.router
        session = router.release_session(cid)
        if session is None:
            cluster.links.send_control(peer, F.encode_session({"id": rid, "cid": cid, "found": False, "msgs": []},
                                                              ()))
            return
        state, pubs = session_state(session, rid, router.clock(), cluster.link_buffer)
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
            until = cluster.loop.time() + _RELAY_FOR
            for f in filters:
                self._relays.insert(f, cid, (requester, until))
            for key in groups:
                self.group_relays.setdefault(key, {})[cid] = (requester, until)
            self.relays_due.append((until, cid, filters, groups))
        # (they leave etcd with the links' removal: Routes.unsubscribed)
        with cluster.routes.handing_over([(None, f) for f in filters] + list(groups)):
            router.end_session(session, publish_will=False)
        self.handed_over += 1
        cluster.links.send_control(peer, F.encode_session(state, pubs))

    def session_answered(self, body):
        """SESSION: the session `claim` asked for (or word that there is none)."""
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
        # on what it takes for the session after handing it over (session_asked).
        router = self.router
        since = router.persist.next_offset if router.persist is not None else 0
        session, queued = build_session(state, pkts, router.clock, since)
        router.adopt_session(session, queued)
        held = router.sessions.get(cid)
        self._forget_moved(cid)  # (moved here before: that memory is for a session gone since)
        if held is not None and (_own_filters(held) or _shared_filters(held)):
            until = self.cluster.loop.time() + 2 * _RELAY_FOR
            self.moved_in[cid] = (held, set(), until)
            self._moved_due.append((until, cid))
        self._expire()
        fut.set_result((session, len(pkts), state.get("dropped")))

    def _expire(self):
        """Forget the sessions whose time for RELAY is over (oldest first)."""
        now = self.cluster.loop.time()
        due = self.relays_due
        while due and due[0][0] < now:
            until, cid, filters, groups = due.popleft()
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
            if entry is not None and entry[2] == until:
                self._forget_moved(cid)

    def _forget_moved(self, cid):
        entry = self.moved_in.pop(cid, None)
        if entry is not None:
            self._seen_total -= len(entry[1])

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

    def got(self, origin, off, hit):
        """Offset `off` of the log `origin` is being delivered here to the sessions of
        `hit` (the router's match): note it for each that just came here; return those
        that had it already (by RELAY), to be skipped, or None."""
        self._expire()
        moved = self.moved_in
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
        session, seen, until = entry
        router = self.router
        if router.sessions.get(cid) is not session:
            self._forget_moved(cid)
            return
        shared = not flags & F.TO_SUBSCRIBERS  # (relay_groups: for the groups it names)
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


class Cluster:
    """This node in the cluster [cluster] describes.

    The broker calls `start`, `stop` and `sys_values`; the router reports its changes
    (`subscribed`, `unsubscribed`, `presence`, `client_connected`, `client_gone`), waits
    for a new subscription to reach the others (`route_seq`, `after_routes`), asks
    `wanted` and hands each message to `route`; a CONNECT with clean start 0 asks for
    its session (`claim`). The parts find each other here: `membership`, `links`,
    `routes`, `forwarding`, `replay`, `moves`, and `remote`, the other nodes' filters.
    """

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

    @property
    def etcd_up(self):
        return self.membership.etcd_up

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
        self.advertise = cfg.advertise or f"{cfg.bind}:{port}"
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

    async def claim(self, cid):
        """Take client `cid`'s session from the node that holds it, if another does: True
        if it is here now (`Moves`)."""
        return await self.moves.claim(cid)

    # --- figures ----------------------------------------------------------------------

    def sys_values(self):
        links, replay, moves = self.links, self.replay, self.moves
        return {
            "$SYS/broker/cluster/node": self.node,
            "$SYS/broker/cluster/nodes": 1 + len(self.peers),
            "$SYS/broker/cluster/links_up": sum(1 for p in self.peers.values() if p.up),
            "$SYS/broker/cluster/etcd/connected": int(self.membership.etcd_up),
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
        }
