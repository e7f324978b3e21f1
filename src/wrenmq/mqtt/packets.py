"""Packet objects: plain data with `__slots__`, one class per MQTT control packet.

They carry no behaviour beyond equality and repr so that the codec, the broker
and tests can build and compare them freely. Properties are a mapping from the
property name (see `constants.PROPERTIES`) to its value; `user_property` is a
list of (key, value) pairs in wire order; `subscription_identifier` is a list
in PUBLISH and a single int in SUBSCRIBE. Packets decoded without properties
share the read-only `NO_PROPERTIES` mapping.
"""

from types import MappingProxyType

from . import constants as C

NO_PROPERTIES = MappingProxyType({})


class Packet:
    __slots__ = ()
    TYPE = 0
    _eq_ignore = ()

    def _fields(self):
        return tuple(getattr(self, s) for s in self.__slots__ if s not in self._eq_ignore)

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return self._fields() == other._fields()

    def __repr__(self):
        parts = ", ".join(f"{s}={getattr(self, s)!r}" for s in self.__slots__ if s not in self._eq_ignore)
        return f"{type(self).__name__}({parts})"

    __hash__ = None


def _props(p):
    if not p:
        return NO_PROPERTIES
    return p


class Will:
    """The will message carried in CONNECT."""

    __slots__ = ("topic", "payload", "qos", "retain", "properties")

    def __init__(self, topic, payload=b"", qos=0, retain=False, properties=None):
        self.topic = topic
        self.payload = payload
        self.qos = qos
        self.retain = retain
        self.properties = _props(properties)

    def __eq__(self, other):
        if type(other) is not Will:
            return NotImplemented
        return (self.topic, self.payload, self.qos, self.retain, dict(self.properties)) == (
            other.topic, other.payload, other.qos, other.retain, dict(other.properties))

    def __repr__(self):
        return (f"Will(topic={self.topic!r}, payload={self.payload!r}, qos={self.qos}, "
                f"retain={self.retain}, properties={dict(self.properties)!r})")

    __hash__ = None


class Connect(Packet):
    __slots__ = ("client_id", "version", "clean_start", "keepalive", "will", "username",
                 "password", "properties", "protocol_name")
    TYPE = C.CONNECT

    def __init__(self, client_id="", version=C.MQTT311, clean_start=True, keepalive=60, will=None,
                 username=None, password=None, properties=None, protocol_name=None):
        self.client_id = client_id
        self.version = version
        self.clean_start = clean_start
        self.keepalive = keepalive
        self.will = will
        self.username = username
        self.password = password
        self.properties = _props(properties)
        self.protocol_name = protocol_name or ("MQIsdp" if version == C.MQTT31 else "MQTT")


class Connack(Packet):
    __slots__ = ("session_present", "reason_code", "properties")
    TYPE = C.CONNACK

    def __init__(self, session_present=False, reason_code=0, properties=None):
        self.session_present = session_present
        self.reason_code = reason_code
        self.properties = _props(properties)


class Publish(Packet):
    """A PUBLISH. `raw` is the exact bytes it was decoded from (None if built here).

    The decoder does not copy them: `raw` is cut from the received data the first
    time someone asks (a broker forwarding the packet unchanged), else never.
    """

    __slots__ = ("topic", "payload", "qos", "retain", "dup", "packet_id", "properties", "_raw", "_src")
    TYPE = C.PUBLISH
    _eq_ignore = ("_raw", "_src")

    def __init__(self, topic, payload=b"", qos=0, retain=False, dup=False, packet_id=None,
                 properties=None, raw=None, src=None):
        self.topic = topic
        self.payload = payload
        self.qos = qos
        self.retain = retain
        self.dup = dup
        self.packet_id = packet_id
        self.properties = _props(properties)
        self._raw = raw
        self._src = src  # (data, start, end) of the packet in the received bytes

    @property
    def raw(self):
        raw = self._raw
        if raw is None and self._src is not None:
            data, start, end = self._src
            raw = self._raw = data[start:end]
            self._src = None
        return raw


class _Ack(Packet):
    __slots__ = ("packet_id", "reason_code", "properties")

    def __init__(self, packet_id, reason_code=0, properties=None):
        self.packet_id = packet_id
        self.reason_code = reason_code
        self.properties = _props(properties)


class Puback(_Ack):
    __slots__ = ()
    TYPE = C.PUBACK


class Pubrec(_Ack):
    __slots__ = ()
    TYPE = C.PUBREC


class Pubrel(_Ack):
    __slots__ = ()
    TYPE = C.PUBREL


class Pubcomp(_Ack):
    __slots__ = ()
    TYPE = C.PUBCOMP


class SubscribeTopic:
    """One topic filter of a SUBSCRIBE with its subscription options."""

    __slots__ = ("filter", "qos", "no_local", "retain_as_published", "retain_handling")

    def __init__(self, filter, qos=0, no_local=False, retain_as_published=False, retain_handling=0):
        self.filter = filter
        self.qos = qos
        self.no_local = no_local
        self.retain_as_published = retain_as_published
        self.retain_handling = retain_handling

    def _key(self):
        return (self.filter, self.qos, self.no_local, self.retain_as_published, self.retain_handling)

    def __eq__(self, other):
        if type(other) is not SubscribeTopic:
            return NotImplemented
        return self._key() == other._key()

    def __repr__(self):
        return "SubscribeTopic(%r, qos=%d, no_local=%s, retain_as_published=%s, retain_handling=%d)" % self._key()

    __hash__ = None


class Subscribe(Packet):
    __slots__ = ("packet_id", "topics", "properties")
    TYPE = C.SUBSCRIBE

    def __init__(self, packet_id, topics, properties=None):
        self.packet_id = packet_id
        self.topics = topics
        self.properties = _props(properties)


class Suback(Packet):
    __slots__ = ("packet_id", "reason_codes", "properties")
    TYPE = C.SUBACK

    def __init__(self, packet_id, reason_codes, properties=None):
        self.packet_id = packet_id
        self.reason_codes = reason_codes
        self.properties = _props(properties)


class Unsubscribe(Packet):
    __slots__ = ("packet_id", "filters", "properties")
    TYPE = C.UNSUBSCRIBE

    def __init__(self, packet_id, filters, properties=None):
        self.packet_id = packet_id
        self.filters = filters
        self.properties = _props(properties)


class Unsuback(Packet):
    """UNSUBACK; `reason_codes` is empty for MQTT 3.1.1, which has none."""

    __slots__ = ("packet_id", "reason_codes", "properties")
    TYPE = C.UNSUBACK

    def __init__(self, packet_id, reason_codes=(), properties=None):
        self.packet_id = packet_id
        self.reason_codes = list(reason_codes)
        self.properties = _props(properties)


class Pingreq(Packet):
    __slots__ = ()
    TYPE = C.PINGREQ


class Pingresp(Packet):
    __slots__ = ()
    TYPE = C.PINGRESP


class Disconnect(Packet):
    __slots__ = ("reason_code", "properties")
    TYPE = C.DISCONNECT

    def __init__(self, reason_code=0, properties=None):
        self.reason_code = reason_code
        self.properties = _props(properties)


class Auth(Packet):
    __slots__ = ("reason_code", "properties")
    TYPE = C.AUTH

    def __init__(self, reason_code=0, properties=None):
        self.reason_code = reason_code
        self.properties = _props(properties)


PINGREQ = Pingreq()
PINGRESP = Pingresp()
