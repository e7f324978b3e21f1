"""Retained messages: what the router keeps, within which limits, and how a SUBSCRIBE's
go out.

The messages are the router's `retained`, a RetainedTrie (topics.py). `RetainedStore`
keeps them: a client's retained message is refused past [limits] max_retained_messages
or max_retained_bytes (delivered, not retained), every change goes to the state
database, and in a cluster a clear is remembered, so an older copy from another node
cannot bring the message back.

`RetainedDelivery` sends the retained messages a SUBSCRIBE matched, a share per loop
turn: once the SUBACK is sent, each subscription that wants them gets a RetainedMatch
(`start`); `Router.drain` sends them where they stand in the session's queue, on the
timer `soon` sets, so a SUBSCRIBE matching thousands of them does not hold the event
loop for the other clients; a walk of the retained tree (RetainedTrie.walk) finds them
as they go.
"""

import logging

from .session import Outgoing, RetainedMatch
from .timers import TimerKind

log = logging.getLogger("wrenmq.router")

# What a session's retained messages (those its SUBSCRIBEs matched) may take of one loop
# turn: the nodes of the retained tree their walks visit, each message sent counting as
# _RETAINED_SEND of them. The rest follows on later turns, so other clients are served in
# between (docs/BENCHMARKS.md, "a large retained match").
_RETAINED_TURN = 2000
_RETAINED_SEND = 8
# What a walk counts against queue_memory for each node it holds a reference to.
_WALK_REF = 8
_WALK_END = object()
# Retained clears a cluster node remembers (with their time), the oldest forgotten first.
CLEARS_KEPT = 100_000


class RetainedStore:
    """Keeps the router's retained messages (`Router.retained`) and, in a cluster, the
    clears."""

    __slots__ = ("router", "clears")

    def __init__(self, router):
        self.router = router
        self.clears = {}  # topic -> time of its retained clear (cluster only; see keep)

    def keep(self, msg, routed=True):
        """Keep `msg` as its topic's retained message (an empty one clears it), on disk too.
        `routed`: it goes to the subscribers as well (RetainedTrie.set).

        With a cluster, a clear is remembered (its time, for the last CLEARS_KEPT topics
        cleared; on disk too, so across restarts): another node's older copy, sent when
        its link comes up, must not bring the message back."""
        router = self.router
        persist = router.persist
        if msg.payload:
            router.retained.set(msg.topic, msg, routed)
            if self.clears:
                self.clears.pop(msg.topic, None)
        else:
            router.retained.delete(msg.topic)
            if router.cluster is not None:
                clears = self.clears
                clears.pop(msg.topic, None)
                clears[msg.topic] = msg.timestamp
                if len(clears) > CLEARS_KEPT:
                    oldest = next(iter(clears))
                    del clears[oldest]
                    if persist is not None:
                        persist.retained_clear_forgotten(oldest)
        if persist is not None:
            persist.retained_changed(msg)

    def refuses(self, msg):
        """True (counted, logged at most once a second) if retaining a client's `msg` would
        take the clients' retained messages past [limits] max_retained_messages or the
        memory they take (RetainedTrie.memory) past max_retained_bytes: it is delivered, not
        retained, and its topic keeps what it had. A replacement that does not grow them is
        always taken."""
        router = self.router
        limits = router.limits
        max_n = limits.max_retained_messages
        max_b = limits.max_retained_bytes
        if not max_n and not max_b:
            return False
        retained = router.retained
        topic = msg.topic
        old = retained.get(topic)
        n = retained.client_count + (0 if old is not None and old.client_id else 1)
        b = retained.memory + retained.growth(topic, msg)
        grows = n > retained.client_count or b > retained.memory
        if grows and ((max_n and n > max_n) or (max_b and b > max_b)):
            n = router.stats.refuse("retained_refused")
            if n:
                log.warning("not retaining %r from %s: clients' retained messages at %d, taking %d bytes "
                            "([limits] max_retained_messages %d, max_retained_bytes %d); %d refused so far",
                            topic[:200], msg.client_id, retained.client_count, retained.memory,
                            max_n, max_b, n)
            return True
        return False

    def newer(self, topic, ts, or_same):
        """Whether a retained message (or clear) of time `ts` from another node is newer
        than what this node holds for `topic`: its retained message, or its last clear."""
        old = self.router.retained.get(topic)
        held = old.timestamp if old is not None else self.clears.get(topic)
        return held is None or ts > held or (or_same and ts == held)


