"""$SYS topics with Mosquitto's names, published retained every `sys.interval` seconds."""

import math
import time

from .. import __version__

# Exponential moving averages as Mosquitto computes its load figures.
_WINDOWS = {"1min": 60.0, "5min": 300.0, "15min": 900.0}


class SysTopics:
    """Computes and publishes the $SYS tree; driven by the broker's loop."""

    def __init__(self, broker):
        self.broker = broker
        self.router = broker.router
        self._last = None
        self._load = {}

    def _loads(self, now, counters):
        out = {}
        if self._last is None:
            self._last = (now, counters)
            return out
        then, prev = self._last
        dt = max(now - then, 1e-6)
        for name, value in counters.items():
            rate = (value - prev[name]) / dt * 60.0  # per minute, like Mosquitto
            for window, span in _WINDOWS.items():
                key = (name, window)
                k = math.exp(-dt / span)
                avg = self._load.get(key, rate)
                avg = avg * k + rate * (1 - k)
                self._load[key] = avg
                out[f"$SYS/broker/load/{name}/{window}"] = f"{avg:.2f}"
        self._last = (now, counters)
        return out

    def snapshot(self):
        """The $SYS values without the load averages (reading them changes nothing; the
        Prometheus metrics listener reads these)."""
        r = self.router
        s = r.stats
        total = len(r.sessions)
        values = {
            "$SYS/broker/version": f"wrenmq version {__version__}",
            "$SYS/broker/uptime": f"{int(time.time() - s.started)} seconds",
            "$SYS/broker/clients/connected": r.online,
            "$SYS/broker/clients/active": r.online,
            "$SYS/broker/clients/total": total,
            "$SYS/broker/clients/disconnected": total - r.online,
            "$SYS/broker/clients/inactive": total - r.online,
            "$SYS/broker/clients/maximum": s.clients_maximum,
            "$SYS/broker/messages/received": s.pub_received,
            "$SYS/broker/messages/sent": s.pub_sent,
            "$SYS/broker/publish/messages/received": s.pub_received,
            "$SYS/broker/publish/messages/sent": s.pub_sent,
            "$SYS/broker/publish/messages/dropped": s.pub_dropped,
            "$SYS/broker/publish/messages/denied": s.denied_publish,
            "$SYS/broker/publish/messages/refused": s.refused_disk_low,
            "$SYS/broker/clients/rate_limited": s.rate_limited,
            "$SYS/broker/connections/refused": s.refused_connections,
            "$SYS/broker/store/messages/bytes": r.queued_bytes,
            "$SYS/broker/messages/expired": s.expired,
            "$SYS/broker/bytes/received": s.bytes_received,
            "$SYS/broker/bytes/sent": s.bytes_sent,
            "$SYS/broker/subscriptions/count": r.subscription_count(),
            "$SYS/broker/subscriptions/denied": s.denied_subscribe,
            "$SYS/broker/subscriptions/refused": s.subscriptions_refused,
            "$SYS/broker/subscriptions/bytes": r.subscription_bytes,
            "$SYS/broker/wills/held bytes": r.held_will_bytes,
            "$SYS/broker/wills/published early": s.wills_early,
            "$SYS/broker/retained messages/count": r.retained.count,
            "$SYS/broker/retained messages/bytes": r.retained.memory,
            "$SYS/broker/retained messages/refused": s.retained_refused,
            "$SYS/broker/clients/refused sessions": s.sessions_refused,
            "$SYS/broker/store/messages/count": sum(len(x.queue) + len(x.inflight) for x in r.sessions.values()),
            "$SYS/broker/connections/total": s.connects,
        }
        values.update(self.broker.extra_sys_values())
        return values

    def values(self):
        """Every $SYS value, the load averages included (they move with each call)."""
        values = self.snapshot()
        s = self.router.stats
        now = time.monotonic()
        counters = {
            "messages/received": s.pub_received, "messages/sent": s.pub_sent,
            "bytes/received": s.bytes_received, "bytes/sent": s.bytes_sent,
            "connections": s.connects, "publish/dropped": s.pub_dropped,
        }
        values.update(self._loads(now, counters))
        return values

    def publish(self):
        pub = self.router.publish_internal
        for topic, value in self.values().items():
            pub(topic, str(value).encode(), 0, True)
