"""The application message as the broker routes it, and its outgoing encodings.

A message is built once per accepted PUBLISH and shared by every subscriber.
Its encodings (the codec's: `publish_head`, `encode_publish`) are cached per variant
while it is routed, and when the packet a subscriber needs is byte-for-byte the one
that arrived, the received bytes are sent as they are.
"""

from math import ceil
from struct import Struct
from sys import getsizeof

from ..mqtt.codec import encode_properties, encode_publish, publish_head

_packet_id = Struct("!H").pack

# The objects a held message is made of besides its payload and topic (the Message, its
# str and bytes headers, its properties dict, its timestamp), in bytes: counted with
# gc and sys.getsizeof in a broker under `make soak` (docs/BENCHMARKS.md).
MESSAGE_OVERHEAD = 400

# Properties that travel with the message (topic_alias and subscription_identifier
# belong to one hop and are rebuilt per subscriber).
_HOP_PROPERTIES = ("topic_alias", "subscription_identifier")


class Message:
    __slots__ = (
        "topic", "payload", "qos", "retain", "properties", "expiry", "client_id", "origin",
        "raw", "raw_v5", "timestamp", "offset", "_topic_b", "_props_v5", "encodings", "packet",
        "held",
    )

    def __init__(self, topic, payload, qos=0, retain=False, properties=None, expiry=None,
                 client_id="", origin=None, raw=None, raw_v5=False, timestamp=0.0):
        self.topic = topic
        self.payload = payload
        self.qos = qos
        self.retain = retain
        # Forwardable MQTT 5 properties (a dict; empty when there are none).
        self.properties = properties if properties is not None else {}
        # Absolute monotonic deadline after which the message must not be delivered.
        self.expiry = expiry
        self.client_id = client_id
        # The publishing session (for no-local), or None for broker-made messages.
        self.origin = origin
        # Received bytes of a QoS 0, retain 0 PUBLISH, reusable as is for subscribers
        # of the same protocol family (3.x or 5) when nothing per-hop needs to change.
        self.raw = raw
        self.raw_v5 = raw_v5
        self.timestamp = timestamp
        self.offset = -1  # position in the commit log, once appended
        self._topic_b = None
        self._props_v5 = None
        # Its encodings, shared by the subscribers one routing reaches (`parts`): a dict
        # while the router routes it (None until the first is made; Router.route sets and
        # clears it), False otherwise. A message that waits in queues, or as a retained
        # message, holds no copies of itself: a soak found them 60% of what held messages
        # cost (docs/BENCHMARKS.md).
        self.encodings = False
        # While it is being routed: the PUBLISH it came from, whose bytes can be forwarded
        # as they are (cut from the received data only if a subscriber needs them).
        self.packet = None
        # Queue entries that hold it: the router counts what it costs once, while any does.
        self.held = 0

    def memory(self):
        """What holding this message costs the broker in bytes, about: its payload, its
        topic (as text and as UTF-8), MESSAGE_OVERHEAD, and what its properties take
        (properties_memory). What `[limits] queue_memory` counts once per queued message,
        however many queues hold it, and what will_memory and max_retained_bytes count."""
        n = len(self.payload) + 2 * len(self.topic) + MESSAGE_OVERHEAD
        return n + properties_memory(self.properties) if self.properties else n

    @property
    def topic_bytes(self):
        tb = self._topic_b
        if tb is None:
            tb = self._topic_b = self.topic.encode("utf-8")
        return tb

    def expired(self, now):
        return self.expiry is not None and now >= self.expiry

    def props_v5(self, sub_ids=(), now=0.0, alias=None):
        """Encoded 5.0 property block for one delivery."""
        if not sub_ids and self.expiry is None and alias is None:
            pb = self._props_v5
            if pb is None:
                pb = self._props_v5 = encode_properties(self.properties)
            return pb
        props = dict(self.properties)
        if self.expiry is not None:
            props["message_expiry_interval"] = max(0, ceil(self.expiry - now))
        if sub_ids:
            props["subscription_identifier"] = list(sub_ids)
        if alias is not None:
            props["topic_alias"] = alias
        return encode_properties(props)

    def parts(self, v5, qos, retain, sub_ids=(), now=0.0):
        """(head, tail) of the PUBLISH for a subscriber, without DUP and packet id.

        For QoS > 0 the packet is head + packet id (2 bytes) + tail; the remaining
        length in head already counts the packet id. Cached while the router routes the
        message (`encodings`), when reusable.
        """
        cache = self.encodings
        if cache is not False and self.expiry is None:
            key = (v5, qos, retain, sub_ids)
            if cache is None:
                cache = self.encodings = {}
            else:
                hit = cache.get(key)
                if hit is not None:
                    return hit
        else:
            key = None
        props = self.props_v5(sub_ids, now) if v5 else b""
        tail = props + self.payload if props else self.payload
        result = (publish_head(self.topic_bytes, qos, retain, False, (2 if qos else 0) + len(tail)), tail)
        if key is not None:
            cache[key] = result
        return result

    def encode_qos0(self, v5, retain, sub_ids=(), now=0.0):
        """The full QoS 0 PUBLISH for a subscriber, reusing the received bytes when identical."""
        if v5 == self.raw_v5 and not retain and not sub_ids and (not v5 or self.expiry is None):
            raw = self.raw
            if raw is None and self.packet is not None:
                raw = self.raw = self.packet.raw
            if raw is not None:
                return raw
        head, tail = self.parts(v5, 0, retain, sub_ids, now)
        return head + tail

    def encode(self, v5, qos, retain, packet_id, dup=False, sub_ids=(), now=0.0, alias=None,
               alias_only=False):
        """One PUBLISH for one subscriber; the general path (aliases, DUP)."""
        if alias is None and not dup:
            if not qos:
                return self.encode_qos0(v5, retain, sub_ids, now)
            head, tail = self.parts(v5, qos, retain, sub_ids, now)
            return head + _packet_id(packet_id) + tail
        props = self.props_v5(sub_ids, now, alias) if v5 else b""
        return encode_publish(b"" if alias_only else self.topic_bytes, self.payload, qos, retain, dup,
                              packet_id, props)

    def __repr__(self):
        return (f"Message(topic={self.topic!r}, payload={self.payload[:32]!r}, qos={self.qos}, "
                f"retain={self.retain}, client_id={self.client_id!r})")


def properties_memory(props):
    """What a message's MQTT 5 properties take in bytes: the dict and its values as Python
    objects (sys.getsizeof: user properties are a list of (name, value) tuples), and their
    text once more for the encoded block a PUBLISH to a 5.0 client leaves cached on the
    message (`props_v5`). A client decides how large they are (up to max_packet_size): a
    fixed figure would let a will or a queued message hold a megabyte counted as a few
    hundred bytes."""
    n = getsizeof(props) + 40
    for value in props.values():
        n += getsizeof(value)
        if value.__class__ is list:
            for item in value:
                if item.__class__ is tuple:
                    name, text = item
                    n += getsizeof(item) + getsizeof(name) + getsizeof(text) + len(name) + len(text) + 5
                else:
                    n += getsizeof(item)
        elif value.__class__ is str or value.__class__ is bytes:
            n += len(value) + 3
        else:
            n += 5
    return n


def message_properties(props):
    """The forwardable subset of a received PUBLISH's properties (a new dict)."""
    if not props:
        return {}
    out = dict(props)
    for k in _HOP_PROPERTIES:
        out.pop(k, None)
    return out
