"""The router's timers: one heap of (deadline, kind, session), driven by the broker.

The router never sets a loop timer of its own: it tells the broker the earliest deadline
(`on_change`) and the broker calls `Router.tick` then, which takes what is due from here
(`due`) and acts on each by its kind.
"""

import enum
import heapq
from itertools import count


class TimerKind(enum.IntEnum):
    """What a timer is for (Router.tick acts on each)."""

    EXPIRE_SESSION = 1  # an offline session's expiry interval is over
    PUBLISH_WILL = 2  # a will's delay is over
    CATCH_UP = 3  # a session catching up from the log reads on in the next loop turn
    SEND_RETAINED = 4  # the next share of a SUBSCRIBE's retained messages (retained.py)


class Timers:
    """Deadlines (monotonic seconds) per session. A timer belongs to the session's
    `generation` when it was set: one that falls due after the session's client came back
    or left again is stale, and `due` drops it (nothing is ever cancelled)."""

    __slots__ = ("_heap", "_seq", "on_change")

    def __init__(self):
        self._heap = []
        self._seq = count()  # ties on a deadline go in the order they were set
        self.on_change = None  # callback(deadline) when the earliest deadline moves earlier

    def __len__(self):
        return len(self._heap)

    def schedule(self, deadline, kind, session):
        """Have `kind` happen to `session` at `deadline` (monotonic seconds)."""
        heap = self._heap
        heapq.heappush(heap, (deadline, next(self._seq), kind, session, session.generation))
        if heap[0][0] == deadline and self.on_change is not None:
            self.on_change(deadline)

    def due(self, now):
        """Take each timer due at `now`, in deadline order, as (deadline, kind, session),
        leaving out the stale ones. What the caller schedules meanwhile for `now` or
        earlier comes out in the same pass."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            at, _, kind, session, generation = heapq.heappop(heap)
            if session.generation == generation:
                yield at, kind, session

    def next_deadline(self):
        """The earliest deadline, or None when no timer is set."""
        return self._heap[0][0] if self._heap else None
