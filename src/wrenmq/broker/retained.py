"""The retained messages a SUBSCRIBE matches, sent a share per loop turn.

A mixin of the Router (what it reads and calls is the router's own): `_subscribed` gives
each subscription that wants them a RetainedMatch (`_match_retained`); `Router.drain` sends
them where they stand in the session's queue, on the timer `_send_retained_soon` sets, a
share a turn, so a SUBSCRIBE matching thousands of them does not hold the event loop for
the other clients; a walk of the retained tree (RetainedTrie.walk) finds them as they go.
"""

import logging

from .session import Outgoing, RetainedMatch

log = logging.getLogger("wrenmq.router")

RETAINED_TIMER = 4  # the router's timer kind for the next share (Router.tick)

# What a session's retained messages (those its SUBSCRIBEs matched) may take of one loop
# turn: the nodes of the retained tree their walks visit, each message sent counting as
# _RETAINED_SEND of them. The rest follows on later turns, so other clients are served in
# between (docs/BENCHMARKS.md, "a large retained match").
_RETAINED_TURN = 2000
_RETAINED_SEND = 8
# What a walk counts against queue_memory for each node it holds a reference to.
_WALK_REF = 8
_WALK_END = object()


class RetainedSending:
    """The router's part that sends the retained messages its SUBSCRIBEs matched."""

    def _match_retained(self, session, subs):
        """The retained messages matching each of `subs` (new subscriptions of `session`
        that want them) are to be sent from the next loop turn on, where the messages
        queued for the session so far are (`RetainedMatch.until`); what the subscriptions
        route to it meanwhile waits behind them (`_deliver`), so no retained message
        follows a newer one."""
        until = session.dequeued + len(session.queue)
        since = self.retained.version
        for sub in subs:
            key = sub.full_filter
            self._stop_retained(session, key)  # (subscribed again: it starts over, here)
            if session.retained_due is None:
                session.retained_due = {}
            session.retained_due[key] = RetainedMatch(sub, until, since)
        self._send_retained_soon(session)

    def _send_retained_soon(self, session):
        """Have the next loop turn send a share of the session's retained messages."""
        if session.retained_at is None:
            at = session.retained_at = self.clock()
            self._schedule(at, RETAINED_TIMER, session)

    def _send_retained(self, session, work):
        """Send the first waiting SUBSCRIBE's retained messages (`_match_retained`), found by a
        walk of the retained tree (RetainedTrie.walk), as far as what is left of this loop
        turn's share (`work` of _RETAINED_TURN spent), the client's window and its socket
        let them go. Once they are all sent (or dropped), return the work spent; -1 if the
        rest waits: for the next turn (a timer), an acknowledgement or the socket (which
        call `drain`).

        They are not held to the session's queue bounds (a subscriber with a small window
        gets them all, where Mosquitto users meet #2887): they wait in the walk, which
        holds a list of the nodes it has still to visit, counted in queue_memory (past it,
        the rest is dropped and counted)."""
        due = session.retained_due
        key = next(iter(due))
        match = due[key]
        done, work = self._walk_retained(session, match, work)
        if done:
            self._stop_retained(session, key)
            return work
        grew = match.held - match.counted
        if grew:
            match.counted = match.held
            self.queued_bytes += grew * _WALK_REF
            if grew > 0 and self.queued_bytes > self.queue_memory:
                log.warning("retained messages for %s on %r dropped: the queues take %d bytes "
                            "([limits] queue_memory %d)", session.client_id, key[:200],
                            self.queued_bytes, self.limits.queue_memory)
                session.dropped += 1
                self.stats.pub_dropped += 1
                self._stop_retained(session, key)
                return work
        return -1

    def _walk_retained(self, session, match, work):
        """(all sent, work spent): `_send_retained`'s sending, up to where it has to wait."""
        sub = match.sub
        walk = match.walk
        if walk is None:
            walk = match.walk = self.retained.walk(sub.filter, match.since, match)
        conn = session.conn
        inflight = session.inflight
        authorize = self.hooks.authorize_deliver
        ids = (sub.sub_id,) if sub.sub_id else ()
        now = self.clock()
        msg = match.waiting
        match.waiting = None
        while True:
            if msg is None:
                if work >= _RETAINED_TURN:
                    self._send_retained_soon(session)
                    return False, work
                work += 1
                msg = next(walk, _WALK_END)
                if msg is None:
                    continue
                if msg is _WALK_END:
                    return True, work
                if msg.expired(now):
                    if self.retained.get(msg.topic) is msg:
                        self.retained.delete(msg.topic)
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
                        inflight and session.inflight_bytes + out.size > self.max_inflight_bytes):
                    match.waiting = msg
                    return False, work
                if session.stored:
                    if msg.offset < 0 and self.persist is not None and not self.disk_low:
                        self.persist.store.append(msg, 0, private=True)  # (as `_deliver` does)
                    self.dirty.add(session)
                self._send_outgoing(session, out)
            else:
                self._write_publish(session, msg, 0, True, ids, 0, False)
            work += _RETAINED_SEND
            msg = None

    def _stop_retained(self, session, key=None):
        """The retained messages still to send for subscription `key` (all of them if None)
        are not sent: it is gone or subscribed again, or its client is. (What waits behind
        them in the queue is the caller's to send on: `drain`.)"""
        if key is None:
            session.retained_at = None
        due = session.retained_due
        if due is None:
            return
        stopped = due.values() if key is None else (due.pop(key, None),)
        for match in stopped:
            if match is not None:
                if match.walk is not None:
                    match.walk.close()
                self.queued_bytes -= match.counted * _WALK_REF
        if key is None or not due:
            session.retained_due = None
