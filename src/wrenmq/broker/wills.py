"""Wills: the message a client leaves to be published when its connection fails.

A CONNECT's will is kept as an unpublished Message on the session (`from_connect`).
When the client goes without a DISCONNECT that drops it, the will is published at once,
or, with a will delay, held until the delay is over (a timer; `hold`) unless the client
is back first. Held wills are what a client could pile up (a new client id each time,
a long delay), so what they take is counted (`held_bytes`) and bounded by [limits]
will_memory: past it a will goes out at once instead of being held.
"""

import logging
import time

from .message import Message, message_properties
from .timers import TimerKind

log = logging.getLogger("wrenmq.router")

# What a will held for its delay takes besides its message (Message.memory): its timer (a
# heap entry, its deadline and sequence number) and the session's numbers for it, from
# the RSS of 20,000 sessions holding a will against as many without one
# (`python -m wrenmq.bench.bounds wills`, docs/BENCHMARKS.md).
HELD_WILL_COST = 250


def will_size(will):
    """What [limits] will_memory counts for a will held for its delay."""
    return will.memory() + HELD_WILL_COST


class Wills:
    """The router's wills: held, let go, published."""

    __slots__ = ("router", "memory", "held_bytes")

    def __init__(self, router):
        self.router = router
        self.memory = router.limits.will_memory or float("inf")
        self.held_bytes = 0  # will_size of every will held for its delay

    def from_connect(self, will, cid, session):
        """The CONNECT's `will` as an unpublished Message (its expiry starts when it is
        published); its delay goes to the session."""
        props = message_properties(will.properties)
        session.will_delay = props.pop("will_delay_interval", 0)
        return Message(will.topic, will.payload, will.qos, will.retain, props, None, cid, session)

    def client_gone(self, session, now):
        """The client of `session` went without dropping its will: publish it now, or hold
        it for its delay (at most the session's expiry interval)."""
        will = session.will
        delay = min(session.will_delay, session.expiry_interval)
        if delay > 0 and self.held_bytes + will_size(will) > self.memory:
            n = self.router.stats.refuse("wills_early")
            if n:
                log.warning("publishing the will of %s now, not in %d s: held wills take %d bytes "
                            "([limits] will_memory %d); %d published early so far", session.client_id,
                            delay, self.held_bytes, self.router.limits.will_memory, n)
            delay = 0
        if delay <= 0:
            self.publish(session)
        else:
            self.hold(session, now + delay)

    def hold(self, session, at):
        """Keep the will of `session`, whose client is away, until `at` (monotonic), counted
        in held_bytes."""
        self.let_go(session)
        session.will_at = at
        session.will_held = will_size(session.will)
        self.held_bytes += session.will_held
        self.router.timers.schedule(at, TimerKind.PUBLISH_WILL, session)

    def let_go(self, session):
        """The will `session` held while away is published, dropped or its client is back."""
        session.will_at = None
        if session.will_held:
            self.held_bytes -= session.will_held
            session.will_held = 0

    def publish(self, session):
        """Publish the will of `session` now, if it has one and may (authorize_publish)."""
        msg = session.will
        session.will = None
        self.let_go(session)
        if msg is None:
            return
        router = self.router
        hooks = router.hooks
        if hooks.authorize_publish is not None and hooks.authorize_publish(
                session, msg.topic, msg.qos, msg.retain) is False:
            router.stats.denied_publish += 1
            log.info("will of %s on %s denied by ACL", session.client_id, msg.topic)
            return
        msg.timestamp = time.time()
        interval = msg.properties.get("message_expiry_interval")
        cap = router.limits.max_message_expiry
        if cap and (interval is None or interval > cap):
            interval = msg.properties["message_expiry_interval"] = cap
        if interval is not None:
            msg.expiry = router.clock() + interval
        log.info("publishing will of %s on %s", session.client_id, msg.topic)
        router.publish(msg)
        if router.persist is not None:
            router.persist.will_published(session)
