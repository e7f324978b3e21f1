"""The router's counters behind $SYS, the metrics listener and the admin API."""

import time


class Stats:
    """Counters as plain attributes, so the hot path bumps one with a single add."""

    __slots__ = ("started", "msgs_received", "msgs_sent", "bytes_received", "bytes_sent",
                 "pub_received", "pub_sent", "pub_dropped", "connects", "clients_maximum",
                 "denied_publish", "denied_subscribe", "denied_deliver", "expired", "rate_limited",
                 "refused_connections", "retained_refused", "sessions_refused", "refused_disk_low",
                 "refused_insync", "subscriptions_refused", "wills_early",
                 "_logged")

    def __init__(self):
        self.started = time.time()
        for s in self.__slots__[1:-1]:
            setattr(self, s, 0)
        self._logged = {}  # counter -> when refuse() last said to log

    def refuse(self, counter):
        """Count one refusal in `counter`; return the count so far if the caller should log
        it, at most once a second per counter (a flood of refusals is a line a second), else 0."""
        n = getattr(self, counter) + 1
        setattr(self, counter, n)
        now = time.monotonic()
        if now - self._logged.get(counter, float("-inf")) >= 1.0:
            self._logged[counter] = now
            return n
        return 0
