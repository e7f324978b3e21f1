"""The live figures of the dashboard and `wrenmq top`: one sample a second, pushed as
Server-Sent Events to whoever listens.

A sample reads the counters the broker keeps anyway (`Router.stats`, the gauges `$SYS`
shows, the commit log's and the cluster's figures): a few dozen attribute reads a second,
nothing per message. Rates are the differences between two samples. The last
`HISTORY` samples are kept, so a dashboard opened now draws the last five minutes at once.
What `SysTopics.snapshot` adds on top (a walk over every session for the queued count)
is left to `/api/v1/stats`, read when asked.

Each open stream has a small queue; one that does not read (QUEUE samples waiting) is
dropped from the feed and its stream ends, so a stalled browser holds a few samples.
"""

import asyncio
import collections
import json
import time

HISTORY = 300
PERIOD = 1.0
QUEUE = 16
HEARTBEAT = 15.0  # seconds between SSE comments on a quiet stream (proxies close idle ones)

# The figures (counters) whose rate per second each sample carries.
_RATES = ("msgs_in", "msgs_out", "bytes_in", "bytes_out", "dropped", "connects", "refused",
          "denied", "log_records", "log_bytes", "cluster_forwarded", "cluster_received")


def read_figures(broker):
    """The figures of one sample (cheap: see the module docstring)."""
    router = broker.router
    s = router.stats
    figures = {
        "connected": router.online,
        "sessions": len(router.sessions),
        "subscriptions": router.subscription_count(),
        "retained": router.retained.count,
        "queued_bytes": router.queued_bytes,
        "connections": len(broker.connections),
        "msgs_in": s.pub_received,
        "msgs_out": s.pub_sent,
        "bytes_in": s.bytes_received,
        "bytes_out": s.bytes_sent,
        "dropped": s.pub_dropped,
        "connects": s.connects,
        "refused": s.refused_connections + s.sessions_refused + broker.bans.refused,
        "denied": s.denied_publish + s.denied_subscribe,
        "expired": s.expired,
        "rate_limited": s.rate_limited,
    }
    store = broker.store
    if store is not None:
        figures["log_records"] = store.appended
        figures["log_bytes"] = store.bytes_appended
        figures["log_end_offset"] = store.next_offset
        figures["log_start_offset"] = store.start_offset
        figures["log_unwritten"] = store.unwritten_bytes
        figures["disk_low"] = int(store.disk_low)
    cluster = broker.cluster
    if cluster is not None:
        values = cluster.sys_values()
        figures["cluster_nodes"] = values["$SYS/broker/cluster/nodes"]
        figures["cluster_links_up"] = values["$SYS/broker/cluster/links_up"]
        figures["cluster_forwarded"] = values["$SYS/broker/cluster/messages/forwarded"]
        figures["cluster_received"] = values["$SYS/broker/cluster/messages/received"]
    return figures


class _Listener:
    """One open stream's samples not yet written."""

    __slots__ = ("samples", "wake", "over")

    def __init__(self):
        self.samples = collections.deque()
        self.wake = asyncio.Event()
        self.over = False  # it fell QUEUE samples behind, or the feed stopped: its stream ends


class Feed:
    """Samples the broker every PERIOD seconds while its admin listener is open."""

    def __init__(self, broker, node):
        self.broker = broker
        self.node = node
        self.history = collections.deque(maxlen=HISTORY)
        self.listeners = set()
        self._last = None  # (monotonic time, figures) of the previous sample
        self._loop = None
        self._handle = None

    def start(self):
        self._loop = asyncio.get_running_loop()
        self._sample()

    def stop(self):
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        for listener in self.listeners:
            listener.over = True
            listener.wake.set()
        self.listeners.clear()

    def _sample(self):
        self._handle = self._loop.call_later(PERIOD, self._sample)
        sample = self.take()
        self.history.append(sample)
        for listener in list(self.listeners):
            if len(listener.samples) >= QUEUE:
                listener.over = True  # it does not read: its stream ends
                self.listeners.discard(listener)
            else:
                listener.samples.append(sample)
            listener.wake.set()

    def take(self):
        """A sample now: the figures and the rates since the previous sample."""
        now = time.monotonic()
        figures = read_figures(self.broker)
        rates = {}
        last = self._last
        if last is not None:
            dt = now - last[0]
            if dt > 0:
                prev = last[1]
                for name in _RATES:
                    if name in figures and name in prev:
                        rates[name] = max(0.0, (figures[name] - prev[name]) / dt)
        self._last = (now, figures)
        return {"t": time.time(), "node": self.node, "figures": figures, "rates": rates}

    async def events(self):
        """The SSE stream: the history as one `history` event, then a `sample` event per
        sample (and a comment line when quiet), until the listener closes."""
        listener = _Listener()
        self.listeners.add(listener)
        try:
            yield _event("history", list(self.history))
            while True:
                if not listener.samples:
                    if listener.over:
                        return
                    listener.wake.clear()
                    try:
                        await asyncio.wait_for(listener.wake.wait(), HEARTBEAT)
                    except asyncio.TimeoutError:
                        yield b": keep-alive\n\n"
                    continue
                if listener.over:
                    return
                yield _event("sample", listener.samples.popleft())
        finally:
            self.listeners.discard(listener)


def _event(name, data):
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
