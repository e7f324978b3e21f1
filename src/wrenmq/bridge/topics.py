"""Which topics a bridge carries, and what they are called on the other side (sans-IO).

Each [[bridge.topic]] is Mosquitto's `topic pattern direction qos local-prefix
remote-prefix`: a local topic local_prefix + T is remote_prefix + T on the remote, for
every T the pattern matches (an empty pattern: the prefixes are the whole topics). The
first entry that matches a topic decides, as in Mosquitto.
"""

from ..mqtt.topics import topic_matches

_CACHE_TOPICS = 10_000  # topics whose mapping is remembered (then forgotten all at once)


class Route:
    """One [[bridge.topic]] entry seen from one side: topics under `prefix` (matching
    `filter`) become `other_prefix` + the rest, at QoS `qos` at most."""

    __slots__ = ("filter", "prefix", "other_prefix", "qos", "exact")

    def __init__(self, prefix, other_prefix, pattern, qos):
        self.prefix = prefix
        self.other_prefix = other_prefix
        self.filter = prefix + pattern
        self.qos = qos
        self.exact = not pattern  # the prefix is the whole topic

    def map(self, topic):
        """The topic on the other side, or None if this entry does not carry `topic`."""
        if self.exact:
            return self.other_prefix if topic == self.prefix else None
        if not topic.startswith(self.prefix) or not topic_matches(self.filter, topic):
            return None  # ("a/#" matches "a" too, which does not start with the prefix "a/")
        return self.other_prefix + topic[len(self.prefix):]


class TopicMap:
    """A bridge's [[bridge.topic]] entries: `outbound` maps local topics to remote ones,
    `inbound` remote topics to local ones; `subscriptions` is what to ask the remote for."""

    def __init__(self, topics):
        self.out = [Route(t.local_prefix, t.remote_prefix, t.pattern, t.qos)
                    for t in topics if t.direction in ("out", "both")]
        self.into = [Route(t.remote_prefix, t.local_prefix, t.pattern, t.qos)
                     for t in topics if t.direction in ("in", "both")]
        self._out_cache = {}
        self._in_cache = {}

    @staticmethod
    def _lookup(routes, cache, topic):
        hit = cache.get(topic, False)
        if hit is not False:
            return hit
        hit = None
        for route in routes:
            other = route.map(topic)
            if other is not None:
                hit = (other, route.qos)
                break
        if len(cache) >= _CACHE_TOPICS:
            cache.clear()
        cache[topic] = hit
        return hit

    def outbound(self, topic):
        """(remote topic, QoS at most) for a local topic the bridge sends out, else None."""
        return self._lookup(self.out, self._out_cache, topic) if self.out else None

    def inbound(self, topic):
        """(local topic, QoS at most) for a remote topic the bridge brings in, else None."""
        return self._lookup(self.into, self._in_cache, topic) if self.into else None

    def subscriptions(self):
        """(remote filter, QoS) of each "in" entry, without repeats."""
        seen = {}
        for route in self.into:
            seen[route.filter] = max(seen.get(route.filter, 0), route.qos)
        return list(seen.items())
