"""The way out to each session: its window, its queue, the PUBLISH its client gets.

`deliver` is the last step of routing a message to one session: out at once when the
client is online and its window (receive maximum, max_inflight_bytes) and socket have
room, else into its queue (queues.py). `drain` moves what waits into the window as
acknowledgements free it and the socket takes more: the queue, the retained messages
a SUBSCRIBE matched where they stand in it (retained.py), and what a persistent session
reads back from the log (catchup.py). `write_publish` encodes a PUBLISH for one client
(its topic aliases, maximum packet size, what is left of the message's expiry).
"""

from collections import deque

from ..mqtt.acks import pubrel
from .catchup import catch_up
from .session import Outgoing


class Delivery:
    """Sends messages to the router's sessions."""

    __slots__ = ("router", "hooks", "stats", "queues", "dirty", "clock", "max_inflight_bytes")

    def __init__(self, router):
        self.router = router  # for what it sets later: persist, disk_low
        self.hooks = router.hooks
        self.stats = router.stats
        self.queues = router.queues
        self.dirty = router.dirty
        self.clock = router.clock
        self.max_inflight_bytes = router.max_inflight_bytes

    def resume(self, session):
        """Resend unacknowledged messages in their original order and packet ids (as many
        as the client's new receive maximum allows, the rest as acks free the window),
        then the queue."""
        now = self.clock()
        for pid, out in list(session.inflight.items()):
            if not out.released and out.msg.expired(now):
                session.take_inflight(pid)
        if session.inflight:
            session.resend = deque(session.inflight)
        self.drain(session)

    def _resend(self, session, pid):
        out = session.inflight.get(pid)
        if out is None:
            return
        if out.released:
            session.conn.send(pubrel(pid))
        else:
            self.write_publish(session, out.msg, out.qos, out.retain, out.sub_ids, pid, True)

    def deliver(self, session, msg, qos, retain, sub_ids, group=None):
        """Send `msg` to `session` at `qos` (its subscription's, at most the message's):
        at once if its client is online and its window and socket have room, else into
        its queue (Queues.enqueue). `group`: the SharedGroup that chose the session."""
        hooks = self.hooks
        if hooks.authorize_deliver is not None and hooks.authorize_deliver(session, msg) is False:
            return
        conn = session.conn
        if not qos:
            if conn is None:
                if self.queues.queue_qos0 and session.expiry_interval:
                    out = Outgoing(msg, 0, retain, sub_ids, group)
                    if not self.queues.enqueue(session, out):
                        self._dropped(session, out)
                return
            if conn.congested:
                self.stats.pub_dropped += 1
                session.dropped += 1
                if hooks.on_message_dropped is not None:
                    hooks.on_message_dropped(session, msg, "congested")
                return
            if session.retained_due is not None:  # behind the retained messages still to send
                out = Outgoing(msg, 0, retain, sub_ids, group)
                if not self.queues.enqueue(session, out):
                    self._dropped(session, out)
                return
            if session.alias_out_max or session.max_packet_out or msg.expiry is not None or \
                    (sub_ids and session.v5):
                self.write_publish(session, msg, 0, retain, sub_ids, 0, False)
                return
            conn.send(msg.encode_qos0(session.v5, retain))
            self.stats.pub_sent += 1
            return
        if session.stored:
            persist = self.router.persist
            if msg.offset < 0 and persist is not None and not self.router.disk_low:
                # Not recorded for readers, but this persistent session is owed it: the
                # log is where owed messages survive a restart. While the disk is low
                # (what other nodes forward, wills) it is owed from memory only: a
                # write the disk cannot take would stop the broker.
                persist.store.append(msg, 0, private=True)
                if session.resume_from is not None and group is None:
                    # The session reads the log from before this record when it catches
                    # up (after a crash, with messages still owed): it takes the message
                    # there, as Router.route leaves every logged message to it, not twice.
                    self.dirty.add(session)
                    return
            out = Outgoing(msg, qos, retain, sub_ids, group)
            self.dirty.add(session)
            if group is not None and msg.offset >= 0:
                persist.shared_queued(session, out)
        else:
            out = Outgoing(msg, qos, retain, sub_ids, group)
        if conn is not None and not session.queue and len(session.inflight) < session.send_quota \
                and not conn.congested and session.inflight_bytes + out.size <= self.max_inflight_bytes \
                and session.retained_due is None:
            self.send_outgoing(session, out)
        elif not self.queues.enqueue(session, out):
            self._dropped(session, out)

    def send_outgoing(self, session, out):
        """Send `out` (QoS 1/2) now, in the session's window, with a new packet id."""
        pid = session.allocate_pid()
        session.inflight[pid] = out
        session.inflight_bytes += out.size
        out.packet_id = pid
        msg = out.msg
        if out.qos == 2 and session.stored and msg.offset >= 0:
            self.router.persist.qos2_out(session, out, 0)
        if not self.write_publish(session, msg, out.qos, out.retain, out.sub_ids, pid, out.maybe_sent):
            session.take_inflight(pid)

    def _dropped(self, session, out):
        """`out` did not fit in the session's queue (Queues.enqueue): count it."""
        session.dropped += 1
        self.stats.pub_dropped += 1
        if self.hooks.on_message_dropped is not None:
            self.hooks.on_message_dropped(session, out.msg, "queue_full")
        if out.group is not None and session.stored and out.msg.offset >= 0:
            self.router.persist.shared_done(session, out)

    def drain(self, session, retained_turn=False):
        """Move queued messages into the window while the client can take them.

        A session that has more waiting in the commit log than in memory reads the
        next stretch of the log when its queue runs dry (catchup.py). The retained
        messages a SUBSCRIBE matched go out where they stand in the queue, on the
        loop turn's timer for them (`retained_turn`; RetainedDelivery.send).
        """
        conn = session.conn
        queue = session.queue
        inflight = session.inflight
        now = self.clock()
        resend = session.resend
        while resend and conn is not None and not conn.congested and \
                len(inflight) - len(resend) < session.send_quota:
            self._resend(session, resend.popleft())
        if resend:
            return
        if not queue and session.resume_from is not None and conn is not None:
            catch_up(self.router, session)
            queue = session.queue
        max_bytes = self.max_inflight_bytes
        authorize = self.hooks.authorize_deliver
        queues = self.queues
        work = 0
        while conn is not None and not conn.congested:
            due = session.retained_due
            if due is not None and (not queue or session.dequeued >= next(iter(due.values())).until):
                if not retained_turn:
                    self.router.retained_delivery.soon(session)
                    break
                work = self.router.retained_delivery.send(session, work)
                if work < 0:
                    break
                continue
            if not queue:
                break
            out = queue[0]
            msg = out.msg
            if msg.expiry is not None and now >= msg.expiry:
                queues.pop(session)
                self.stats.expired += 1
                if out.group is not None and session.stored and msg.offset >= 0:
                    self.router.persist.shared_done(session, out)
                continue
            if authorize is not None and authorize(session, msg) is False:
                # Queued (or read back from the log) before a permission change.
                queues.pop(session)
                self.stats.denied_deliver += 1
                if out.group is not None and session.stored and msg.offset >= 0:
                    self.router.persist.shared_done(session, out)
                continue
            if not out.qos:
                queues.pop(session)
                self.write_publish(session, msg, 0, out.retain, out.sub_ids, 0, False)
                continue
            if len(inflight) >= session.send_quota or (
                    inflight and session.inflight_bytes + out.size > max_bytes):
                break
            queues.pop(session)
            self.send_outgoing(session, out)
            if not queue and session.resume_from is not None:
                catch_up(self.router, session)
                queue = session.queue

    def write_publish(self, session, msg, qos, retain, sub_ids, pid, dup):
        """Encode and send one PUBLISH to the session's client (the general path: aliases,
        expiry, DUP, its maximum packet size); False if it had to be dropped."""
        v5 = session.v5
        now = self.clock()
        if msg.expiry is not None and now >= msg.expiry:
            self.stats.expired += 1
            return False
        ids = sub_ids if v5 else ()
        alias = None
        alias_only = False
        if session.alias_out_max:
            alias = session.alias_out.get(msg.topic)
            if alias is not None:
                alias_only = True
            elif len(session.alias_out) < session.alias_out_max:
                alias = len(session.alias_out) + 1
                session.alias_out[msg.topic] = alias
        data = msg.encode(v5, qos, retain, pid, dup, ids, now, alias, alias_only)
        if session.max_packet_out and len(data) > session.max_packet_out:
            self.stats.pub_dropped += 1
            session.dropped += 1
            if self.hooks.on_message_dropped is not None:
                self.hooks.on_message_dropped(session, msg, "too_large")
            if alias is not None and not alias_only:
                del session.alias_out[msg.topic]
            return False
        session.conn.send(data)
        self.stats.pub_sent += 1
        return True
