"""The sessions' queues: what waits behind a client's window, and what it all costs.

A session's `queue` holds Outgoing entries its client's window (receive maximum,
max_inflight_bytes) or socket has no room for yet, or that wait for the client to come
back. `Queues` keeps them bounded (per session: max_queued_messages and
max_queued_bytes, max_queued_offline while the client is away; all sessions together:
queue_memory) and counts what they cost (`queued_bytes`: each entry, and each message
they hold once however many queues hold it, Message.held). A persistent session whose
messages are in the log is not given more than the bound in memory: it reads the rest
back from the log when its queue drains (catchup.py).
"""

from collections import deque

from .session import QUEUE_ENTRY_COST


def entry_cost(msg):
    """What one more queue entry holding `msg` adds to `Queues.queued_bytes`: the entry,
    and the message itself if no queue holds it yet (Message.held)."""
    return QUEUE_ENTRY_COST if msg.held else QUEUE_ENTRY_COST + msg.memory()


def from_the_log(out):
    """Whether catching up from the log gives the queued `out` back as it was, in log
    order: a logged QoS 1/2 message the session's own subscriptions routed (not shared,
    not retained on subscribe)."""
    return out.tracked and out.qos and out.msg.offset >= 0


class Queues:
    """The bounds on the sessions' queues and what they cost in memory."""

    __slots__ = ("max_queued", "max_queued_offline", "max_queued_bytes", "queue_memory", "queue_qos0",
                 "queued_bytes")

    def __init__(self, limits, queue_qos0):
        self.max_queued = limits.max_queued_messages
        # An offline session's queue in memory, past which the log holds its messages.
        offline = limits.max_queued_offline
        self.max_queued_offline = min(offline, self.max_queued) if offline else self.max_queued
        self.max_queued_bytes = limits.max_queued_bytes or float("inf")
        self.queue_memory = limits.queue_memory or float("inf")
        self.queue_qos0 = queue_qos0  # [broker] queue_qos0_messages: offline sessions get QoS 0 too
        # What the queues of all sessions cost in memory (what queue_memory bounds): each
        # entry, and each message they hold once (`push`); the retained messages a
        # SUBSCRIBE still has to send count here too (retained.py).
        self.queued_bytes = 0

    def push(self, session, out):
        """Append `out` to the session's queue, whatever the bounds."""
        if session.queue.__class__ is tuple:
            session.queue = deque()
        session.queue.append(out)
        session.queued_bytes += out.size
        msg = out.msg
        self.queued_bytes += entry_cost(msg)
        msg.held += 1

    def pop(self, session):
        """Take the first entry of the session's queue."""
        out = session.queue.popleft()
        session.dequeued += 1
        session.queued_bytes -= out.size
        self.let_go(out.msg)
        return out

    def let_go(self, msg):
        """A queue entry holding `msg` is gone."""
        msg.held -= 1
        if msg.held:
            self.queued_bytes -= QUEUE_ENTRY_COST
        else:
            self.queued_bytes -= QUEUE_ENTRY_COST + msg.memory()

    def clear(self, session):
        """Empty the session's queue."""
        for out in session.queue:
            self.let_go(out.msg)
        session.queued_bytes = 0
        session.queue = ()

    def enqueue(self, session, out):
        """Queue `out` for `session` within the bounds. A message the log gives back is
        left to it instead (the session catches up from its offset once the queue drains);
        False if `out` is to be dropped (the caller counts it)."""
        n = len(session.queue)
        full = n >= self.max_queued or session.queued_bytes + out.size > self.max_queued_bytes \
            or self.queued_bytes + entry_cost(out.msg) > self.queue_memory
        if full or (n >= self.max_queued_offline and session.conn is None):
            if session.stored and from_the_log(out):
                # (An offline session holds only max_queued_offline in memory: devices
                # that come and go would otherwise keep max_queued_messages each; make soak.)
                if session.resume_from is None:
                    session.resume_from = out.msg.offset
                return True
            if full:
                return False
        self.push(session, out)
        return True

    def trim_offline(self, session):
        """A session whose client left while behind keeps max_queued_offline messages in
        memory, as one that was offline all along does (`enqueue`): the newest of its
        queue, from the first past that bound, are let go and read back from the log
        when it returns (catch-up). Only a tail the log gives back as it was
        (`from_the_log`), and not while QoS 0 messages are queued for offline sessions,
        which the catch-up would then deliver a second time. The cursor saved next
        (Persistence.session_offline) does not move: what is let go is newer than what
        is kept."""
        if self.queue_qos0 or not session.stored:
            return
        queue = session.queue
        keep = self.max_queued_offline
        if len(queue) <= keep:
            return
        cut = len(queue)
        while cut > keep:
            if not from_the_log(queue[cut - 1]):
                break
            cut -= 1
        if cut == len(queue):
            return
        first = queue[cut].msg.offset
        while len(queue) > cut:
            out = queue.pop()
            session.queued_bytes -= out.size
            self.let_go(out.msg)
        if session.resume_from is None or first < session.resume_from:
            session.resume_from = first
