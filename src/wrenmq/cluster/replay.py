"""What the commit log records reaches the other nodes at least once, and each takes it once.

A FORWARD carries the message's offset in the sender's log, and the receiver remembers
the last offset it took from each sender's log (`Replay.applied`; in its state database
too, with disk storage) and drops any it has had (`take`). When a link comes up (after
a failure, a restart of either side, or a `kill -9` of the sender), the sender names
its log in HELLO and the receiver says in RESUME how far it got; the sender then sends
the retained messages it holds and replays from its log what matches the receiver's
filters from there (`bring_up`), with the shared groups' messages it had chosen that
node for (`GroupsSent`), before the link goes live. The receiver answers the HELLO once
its filters are in etcd, and the sender makes sure it knows them before the replay
passes over anything (`_routes_known`). A live link that falls [cluster] link_buffer
behind does the same once it drains (`fall_behind`), instead of dropping: the log, not
memory, holds the backlog. Once a second each receiver saves how far it got and tells
the sender (MARK), which then forgets the group choices up to there.
"""

import asyncio
import collections
import json
import logging
import uuid

from . import RETRY
from . import frames as F

log = logging.getLogger("wrenmq.cluster")

_SYNC_CHUNK = 1000  # retained messages sent per loop turn when a link comes up
_REPLAY_SLICE = 100  # log records made into frames per loop turn by a replay
_MARKS_EVERY = 1.0  # seconds between writes of how far this node got in each sender's log
_MARKS_KEY = "cluster_applied"  # ... in the state database's meta table
_GROUPS_KEPT = 100_000  # shared-group choices remembered per node, for its replays (GroupsSent)
# With replicas > 1: records past the high watermark a replay reads ahead (they wait behind
# the commit gate); with more uncommitted than this it waits for the HW instead.
_UNCOMMITTED_READ = 10_000


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
        await self._send_retained(peer, link)
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

    async def _send_retained(self, peer, link):
        """The retained messages this node holds (not $SYS: each node has its own), a
        chunk per loop turn. Live messages for the peer wait in its queue meanwhile and
        follow, so a retained message changed during the sync ends up as changed. (With
        replicas > 1 they go once the epoch they were taken in is committed: gate.py.)"""
        t = link.transport
        router = self.router
        links = self.cluster.links
        gate = self.cluster.gate
        eid = gate.now() if gate is not None else None
        retained = list(router.retained.values())
        for i in range(0, len(retained), _SYNC_CHUNK):
            now = router.clock()
            frames = [F.encode_forward(F.publish_bytes(msg, now), F.SYNC, msg.client_id, msg.timestamp)
                      for msg in retained[i:i + _SYNC_CHUNK] if not msg.topic.startswith("$SYS")
                      and not msg.expired(now)]
            if frames:
                links.write(peer, link, frames, eid)
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
        links = self.cluster.links
        gate = self.cluster.gate
        while True:
            if t.is_closing() or peer.link is not link:
                return False
            if links.backlog_of(peer, link) > half:
                await asyncio.sleep(0.01)
                continue
            end = persist.next_offset
            if cursor >= end:
                peer.resume_from = end
                return True
            # With replicas > 1 the replay reads what is committed; the records past the HW
            # (a loop turn's worth, normally) go behind the gate, as live frames do.
            committed = persist.store.hw if gate is not None else end
            if gate is not None and cursor >= committed and end - committed > _UNCOMMITTED_READ:
                await asyncio.sleep(0.01)
                continue
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
            recs, after = persist.read_span(cursor, 500)
            if not recs:
                # Past a stretch of state records (replicas > 1: session changes, and the
                # one that ends each epoch), or one the log's reader found damaged (and
                # logged); an empty read for any other reason (retention deleting it
                # meanwhile, seen above) is tried again, never passed over.
                past = after if after > cursor else persist.store.unreadable_end(cursor)
                if past is not None:
                    cursor = min(past, end)
                    peer.resume_from = cursor
                else:
                    await asyncio.sleep(0.01)
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
                    links.write(peer, link, frames, 0 if cursor <= committed else None)
                    peer.replayed += len(frames)
                    self.replayed += len(frames)
                peer.resume_from = cursor
                await asyncio.sleep(0)
            cursor = after  # (and past the state records after the last one)
            peer.resume_from = cursor

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
