"""Persistence: what the router tells the store, and how its state comes back after a restart.

The router calls these methods at the moments that matter (a session starts,
goes offline or ends; a subscription changes; a retained message changes; a
QoS 2 exchange moves on; a message is accepted). Each becomes a store operation
in the current epoch. Messages are written once, to the commit log; a stored
session's backlog is its *cursor* (the lowest log offset it may still need)
plus its filters, so after a crash, a long absence or a queue overflow the
session re-reads its messages from the log (catchup.py).
"""

import logging
import time

from ..mqtt import constants as C
from ..mqtt.codec import MQTTError, decode, encode_properties, encode_publish
from ..mqtt.topics import parse_shared, topic_matches
from ..store import state as S
from ..store.store import parse_properties_block, properties_block
from .message import Message
from .session import NEVER, Outgoing, Session, Subscription
from .timers import TimerKind

log = logging.getLogger("wrenmq.persistence")


class _RestoredGroup:
    """Marks a restored message a shared group had chosen for this session (the group
    object itself is rebuilt from the subscriptions; only the marking matters)."""

    @staticmethod
    def pick(exclude=None, allowed=None):
        return None



class Persistence:
    def __init__(self, router, store):
        self.router = router
        self.store = store
        self._log_filters = list(router.cfg.log.topics) if router.cfg.log.enabled else []
        self._logged = {}  # topic -> bool
        self._rotor = iter(())
        self._last_retention = float("-inf")  # first check at the first checkpoint
        self.restored_sessions = 0

    # --- the log ---------------------------------------------------------------

    @property
    def next_offset(self):
        return self.store.next_offset

    @property
    def start_offset(self):
        return self.store.start_offset

    def logged(self, topic):
        r = self._logged.get(topic)
        if r is None:
            r = not topic.startswith("$SYS") and any(topic_matches(f, topic) for f in self._log_filters)
            if len(self._logged) > 100_000:
                self._logged.clear()
            self._logged[topic] = r
        return r

    def read(self, start, limit):
        return self.store.read(start, limit)

    def read_span(self, start, limit):
        return self.store.read_span(start, limit)

    def message_from_record(self, rec):
        props = parse_properties_block(rec.properties) if rec.properties else {}
        ts = rec.timestamp / 1e6
        expiry = None
        interval = props.get("message_expiry_interval")
        if interval is not None:
            remaining = interval - (time.time() - ts)
            expiry = self.router.clock() + remaining
        msg = Message(rec.topic, rec.payload, rec.qos, rec.retain, props, expiry, rec.client_id,
                      None, None, False, ts)
        msg.offset = rec.offset
        return msg

    def _route_unrouted(self, records):
        """QoS 2 messages that reached the log before a crash, but whose state changes
        (the shared group's choice, the retained message) did not reach the database.

        Their publisher was not told (PUBREC waits for both); it resends, and the broker,
        which knows the packet id from the log, answers without routing the message again
        (exactly once). Subscribers that read the log get it from there; a shared group
        keeps its choice only in the database, so it chooses again here, and a retained
        message is set again: else the message would be acknowledged and never delivered.
        """
        router = self.router
        for rec in records:
            msg = self.message_from_record(rec)
            if msg.expiry is not None and router.clock() >= msg.expiry:
                continue
            if msg.retain:
                if msg.payload:
                    router.retained.set(msg.topic, msg)
                else:
                    router.retained.delete(msg.topic)
                self.retained_changed(msg)
            hit = router.matching(msg.topic)
            router.route(msg, ((), hit[1]) + hit[2:])  # the shared groups only

    # --- sessions ----------------------------------------------------------------

    @staticmethod
    def _will_blob(session):
        w = session.will
        if w is None:
            return None
        return encode_publish(w.topic, w.payload, w.qos, w.retain, False, 1 if w.qos else None,
                              encode_properties(w.properties))

    def session_started(self, session, clean_start):
        if session.expiry_interval <= 0:
            return
        store = self.store
        new = not session.stored
        cursor = store.next_offset
        store.op(S.SESSION_UPSERT, (session.client_id, session.version, session.expiry_interval,
                                    session.username, self._will_blob(session), session.will_delay,
                                    cursor))
        if new:
            session.cursor_saved = cursor
        session.stored = True

    def cursor_of(self, session):
        """The lowest log offset the session may still need."""
        c = self.store.next_offset
        if session.resume_from is not None and session.resume_from < c:
            c = session.resume_from
        for out in session.inflight.values():
            o = out.msg.offset
            if 0 <= o < c and out.tracked:
                c = o
        for out in session.queue:
            o = out.msg.offset
            if 0 <= o < c and out.tracked:
                c = o
        return c

    def session_offline(self, session):
        if not session.stored:
            return
        cursor = self.cursor_of(session)
        session.cursor_saved = cursor
        self.store.op(S.SESSION_OFFLINE, (time.time(), session.expiry_interval, self._will_blob(session),
                                          cursor, session.client_id), durable=False)

    def will_published(self, session):
        """The session's will went out: a restart (or the node that takes its partition over)
        must not publish it again. In the epoch of the will's record, so both or neither
        survive a crash."""
        if session.stored:
            self.store.op(S.SESSION_WILL_DONE, (session.client_id,), False)

    def session_ended(self, session):
        if not session.stored:
            return
        cid = (session.client_id,)
        op = self.store.op
        op(S.SESSION_DELETE, cid, False)
        op(S.SUBS_DELETE_ALL, cid, False)
        op(S.QOS2_IN_DELETE_ALL, cid, False)
        op(S.OUT_DELETE_ALL, cid, False)
        session.stored = False

    def subscribed(self, session, sub):
        self.store.op(S.SUB_UPSERT, (session.client_id, sub.full_filter, sub.qos, int(sub.no_local),
                                     int(sub.retain_as_published), sub.retain_handling, sub.sub_id,
                                     sub.since))

    def unsubscribed(self, session, flt):
        self.store.op(S.SUB_DELETE, (session.client_id, flt))

    def qos2_in(self, session, pid, add):
        # Both durable: PUBREC must not leave before the id is known to survive a crash,
        # and PUBCOMP not before its release does (else a crash could make a new message
        # that reuses the id look like a resend of the old one).
        self.store.op(S.QOS2_IN_ADD if add else S.QOS2_IN_DELETE, (session.client_id, pid))

    def qos2_out(self, session, out, state):
        """The QoS 2 exchange of one delivered log offset: its packet id and how far it got.

        States 0 (PUBLISH sent) and 1 (PUBREL sent) are durable before the packet
        leaves, so a restart resumes the exchange with the same id; 2 (complete) keeps
        a replay after a crash from delivering the message again. A completed message a
        shared group chose is simply forgotten (groups are never replayed).
        """
        shared = out.group is not None
        if state == 2 and shared:
            self.store.op(S.OUT_DELETE, (session.client_id, out.msg.offset), False)
        else:
            self.store.op(S.OUT_SET, (session.client_id, out.msg.offset, out.packet_id, 2, state,
                                      int(shared)), state < 2)

    def shared_queued(self, session, out):
        """A shared group chose this session for a logged QoS 1/2 message: remember it
        (the group cannot find it again from its filter after a restart)."""
        self.store.op(S.OUT_SET, (session.client_id, out.msg.offset, 0, out.qos, -1, 1), False)

    def shared_done(self, session, out):
        """Acknowledged, dropped or moved to another member."""
        self.store.op(S.OUT_DELETE, (session.client_id, out.msg.offset), False)

    def retained_changed(self, msg):
        if msg.topic.startswith("$SYS"):
            return  # rebuilt by the broker every interval
        if msg.payload:
            expires = None
            if msg.expiry is not None:
                expires = time.time() + (msg.expiry - self.router.clock())
            self.store.op(S.RETAINED_SET, (msg.topic, msg.qos, msg.payload, properties_block(msg),
                                           msg.client_id, msg.timestamp, expires), msg.qos > 0)
        elif self.router.cluster is not None:
            # A clear is kept as a row without a payload: the router's retained clears
            # survive a restart (restore), so an older copy another node offers later is
            # still not taken back.
            self.store.op(S.RETAINED_SET, (msg.topic, 0, b"", b"", "", msg.timestamp, None), msg.qos > 0)
        else:
            self.store.op(S.RETAINED_DELETE, (msg.topic,), msg.qos > 0)

    def retained_clear_forgotten(self, topic):
        """The router no longer remembers this clear (it keeps the last CLEARS_KEPT, retained.py)."""
        self.store.op(S.RETAINED_DELETE, (topic,), False)

    # --- checkpoints -------------------------------------------------------------

    def checkpoint(self, everything=False):
        """Save moved cursors (and, slowly, refresh idle ones); apply retention now and then."""
        router = self.router
        store = self.store
        op = store.op
        if everything:
            sessions = [s for s in router.sessions.values() if s.stored]
        else:
            sessions = list(router.dirty)
            # A slice of idle sessions too, so their cursors do not lag far behind.
            for _ in range(1000):
                s = next(self._rotor, None)
                if s is None:
                    self._rotor = iter(list(router.sessions.values()))
                    break
                sessions.append(s)
        router.dirty.clear()
        for s in sessions:
            if not s.stored or router.sessions.get(s.client_id) is not s:
                continue
            c = self.cursor_of(s)
            if c != s.cursor_saved:
                op(S.SESSION_CURSOR, (c, s.client_id), False)
                op(S.OUT_GC, (s.client_id, c), False)
                s.cursor_saved = c
            if everything:
                # A clean stop: unacknowledged QoS 1 keep their packet ids across it.
                for pid, out in s.inflight.items():
                    if out.qos == 1 and out.msg.offset >= 0:
                        op(S.OUT_SET, (s.client_id, out.msg.offset, pid, 1, 0,
                                       int(out.group is not None)), False)
        op(S.META_SET, ("last_alive", repr(time.time())), False)
        now = time.monotonic()
        if now - self._last_retention >= self.router.cfg.log.retention_check_interval:
            self._last_retention = now
            protect = min((self.cursor_of(s) for s in router.sessions.values() if s.stored),
                          default=store.next_offset)
            store.request_retention(protect)

    # --- restart -------------------------------------------------------------------

    def restore(self):
        """Rebuild sessions, subscriptions, retained messages and QoS 2 state from disk."""
        router = self.router
        store = self.store
        state = store.db.load()
        meta = state["meta"]
        now_wall = time.time()
        now = router.clock()
        last_alive = float(meta.get("last_alive", now_wall))
        end = store.next_offset
        start = store.start_offset
        sessions = {}
        for cid, version, expiry, username, will, will_delay, disconnected_at, cursor in state["sessions"]:
            s = Session(cid)
            s.version = version
            s.v5 = version == C.MQTT5
            s.expiry_interval = expiry
            s.username = username
            s.stored = True
            s.will_delay = will_delay or 0
            if will:
                try:
                    pkt = decode(will, C.MQTT5)
                    s.will = Message(pkt.topic, pkt.payload, pkt.qos, pkt.retain,
                                     dict(pkt.properties), None, cid, s)
                except MQTTError:
                    log.error("session %s: stored will is unreadable; dropped", cid)
            cursor = end if cursor is None else cursor
            if cursor < start:
                log.warning("session %s: log records %d-%d it needed were deleted by retention",
                            cid, cursor, start - 1)
                cursor = start
            s.cursor_saved = cursor
            if cursor < end:
                s.resume_from = cursor
                s.replay_dup_below = end  # may have been sent before the restart
            s.address = "(restored)"
            gone_at = disconnected_at if disconnected_at is not None else last_alive
            s.expires_at = None
            if expiry != NEVER:
                remaining = expiry - (now_wall - gone_at)
                s.expires_at = now + max(0.0, remaining)
            if s.will is not None:
                delay = min(s.will_delay, expiry)
                s.will_at = now + max(0.0, gone_at + delay - now_wall)
            sessions[cid] = s
        for cid, flt, qos, nl, rap, rh, sub_id, since in state["subscriptions"]:
            s = sessions.get(cid)
            if s is None:
                continue
            group, inner = parse_shared(flt)
            sub = Subscription(inner, qos, bool(nl), bool(rap), rh, sub_id, group, s)
            sub.since = since
            s.subscriptions[flt] = sub
            router.add_subscription(s, sub)
        for cid, pid in state["qos2_in"]:
            s = sessions.get(cid)
            if s is not None:
                s.add_restored_qos2(pid)
        # QoS 2 messages that reached the log just before a crash but not the database.
        log_through = int(meta.get("log_through", end))
        unrouted = []  # those records: the publisher's resend will be answered, not routed
        if store.log is not None and log_through < end:
            for rec in store.read(max(log_through, start), end - log_through):  # incl. private
                if rec.qos == 2 and rec.packet_id:
                    s = sessions.get(rec.client_id)
                    if s is not None and rec.packet_id not in s.restored_qos2:
                        s.add_restored_qos2(rec.packet_id)
                        # Into the database too: the next commit moves log_through past
                        # this record, and a second crash must still know the id.
                        store.op(S.QOS2_IN_ADD, (rec.client_id, rec.packet_id))
                        if not rec.private:
                            unrouted.append(rec)
        # Messages owed by packet id or by a shared group's choice: resume them.
        for cid, offset, pid, qos, st, shared in state["outgoing"]:
            s = sessions.get(cid)
            if s is None or offset < start:
                continue
            if not shared:
                if s.skip_offsets is None:
                    s.skip_offsets = set()
                s.skip_offsets.add(offset)
            if st >= 2:
                continue
            recs = store.read(offset, 1)
            if not recs or recs[0].offset != offset:
                continue
            msg = self.message_from_record(recs[0])
            group = _RestoredGroup if shared else None
            out = Outgoing(msg, qos, False, (), group)
            if st < 0:  # a shared group's choice, not sent yet
                router.queues.push(s, out)
                continue
            out.packet_id = pid
            out.released = st == 1
            out.maybe_sent = True
            s.inflight[pid] = out
            s.inflight_bytes += out.size
            s.next_pid = pid + 1 if pid < 65535 else 1
        # QoS 1 rows of a clean stop are in memory now; a later crash replays them instead.
        store.op(S.OUT_DELETE_QOS1, (), False)
        clears = []
        for topic, qos, payload, props, client_id, ts, expires_at in state["retained"]:
            if not payload:  # a clear a cluster node remembers (retained_changed)
                clears.append((ts, topic))
                continue
            if expires_at is not None and expires_at <= now_wall:
                continue
            p = parse_properties_block(props)
            expiry = now + (expires_at - now_wall) if expires_at is not None else None
            router.retained.set(topic, Message(topic, payload, qos, True, p, expiry, client_id, None,
                                               None, False, ts))
        router.retained_store.clears.update((topic, ts) for ts, topic in sorted(clears))  # oldest first
        router.sessions.update(sessions)
        router.forget_matches()
        self._route_unrouted(unrouted)
        self.restored_sessions = len(sessions)
        # Timers last: expiry and wills that fell due while the broker was down fire now.
        for s in sessions.values():
            if s.will_at is not None:
                router.wills.hold(s, s.will_at)
            if s.expires_at is not None:
                router.timers.schedule(s.expires_at, TimerKind.EXPIRE_SESSION, s)
        if sessions or state["retained"]:
            log.info("restored %d session(s), %d subscription(s), %d retained message(s); log offsets %d-%d",
                     len(sessions), len(state["subscriptions"]), router.retained.count, start, end - 1)
        return len(sessions)