class RetainedDelivery:
    """Sends the retained messages the router's SUBSCRIBEs matched."""

    __slots__ = ("router",)

    def __init__(self, router):
        self.router = router

    def start(self, session, subs):
        """The retained messages matching each of `subs` (new subscriptions of `session`
        that want them) are to be sent from the next loop turn on, where the messages
        queued for the session so far are (`RetainedMatch.until`); what the subscriptions
        route to it meanwhile waits behind them (Delivery.deliver), so no retained message
        follows a newer one."""
        until = session.dequeued + len(session.queue)
        since = self.router.retained.version
        for sub in subs:
            key = sub.full_filter
            self.stop(session, key)  # (subscribed again: it starts over, here)
            if session.retained_due is None:
                session.retained_due = {}
            session.retained_due[key] = RetainedMatch(sub, until, since)
        self.soon(session)

    def soon(self, session):
        """Have the next loop turn send a share of the session's retained messages."""
        if session.retained_at is None:
            router = self.router
            at = session.retained_at = router.clock()
            router.timers.schedule(at, TimerKind.SEND_RETAINED, session)

    def send(self, session, work):
        """Send the first waiting SUBSCRIBE's retained messages (`start`), found by a walk
        of the retained tree (RetainedTrie.walk), as far as what is left of this loop
        turn's share (`work` of _RETAINED_TURN spent), the client's window and its socket
        let them go. Once they are all sent (or dropped), return the work spent; -1 if the
        rest waits: for the next turn (a timer), an acknowledgement or the socket (which
        call `Router.drain`).

        They are not held to the session's queue bounds (a subscriber with a small window
        gets them all, where Mosquitto users meet #2887): they wait in the walk, which
        holds a list of the nodes it has still to visit, counted in queue_memory (past it,
        the rest is dropped and counted)."""
        due = session.retained_due
        key = next(iter(due))
        match = due[key]
        done, work = self._walk(session, match, work)
        if done:
            self.stop(session, key)
            return work
        grew = match.held - match.counted
        if grew:
            match.counted = match.held
            queues = self.router.queues
            queues.queued_bytes += grew * _WALK_REF
            if grew > 0 and queues.queued_bytes > queues.queue_memory:
                router = self.router
                log.warning("retained messages for %s on %r dropped: the queues take %d bytes "
                            "([limits] queue_memory %d)", session.client_id, key[:200],
                            queues.queued_bytes, router.limits.queue_memory)
                session.dropped += 1
                router.stats.pub_dropped += 1
                self.stop(session, key)
                return work
        return -1

    def _walk(self, session, match, work):
        """(all sent, work spent): `send`'s sending, up to where it has to wait."""
        router = self.router
        retained = router.retained
        sub = match.sub
        walk = match.walk
        if walk is None:
            walk = match.walk = retained.walk(sub.filter, match.since, match)
        conn = session.conn
        inflight = session.inflight
        authorize = router.hooks.authorize_deliver
        ids = (sub.sub_id,) if sub.sub_id else ()
        now = router.clock()
        msg = match.waiting
        match.waiting = None
        while True:
            if msg is None:
                if work >= _RETAINED_TURN:
                    self.soon(session)
                    return False, work
                work += 1
                msg = next(walk, _WALK_END)
                if msg is None:
                    continue
                if msg is _WALK_END:
                    return True, work
                if msg.expired(now):
                    if retained.get(msg.topic) is msg:
                        retained.delete(msg.topic)
                    msg = None
                    continue
                if authorize is not None and authorize(session, msg) is False:
                    msg = None
                    continue
            if conn.congested:
                match.waiting = msg
                return False, work
            qos = msg.qos if msg.qos < sub.qos else sub.qos
            if qos:
                out = Outgoing(msg, qos, True, ids, None, False)
                if len(inflight) >= session.send_quota or (
                        inflight and session.inflight_bytes + out.size > router.max_inflight_bytes):
                    match.waiting = msg
                    return False, work
                if session.stored:
                    if msg.offset < 0 and router.persist is not None and not router.disk_low:
                        router.persist.store.append(msg, 0, private=True)  # (as Delivery.deliver does)
                    router.dirty.add(session)
                router.delivery.send_outgoing(session, out)
            else:
                router.delivery.write_publish(session, msg, 0, True, ids, 0, False)
            work += _RETAINED_SEND
            msg = None

    def stop(self, session, key=None):
        """The retained messages still to send for subscription `key` (all of them if None)
        are not sent: it is gone or subscribed again, or its client is. (What waits behind
        them in the queue is the caller's to send on: `Router.drain`.)"""
        if key is None:
            session.retained_at = None
        due = session.retained_due
        if due is None:
            return
        stopped = due.values() if key is None else (due.pop(key, None),)
        queues = self.router.queues
        for match in stopped:
            if match is not None:
                if match.walk is not None:
                    match.walk.close()
                queues.queued_bytes -= match.counted * _WALK_REF
        if key is None or not due:
            session.retained_due = None
