"""Malformed and forbidden input on a raw socket, and what the broker answers.

In the spirit of Mosquitto's broker tests (test/broker/01-connect-*, 02-subscribe-*,
03-publish-*): every row of the tables below, and of the malformed packets of
packet_table.py (the codec's table, test_codec.py), is one protocol version, the bytes
a client sends (as its first packet, or right after a valid CONNECT) and the one
outcome the specification allows:

- CONNACK(rc): a CONNACK with that return / reason code, then the socket closes;
- DISCONNECT(rc): (5.0) a DISCONNECT with that reason code, then the socket closes;
- CLOSE: the socket closes without any packet (3.1.1 has no way to say why);
- ANSWER(pkt): exactly this packet comes back and the connection stays up.

After every row a fresh client must still connect and get a PINGRESP, so no
malformed input can hurt the broker itself.
"""

import time

import pytest

from conftest import RawClient
from packet_table import (
    MALFORMED, SESSION_EXPIRY, SUB_ID, TOPIC_ALIAS, USER_PROPERTY, V5, V311, connect, fixed,
    prop_u16, prop_u32, props, publish, s, subscribe,
)
from wrenmq.broker.hooks import Hook
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.codec import MQTTError, encode, encode_varint
from wrenmq.mqtt.packets import (
    PINGREQ, PINGRESP, Auth, Connack, Connect, Disconnect, Puback, Pubcomp, Publish, Pubrec, Pubrel,
    Suback, Subscribe, SubscribeTopic, Will,
)

# --- outcomes ----------------------------------------------------------------

class CONNACK:
    def __init__(self, rc):
        self.rc = rc

    def __repr__(self):
        return f"CONNACK(0x{self.rc:02x})"


class DISCONNECT:
    def __init__(self, rc):
        self.rc = rc

    def __repr__(self):
        return f"DISCONNECT(0x{self.rc:02x})"


class _Close:
    def __repr__(self):
        return "CLOSE"


CLOSE = _Close()


class ANSWER:
    def __init__(self, pkt):
        self.pkt = pkt

    def __repr__(self):
        return f"ANSWER({show(self.pkt)})"


def show(pkt):
    """repr with every field (the packet classes' own repr skips inherited slots)."""
    if pkt is None:
        return "connection closed"
    slots = [s for k in type(pkt).__mro__ for s in getattr(k, "__slots__", ()) if s != "raw"]
    return f"{type(pkt).__name__}(" + ", ".join(f"{s}={getattr(pkt, s)!r}" for s in slots) + ")"


def recv(client, timeout=3.0):
    """Next packet (None on close); a packet the codec rejects fails the test."""
    try:
        return client.recv(timeout)
    except MQTTError as e:
        pytest.fail(f"the broker sent a packet that is not valid MQTT {client.version}: {e}")
    except TimeoutError:
        pytest.fail("the broker neither answered nor closed the connection")


def expect(client, outcome):
    if isinstance(outcome, CONNACK):
        pkt = recv(client)
        assert isinstance(pkt, Connack), f"expected {outcome}, got {show(pkt)}"
        assert pkt.reason_code == outcome.rc, f"expected {outcome}, got {show(pkt)}"
        assert not pkt.session_present
        assert recv(client) is None, "connection not closed after a refusing CONNACK"
    elif isinstance(outcome, DISCONNECT):
        pkt = recv(client)
        assert isinstance(pkt, Disconnect), f"expected {outcome}, got {show(pkt)}"
        assert pkt.reason_code == outcome.rc, f"expected {outcome}, got {show(pkt)}"
        assert recv(client) is None, "connection not closed after the server's DISCONNECT"
    elif outcome is CLOSE:
        pkt = recv(client)
        assert pkt is None, f"expected the connection to close without an answer, got {show(pkt)}"
    else:
        pkt = recv(client)
        assert pkt == outcome.pkt, f"expected {outcome}, got {show(pkt)}"
        client.send(PINGREQ)
        assert recv(client) == PINGRESP, "connection did not stay up after the answer"


def open_client(port, version, client_id="c", **kw):
    """A raw client past CONNECT/CONNACK(0)."""
    c = RawClient(port, version)
    c.send(Connect(client_id, version, **kw))
    ack = recv(c)
    assert isinstance(ack, Connack) and ack.reason_code == 0, ack
    return c


def assert_alive(port):
    """The broker still serves a fresh client: CONNECT, CONNACK, PINGREQ, PINGRESP."""
    for version in (V311, V5):
        c = open_client(port, version, client_id=f"alive-{version}")
        try:
            c.send(PINGREQ)
            assert recv(c) == PINGRESP
        finally:
            c.close()


# --- CONNECT as the first packet ---------------------------------------------

CONNECT_ROWS = [
    # (A CONNECT the decoder rejects is a row of packet_table.MALFORMED: test_malformed_packets.)
    ("protocol-MQIsdp-level-3-accepted", V311, connect(3, name="MQIsdp"), V311, "accepted"),
    # A will the broker cannot take: refused once decoded.
    ("will-topic-wildcard-v5", V5, connect(V5, flags=0x06, payload_tail=props() + s("w/#") + s(b"")),
     V5, CONNACK(0x90)),
    ("will-topic-wildcard", V311, connect(V311, flags=0x06, payload_tail=s("w/+") + s(b"")), V311, CLOSE),
    ("password-without-username-v5-allowed", V5, connect(V5, flags=0x42, payload_tail=s(b"pw")),
     V5, "accepted"),
    # 3.1.1: an empty client id needs clean session.
    ("empty-client-id-no-clean", V311, connect(V311, flags=0x00, client_id=""), V311, CONNACK(2)),
    ("empty-client-id-clean", V311, connect(V311, client_id=""), V311, "accepted"),
    ("user-property-twice-allowed", V5,
     connect(V5, cprops=bytes((USER_PROPERTY,)) + s("a") + s("b") + bytes((USER_PROPERTY,)) + s("a") + s("c")),
     V5, "accepted"),
    # Not a CONNECT first: closed, never a CONNACK.
    ("first-packet-pingreq", V311, b"\xc0\x00", V311, CLOSE),
    ("first-packet-publish", V311, publish("a/b"), V311, CLOSE),
    ("first-packet-subscribe", V311, subscribe([("a", 0)]), V311, CLOSE),
    ("first-packet-disconnect", V311, b"\xe0\x00", V311, CLOSE),
    ("first-packet-connack", V311, b"\x20\x02\x00\x00", V311, CLOSE),
]


@pytest.mark.parametrize("version,data,decode_as,outcome",
                         [r[1:] for r in CONNECT_ROWS], ids=[r[0] for r in CONNECT_ROWS])
def test_connect_errors(broker, raw_client, version, data, decode_as, outcome):
    c = raw_client(broker.port, decode_as)
    c.send(data)
    if outcome == "accepted":
        pkt = recv(c)
        assert isinstance(pkt, Connack) and pkt.reason_code == 0, pkt
        c.send(PINGREQ)
        assert recv(c) == PINGRESP
    else:
        expect(c, outcome)
    assert_alive(broker.port)


# --- packets after a valid CONNECT -------------------------------------------

AFTER_ROWS = [
    # (A packet the decoder rejects is a row of packet_table.MALFORMED: test_malformed_packets.)
    # Second CONNECT: always a protocol error, whatever it contains.
    ("second-connect", V311, connect(V311, client_id="other"), CLOSE),
    ("second-connect-v5", V5, connect(V5, client_id="other"), DISCONNECT(0x82)),
    ("second-connect-v5-unsupported-level", V5, connect(6, client_id="other"), DISCONNECT(0x82)),
    ("second-connect-v5-as-311", V5, connect(V311, client_id="other"), DISCONNECT(0x82)),
    # Packets only a server sends.
    ("client-sends-connack-v5", V5, b"\x20\x03\x00\x00\x00", DISCONNECT(0x82)),
    ("client-sends-suback", V311, b"\x90\x03\x00\x01\x00", CLOSE),
    ("client-sends-pingresp-v5", V5, b"\xd0\x00", DISCONNECT(0x82)),
    # PUBLISH.
    ("publish-wildcard-plus", V311, publish("a/+"), CLOSE),
    ("publish-wildcard-hash", V311, publish("a/#", first=0x32, pid=1), CLOSE),
    ("publish-wildcard-plus-v5", V5, publish("a/+", version=V5), DISCONNECT(0x90)),
    ("publish-wildcard-hash-v5", V5, publish("#", first=0x32, pid=1, version=V5), DISCONNECT(0x90)),
    ("publish-wildcard-inside-level-v5", V5, publish("a/b+c", version=V5), DISCONNECT(0x90)),
    ("publish-empty-topic", V311, publish(""), CLOSE),
    ("publish-empty-topic-v5", V5, publish("", version=V5), DISCONNECT(0x82)),
    ("publish-empty-topic-with-user-property-v5", V5,
     publish("", pprops=bytes((USER_PROPERTY,)) + s("a") + s("b"), version=V5), DISCONNECT(0x82)),
    ("publish-topic-alias-0-v5", V5, publish("a/b", pprops=prop_u16(TOPIC_ALIAS, 0), version=V5),
     DISCONNECT(0x94)),
    ("publish-topic-alias-above-maximum-v5", V5,
     publish("a/b", pprops=prop_u16(TOPIC_ALIAS, 65), version=V5), DISCONNECT(0x94)),
    ("publish-topic-alias-65535-v5", V5,
     publish("a/b", pprops=prop_u16(TOPIC_ALIAS, 65535), version=V5), DISCONNECT(0x94)),
    ("publish-unknown-topic-alias-v5", V5, publish("", pprops=prop_u16(TOPIC_ALIAS, 3), version=V5),
     DISCONNECT(0x82)),
    ("publish-subscription-identifier-v5", V5,
     publish("a/b", pprops=bytes((SUB_ID, 1)), version=V5), DISCONNECT(0x82)),
    # SUBSCRIBE.
    ("shared-no-local-v5", V5, subscribe([("$share/g/a", 0x04)], version=V5), DISCONNECT(0x82)),
    # Invalid filters: answered in the SUBACK, the connection stays up.
    ("filter-hash-not-last", V311, subscribe([("a/#/b", 1)], pid=7), ANSWER(Suback(7, [0x80]))),
    ("filter-hash-not-last-v5", V5, subscribe([("a/#/b", 1)], pid=7, version=V5),
     ANSWER(Suback(7, [0x8F]))),
    ("filter-partial-plus", V311, subscribe([("a+", 0), ("a/+", 1)], pid=8), ANSWER(Suback(8, [0x80, 1]))),
    ("filter-partial-plus-v5", V5, subscribe([("a+", 0), ("a/+", 1)], pid=8, version=V5),
     ANSWER(Suback(8, [0x8F, 1]))),
    ("filter-partial-hash-v5", V5, subscribe([("a/b#", 2), ("#", 2)], pid=9, version=V5),
     ANSWER(Suback(9, [0x8F, 2]))),
    ("filter-empty", V311, subscribe([("", 0)], pid=10), ANSWER(Suback(10, [0x80]))),
    ("filter-empty-v5", V5, subscribe([("", 0)], pid=10, version=V5), ANSWER(Suback(10, [0x8F]))),
    ("filter-shared-without-filter-v5", V5, subscribe([("$share/g", 0), ("$share/g/", 0)], pid=11,
                                                       version=V5), ANSWER(Suback(11, [0x8F, 0x8F]))),
    ("filter-shared-wildcard-group-v5", V5, subscribe([("$share/g+/a", 0)], pid=12, version=V5),
     ANSWER(Suback(12, [0x8F]))),
    ("filter-shared-ok-v5", V5, subscribe([("$share/g/a/#", 1)], pid=13, version=V5),
     ANSWER(Suback(13, [1]))),
    # Acknowledgements for packet ids nobody used.
    ("pubrel-unknown-id-v5", V5, fixed(0x62, b"\x00\x2a"), ANSWER(Pubcomp(42, 0x92))),
    ("pubrel-unknown-id", V311, fixed(0x62, b"\x00\x2a"), ANSWER(Pubcomp(42))),
    ("pubrec-unknown-id-v5", V5, fixed(0x50, b"\x00\x2b"), ANSWER(Pubrel(43, 0x92))),
    ("pubrec-unknown-id", V311, fixed(0x50, b"\x00\x2b"), ANSWER(Pubrel(43))),
    # DISCONNECT.
    ("disconnect-session-expiry-after-0-v5", V5, fixed(0xE0, b"\x00" + props(prop_u32(SESSION_EXPIRY, 60))),
     DISCONNECT(0x82)),
    # AUTH with no enhanced authentication in progress.
    ("auth-without-method-v5", V5, b"\xf0\x00", DISCONNECT(0x82)),
]


@pytest.mark.parametrize("version,data,outcome", [r[1:] for r in AFTER_ROWS],
                         ids=[r[0] for r in AFTER_ROWS])
def test_errors_after_connect(broker, version, data, outcome):
    c = open_client(broker.port, version)
    try:
        c.send(data)
        expect(c, outcome)
    finally:
        c.close()
    assert_alive(broker.port)


# --- the packets the codec rejects --------------------------------------------

def answer(m):
    """What the broker tells a client that sent malformed packet `m` (packet_table.py):
    a CONNECT it refuses gets a CONNACK with the reason where the protocol version has a
    code for it; any other packet before a CONNECT only a close; after one, a 5.0 client
    gets a DISCONNECT with the reason, a 3.1.1 client a close."""
    if m.refused_version == V5:
        return CONNACK(m.reason)
    if m.refused_version is not None:
        rc = C.V5_TO_V311_CONNACK.get(m.reason)
        return CONNACK(rc) if rc is not None else CLOSE
    if m.first:
        return CLOSE
    return DISCONNECT(m.reason) if m.version == V5 else CLOSE


@pytest.mark.parametrize("m", MALFORMED, ids=[m.id for m in MALFORMED])
def test_malformed_packets(broker, raw_client, m):
    if m.first:
        c = raw_client(broker.port, m.refused_version or m.version)
    else:
        c = open_client(broker.port, m.version)
    try:
        c.send(m.wire)
        expect(c, answer(m))
    finally:
        c.close()
    assert_alive(broker.port)


# --- rows that need a configuration ----------------------------------------

CONFIG_ROWS = [
    ("packet-too-large", "[limits]\nmax_packet_size = 1024\n", V311,
     publish("big", b"x" * 2000), CLOSE),
    ("packet-too-large-v5", "[limits]\nmax_packet_size = 1024\n", V5,
     publish("big", b"x" * 2000, version=V5), DISCONNECT(0x95)),
    ("packet-too-large-header-only-v5", "[limits]\nmax_packet_size = 1024\n", V5,
     b"\x30" + encode_varint(100_000), DISCONNECT(0x95)),
    ("packet-just-fits-v5", "[limits]\nmax_packet_size = 1024\n", V5,
     # 1024 bytes in all: 1 + 2 (remaining length 1021) + 5 (topic) + 2 (id) + 1 (properties) + 1013
     publish("big", b"x" * 1013, first=0x32, pid=5, version=V5), ANSWER(Puback(5, 0x10))),
    ("topic-alias-disabled-v5", "[limits]\ntopic_alias_maximum = 0\n", V5,
     publish("a", pprops=prop_u16(TOPIC_ALIAS, 1), version=V5), DISCONNECT(0x94)),
    ("qos-above-maximum-v5", "[broker]\nmaximum_qos = 1\n", V5,
     publish("a", first=0x34, pid=1, version=V5), DISCONNECT(0x9B)),
    ("retain-not-supported-v5", "[broker]\nretain_available = false\n", V5,
     publish("a", first=0x31, version=V5), DISCONNECT(0x9A)),
    ("too-many-topic-levels-v5", "[limits]\nmax_topic_levels = 3\n", V5,
     publish("a/b/c/d", first=0x32, pid=1, version=V5), DISCONNECT(0x90)),
    ("too-many-topic-levels", "[limits]\nmax_topic_levels = 3\n", V311,
     publish("a/b/c/d", first=0x32, pid=1), CLOSE),
    ("too-many-filter-levels-v5", "[limits]\nmax_topic_levels = 3\n", V5,
     subscribe([("a/b/c/d", 0), ("a/b/c", 0)], pid=3, version=V5), ANSWER(Suback(3, [0x8F, 0]))),
    ("wildcard-subscriptions-off-v5", "[broker]\nwildcard_subscriptions = false\n", V5,
     subscribe([("a/#", 0), ("a/b", 0)], pid=3, version=V5), ANSWER(Suback(3, [0xA2, 0]))),
    ("shared-subscriptions-off-v5", "[broker]\nshared_subscriptions = false\n", V5,
     subscribe([("$share/g/a", 0)], pid=3, version=V5), ANSWER(Suback(3, [0x9E]))),
    ("shared-subscriptions-off", "[broker]\nshared_subscriptions = false\n", V311,
     subscribe([("$share/g/a", 0)], pid=3), ANSWER(Suback(3, [0x80]))),
]


@pytest.mark.parametrize("config,version,data,outcome", [r[1:] for r in CONFIG_ROWS],
                         ids=[r[0] for r in CONFIG_ROWS])
def test_errors_with_config(make_broker, config, version, data, outcome):
    b = make_broker(config)
    c = open_client(b.port, version)
    try:
        c.send(data)
        expect(c, outcome)
    finally:
        c.close()
    assert_alive(b.port)


def test_connect_over_max_packet_size_is_closed(make_broker, raw_client):
    b = make_broker("[limits]\nmax_packet_size = 128\n")
    c = raw_client(b.port, V5)
    c.send(connect(V5, client_id="x" * 200))
    pkt = recv(c)
    # Closing is enough; a CONNACK may only carry 0x95.
    assert pkt is None or (isinstance(pkt, Connack) and pkt.reason_code == 0x95), pkt
    if pkt is not None:
        assert recv(c) is None
    assert_alive(b.port)


def test_connack_advertises_max_packet_size(make_broker):
    b = make_broker("[limits]\nmax_packet_size = 1024\n")
    c = RawClient(b.port, V5)
    c.send(Connect("c", V5))
    ack = recv(c)
    assert ack.reason_code == 0
    assert ack.properties["maximum_packet_size"] == 1024
    c.close()


def test_receive_maximum_exceeded(make_broker):
    b = make_broker("[limits]\nreceive_maximum = 2\n")
    c = open_client(b.port, V5)
    for pid in (1, 2):
        c.send(publish("q2", first=0x34, pid=pid, version=V5))
        assert recv(c) == Pubrec(pid, 0x10)
    c.send(publish("q2", first=0x34, pid=3, version=V5))
    expect(c, DISCONNECT(0x93))
    assert_alive(b.port)


# --- QoS 2 and the will on a protocol error ------------------------------------

@pytest.mark.parametrize("version", [V311, V5])
def test_qos2_duplicate_publish_delivered_once(broker, version):
    sub = open_client(broker.port, V311, client_id="sub")
    sub.send(Subscribe(1, [SubscribeTopic("dup/t", 2)]))
    assert recv(sub) == Suback(1, [2])

    pub = open_client(broker.port, version, client_id="pub")
    pub.send(Publish("dup/t", b"once", qos=2, packet_id=9))
    assert recv(pub).packet_id == 9
    # Resent (DUP set, and once more without it) before PUBREL: acknowledged, not redelivered.
    pub.send(Publish("dup/t", b"once", qos=2, packet_id=9, dup=True))
    rec = recv(pub)
    assert isinstance(rec, Pubrec) and rec.packet_id == 9 and rec.reason_code < 0x80
    pub.send(Publish("dup/t", b"once", qos=2, packet_id=9))
    rec = recv(pub)
    assert isinstance(rec, Pubrec) and rec.packet_id == 9
    pub.send(Pubrel(9))
    assert recv(pub) == Pubcomp(9)

    got = recv(sub)
    assert isinstance(got, Publish) and got.payload == b"once" and got.qos == 2
    sub.send(Pubrec(got.packet_id))
    assert recv(sub) == Pubrel(got.packet_id)
    sub.send(Pubcomp(got.packet_id))
    # Nothing else arrives: the PINGRESP is the next packet.
    sub.send(PINGREQ)
    assert recv(sub) == PINGRESP

    # After PUBREL the id is free again: the same id carries a new message.
    pub.send(Publish("dup/t", b"twice", qos=2, packet_id=9))
    assert recv(pub).packet_id == 9
    pub.send(Pubrel(9))
    assert recv(pub) == Pubcomp(9)
    got = recv(sub)
    assert isinstance(got, Publish) and got.payload == b"twice"
    sub.close()
    pub.close()


def test_protocol_error_publishes_the_will(broker):
    watcher = open_client(broker.port, V311, client_id="watcher")
    watcher.send(Subscribe(1, [SubscribeTopic("will/#", 0)]))
    assert recv(watcher) == Suback(1, [0])

    c = open_client(broker.port, V5, client_id="dying", will=Will("will/dying", b"gone"))
    c.send(fixed(0xE0, b"\x00" + props(prop_u32(SESSION_EXPIRY, 60))))
    expect(c, DISCONNECT(0x82))
    msg = recv(watcher)
    assert isinstance(msg, Publish) and (msg.topic, msg.payload) == ("will/dying", b"gone")
    watcher.close()


def test_normal_disconnect_does_not_publish_the_will(broker):
    watcher = open_client(broker.port, V311, client_id="watcher")
    watcher.send(Subscribe(1, [SubscribeTopic("will/#", 0)]))
    assert recv(watcher) == Suback(1, [0])
    c = open_client(broker.port, V5, client_id="leaving", will=Will("will/leaving", b"gone"))
    c.send(Disconnect(0))
    assert recv(c) is None
    watcher.send(PINGREQ)
    assert recv(watcher) == PINGRESP
    watcher.close()


@pytest.mark.parametrize("sub_version", [V311, V5])
def test_topic_alias_roundtrip(broker, sub_version):
    """The valid counterpart of the alias rows: set an alias, then use it with an empty topic.
    The alias belongs to one hop: subscribers get the topic, not the publisher's alias."""
    sub = open_client(broker.port, sub_version, client_id="sub")
    sub.send(Subscribe(1, [SubscribeTopic("alias/#", 0)]))
    assert recv(sub) == Suback(1, [0])
    pub = open_client(broker.port, V5, client_id="pub")
    pub.send(publish("alias/t", b"one", pprops=prop_u16(TOPIC_ALIAS, 64), version=V5))
    pub.send(publish("", b"two", pprops=prop_u16(TOPIC_ALIAS, 64), version=V5))
    # Rebinding an alias to another topic is allowed.
    pub.send(publish("alias/u", b"three", pprops=prop_u16(TOPIC_ALIAS, 64), version=V5))
    pub.send(publish("", b"four", first=0x32, pid=1, pprops=prop_u16(TOPIC_ALIAS, 64), version=V5))
    assert recv(pub) == Puback(1)
    got = [recv(sub) for _ in range(4)]
    assert [(m.topic, m.payload) for m in got] == [
        ("alias/t", b"one"), ("alias/t", b"two"), ("alias/u", b"three"), ("alias/u", b"four")]
    for m in got:
        assert "topic_alias" not in m.properties, show(m)
    sub.close()
    pub.close()


@pytest.mark.parametrize("version,old_outcome", [(V5, DISCONNECT(0x8E)), (V311, CLOSE)])
def test_session_takeover(broker, version, old_outcome):
    old = open_client(broker.port, version, client_id="same")
    new = open_client(broker.port, version, client_id="same")
    expect(old, old_outcome)
    new.send(PINGREQ)
    assert recv(new) == PINGRESP
    new.close()


@pytest.mark.parametrize("config,will,version,outcome", [
    ("[broker]\nmaximum_qos = 1\n", Will("w", b"", qos=2), V5, CONNACK(0x9B)),
    ("[broker]\nmaximum_qos = 1\n", Will("w", b"", qos=2), V311, CLOSE),
    ("[broker]\nretain_available = false\n", Will("w", b"", retain=True), V5, CONNACK(0x9A)),
    ("[broker]\nretain_available = false\n", Will("w", b"", retain=True), V311, CLOSE),
], ids=["will-qos-v5", "will-qos", "will-retain-v5", "will-retain"])
def test_will_beyond_broker_capabilities(make_broker, raw_client, config, will, version, outcome):
    b = make_broker(config)
    c = raw_client(b.port, version)
    c.send(Connect("w", version, will=will))
    expect(c, outcome)
    assert_alive(b.port)


def test_outgoing_topic_aliases(broker):
    """Towards a client that allows 2 aliases: first use sets one, later uses send only the alias.

    (Not an interop test: libmosquitto 2.0.11 cannot resolve aliases a broker sends.)
    """
    sub = open_client(broker.port, V5, client_id="sub", properties={"topic_alias_maximum": 2})
    sub.send(Subscribe(1, [SubscribeTopic("al/#", 0)]))
    assert recv(sub) == Suback(1, [0])
    pub = open_client(broker.port, V311, client_id="pub")
    topics = ["al/a", "al/b", "al/c", "al/a", "al/b", "al/c"]
    for i, topic in enumerate(topics):
        pub.send(Publish(topic, str(i).encode()))
    got = [recv(sub) for _ in topics]
    aliases = {}
    for i, (topic, p) in enumerate(zip(topics, got)):
        alias = p.properties.get("topic_alias")
        assert p.payload == str(i).encode()
        assert alias is None or 1 <= alias <= 2, show(p)
        if p.topic:
            assert p.topic == topic
            if alias is not None:
                aliases[alias] = topic
        else:
            assert alias is not None and aliases.get(alias) == topic, show(p)
    assert sum(1 for p in got if not p.topic) >= 2  # a and b went by alias the second time
    sub.close()
    pub.close()


@pytest.mark.parametrize("version", [V311, V5])
@pytest.mark.parametrize("hooks", ["none", "async"])
def test_packets_pipelined_behind_connect(make_broker, version, hooks):
    """CONNECT, SUBSCRIBE, PUBLISH, PINGREQ and half a PUBLISH in one write: all handled, in order."""
    b = make_broker(hooks=[AsyncAuth()] if hooks == "async" else [])
    c = RawClient(b.port, version)
    tail = encode(Publish("pipe/t", b"second", qos=1, packet_id=2), version)
    c.send(encode(Connect("pipe", version, username="u", password=b"secret"), version)
           + encode(Subscribe(1, [SubscribeTopic("pipe/#", 1)]), version)
           + encode(Publish("pipe/t", b"first", qos=1, packet_id=1), version)
           + encode(PINGREQ, version)
           + tail[:4])
    got = [recv(c) for _ in range(5)]
    assert isinstance(got[0], Connack) and got[0].reason_code == 0
    assert got[1] == Suback(1, [1])
    kinds = sorted(type(p).__name__ for p in got[2:])
    assert kinds == ["Pingresp", "Puback", "Publish"], [show(p) for p in got]
    delivered = next(p for p in got if isinstance(p, Publish))
    assert delivered.payload == b"first"
    c.send(tail[4:])  # completes the half PUBLISH
    c.send(Puback(delivered.packet_id))
    got = [recv(c) for _ in range(2)]
    assert sorted(type(p).__name__ for p in got) == ["Puback", "Publish"], [show(p) for p in got]
    c.close()


MALFORMED_PUBLISH = bytes.fromhex("36050001610001")  # a PUBLISH with QoS 3


@pytest.mark.parametrize("storage", ["memory", "disk"])
@pytest.mark.parametrize("qos", [0, 1])
@pytest.mark.parametrize("version", [V311, V5])
@pytest.mark.parametrize("connack_first", [False, True], ids=["one-write", "after-connack"])
def test_valid_packets_before_a_malformed_one_are_handled(make_broker, tmp_path, storage, qos,
                                                          version, connack_first):
    """CONNECT, ten PUBLISHes and a malformed packet in one TCP write (or the ten and the bad
    one after the CONNACK): CONNACK, ten PUBACKs and ten deliveries, in order, then the
    close (5.0: DISCONNECT 0x81), as Mosquitto does. With the log on disk the PUBACKs wait
    for the fsync, and the close waits for them."""
    b = make_broker(f'[storage]\nmode = "disk"\ndata_dir = "{tmp_path}"\n' if storage == "disk" else "")
    sub = open_client(b.port, V311, client_id="counter")
    sub.send(Subscribe(1, [SubscribeTopic("ten/#", 1)]))
    assert recv(sub) == Suback(1, [1])
    ten = b"".join(publish(f"ten/{i}", b"m%d" % i, first=0x30 | qos << 1, pid=i + 1 if qos else None,
                           version=version) for i in range(10))
    c = RawClient(b.port, version)
    hello = encode(Connect("ten", version), version)
    if connack_first:
        c.send(hello)
        hello = b""
        assert recv(c).reason_code == 0
    c.send(hello + ten + MALFORMED_PUBLISH)
    if not connack_first:
        ack = recv(c)
        assert isinstance(ack, Connack) and ack.reason_code == 0, show(ack)
    if qos:
        for pid in range(1, 11):
            pkt = recv(c)
            assert isinstance(pkt, Puback) and pkt.packet_id == pid and not pkt.reason_code, show(pkt)
    expect(c, DISCONNECT(C.MALFORMED_PACKET) if version == V5 else CLOSE)
    got = [recv(sub) for _ in range(10)]
    assert [(p.topic, p.payload) for p in got] == [(f"ten/{i}", b"m%d" % i) for i in range(10)]
    sub.close()


@pytest.mark.parametrize("limit", ["publish_rate = 100", "publish_byte_rate = 50"])
def test_valid_packets_before_a_malformed_one_under_a_rate_limit(make_broker, limit):
    """Under a rate limit the ten go through the client's buckets like any others (all in
    the burst; or a few, then the rest over about two seconds), and the close for the
    malformed packet comes after them."""
    b = make_broker(f"[limits]\n{limit}\n")
    sub = open_client(b.port, V5, client_id="counter")
    sub.send(Subscribe(1, [SubscribeTopic("ten/#", 0)]))
    assert recv(sub) == Suback(1, [0])
    c = open_client(b.port, V5, client_id="metered")
    c.send(b"".join(publish(f"ten/{i}", first=0x32, pid=i + 1, version=V5) for i in range(10))
           + MALFORMED_PUBLISH)
    for pid in range(1, 11):
        pkt = recv(c)
        assert isinstance(pkt, Puback) and pkt.packet_id == pid, show(pkt)
    expect(c, DISCONNECT(C.MALFORMED_PACKET))
    assert [recv(sub).topic for _ in range(10)] == [f"ten/{i}" for i in range(10)]
    sub.close()


# --- timeouts and stalled clients -----------------------------------------------

def test_silent_client_closed_after_connect_timeout(make_broker, raw_client):
    b = make_broker("[limits]\nconnect_timeout = 0.5\n")
    c = raw_client(b.port)
    t0 = time.monotonic()
    assert recv(c, timeout=3) is None
    assert 0.3 < time.monotonic() - t0 < 2.0
    assert_alive(b.port)


def test_half_connect_closed_after_connect_timeout(make_broker, raw_client):
    b = make_broker("[limits]\nconnect_timeout = 0.5\n")
    c = raw_client(b.port)
    c.send(connect(V311)[:7])
    t0 = time.monotonic()
    assert recv(c, timeout=3) is None
    assert time.monotonic() - t0 < 2.0


def test_http_request_closed(make_broker, raw_client):
    """'GE' reads as a PUBACK header announcing 69 bytes: at worst the connect timeout ends it."""
    b = make_broker("[limits]\nconnect_timeout = 0.5\n")
    c = raw_client(b.port)
    c.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert recv(c, timeout=3) is None
    assert_alive(b.port)


def test_connected_client_not_subject_to_connect_timeout(make_broker):
    b = make_broker("[limits]\nconnect_timeout = 0.5\n")
    c = open_client(b.port, V5)
    time.sleep(0.8)
    c.send(PINGREQ)
    assert recv(c) == PINGRESP
    c.close()


def test_half_packet_does_not_block_others(broker):
    staller = open_client(broker.port, V5, client_id="staller")
    full = publish("half/t", b"from-staller", version=V5)
    staller.send(full[:5])  # then nothing for a while

    sub = open_client(broker.port, V5, client_id="sub")
    sub.send(Subscribe(1, [SubscribeTopic("half/#", 0)]))
    assert recv(sub) == Suback(1, [0])
    other = open_client(broker.port, V311, client_id="other")
    other.send(Publish("half/t", b"from-other"))
    got = recv(sub)
    assert (got.topic, got.payload) == ("half/t", b"from-other")
    assert_alive(broker.port)

    # The stalled client is still there and its packet completes fine.
    staller.send(full[5:])
    got = recv(sub)
    assert (got.topic, got.payload) == ("half/t", b"from-staller")
    staller.send(PINGREQ)
    assert recv(staller) == PINGRESP
    for x in (staller, sub, other):
        x.close()


def test_half_connect_does_not_block_others(broker, raw_client):
    staller = raw_client(broker.port)
    staller.send(connect(V311)[:6])
    assert_alive(broker.port)
    staller.send(connect(V311)[6:])
    assert recv(staller).reason_code == 0


def test_keepalive_timeout_v5(broker):
    c = open_client(broker.port, V5, keepalive=1)
    t0 = time.monotonic()
    expect(c, DISCONNECT(0x8D))
    assert 1.0 < time.monotonic() - t0 < 3.0


# --- authentication ------------------------------------------------------------

class DemoAuth(Hook):
    """Two-step challenge: 'challenge' out, 'response' back."""

    auth_methods = {"demo"}

    def __init__(self):
        self.steps = []

    def enhanced_auth(self, client, method, data, step):
        self.steps.append((client.client_id, method, data, step))
        if step == 0:
            return (C.CONTINUE_AUTHENTICATION, b"challenge")
        if data == b"response":
            return (0, None)
        return (C.NOT_AUTHORIZED, None)


def _auth_connect(method="demo", data=None, client_id="ea"):
    p = {"authentication_method": method}
    if data is not None:
        p["authentication_data"] = data
    return Connect(client_id, V5, properties=p)


def test_enhanced_auth_unknown_method(broker, raw_client):
    c = raw_client(broker.port, V5)
    c.send(_auth_connect("SCRAM-SHA-1"))
    expect(c, CONNACK(0x8C))
    assert_alive(broker.port)


def test_enhanced_auth_unknown_method_with_other_hook(make_broker, raw_client):
    b = make_broker(hooks=[DemoAuth()])
    c = raw_client(b.port, V5)
    c.send(_auth_connect("SCRAM-SHA-1"))
    expect(c, CONNACK(0x8C))


def test_enhanced_auth_two_steps(make_broker, raw_client):
    hook = DemoAuth()
    b = make_broker(hooks=[hook])
    c = raw_client(b.port, V5)
    c.send(_auth_connect("demo", b"hello"))
    challenge = recv(c)
    assert challenge == Auth(0x18, {"authentication_method": "demo", "authentication_data": b"challenge"})
    c.send(Auth(0x18, {"authentication_method": "demo", "authentication_data": b"response"}))
    ack = recv(c)
    assert isinstance(ack, Connack) and ack.reason_code == 0, ack
    assert ack.properties.get("authentication_method") == "demo"
    assert [s[1:] for s in hook.steps] == [("demo", b"hello", 0), ("demo", b"response", 1)]
    c.send(PINGREQ)
    assert recv(c) == PINGRESP
    # The connection is a normal one now.
    c.send(Subscribe(1, [SubscribeTopic("ea/t", 1)]))
    assert recv(c) == Suback(1, [1])


@pytest.mark.parametrize("data,outcome", [
    (b"response", ANSWER(Auth(0, {"authentication_method": "demo"}))),
    (b"wrong", DISCONNECT(0x87)),
], ids=["accepted", "refused"])
def test_enhanced_reauthentication(make_broker, raw_client, data, outcome):
    b = make_broker(hooks=[DemoAuth()])
    c = raw_client(b.port, V5)
    c.send(_auth_connect("demo"))
    assert recv(c).TYPE == C.AUTH
    c.send(Auth(0x18, {"authentication_method": "demo", "authentication_data": b"response"}))
    assert recv(c).reason_code == 0
    c.send(Auth(0x19, {"authentication_method": "demo", "authentication_data": data}))
    expect(c, outcome)


def test_enhanced_auth_wrong_response(make_broker, raw_client):
    b = make_broker(hooks=[DemoAuth()])
    c = raw_client(b.port, V5)
    c.send(_auth_connect("demo"))
    assert recv(c).TYPE == C.AUTH
    c.send(Auth(0x18, {"authentication_method": "demo", "authentication_data": b"wrong"}))
    expect(c, CONNACK(0x87))
    assert_alive(b.port)


@pytest.mark.parametrize("data,outcome", [
    (encode(Auth(0x18, {"authentication_method": "other", "authentication_data": b"response"}), V5),
     CONNACK(0x82)),
    (encode(Publish("a", b"x"), V5), CONNACK(0x82)),
    (b"\xf0\x01\x05", CONNACK(0x81)),
], ids=["different-method", "publish-during-auth", "malformed-auth"])
def test_enhanced_auth_protocol_errors(make_broker, raw_client, data, outcome):
    b = make_broker(hooks=[DemoAuth()])
    c = raw_client(b.port, V5)
    c.send(_auth_connect("demo"))
    assert recv(c).TYPE == C.AUTH
    c.send(data)
    expect(c, outcome)
    assert_alive(b.port)


def test_enhanced_auth_stalled_client_closed_after_connect_timeout(make_broker, raw_client):
    """A client that starts enhanced auth and never answers must not hold the connection forever."""
    b = make_broker("[limits]\nconnect_timeout = 0.5\n", hooks=[DemoAuth()])
    c = raw_client(b.port, V5)
    c.send(_auth_connect("demo"))
    assert recv(c).TYPE == C.AUTH
    try:
        pkt = c.recv(timeout=3)
    except TimeoutError:
        pytest.fail("connection still open 3 s after an unanswered AUTH challenge "
                    "(connect_timeout = 0.5)")
    assert pkt is None or (isinstance(pkt, Connack) and pkt.reason_code >= 0x80), pkt


class DenyMallory(Hook):
    def authenticate(self, client, connect):
        if connect.username == "mallory":
            return False
        return True


@pytest.mark.parametrize("version,username,outcome", [
    (V5, "mallory", CONNACK(0x86)),
    (V311, "mallory", CONNACK(4)),
    (V5, "alice", "accepted"),
    (V311, "alice", "accepted"),
])
def test_authenticate_hook_refuses_user(make_broker, raw_client, version, username, outcome):
    b = make_broker(hooks=[DenyMallory()])
    c = raw_client(b.port, version)
    c.send(Connect("u", version, username=username, password=b"pw"))
    if outcome == "accepted":
        assert recv(c).reason_code == 0
    else:
        expect(c, outcome)


@pytest.mark.parametrize("version,outcome", [(V5, CONNACK(0x87)), (V311, CONNACK(5))])
def test_anonymous_refused(make_broker, raw_client, version, outcome):
    b = make_broker("[auth]\nallow_anonymous = false\n")
    c = raw_client(b.port, version)
    c.send(Connect("anon", version))
    expect(c, outcome)
    # The broker is fine; anonymous clients just cannot get in.
    c2 = raw_client(b.port, version)
    c2.send(Connect("anon2", version))
    assert recv(c2).reason_code != 0


class AsyncAuth(Hook):
    async def authenticate(self, client, connect):
        return connect.password == b"secret"


@pytest.mark.parametrize("password,rc", [(b"secret", 0), (b"nope", 0x86)])
def test_async_authenticate_hook(make_broker, raw_client, password, rc):
    b = make_broker(hooks=[AsyncAuth()])
    c = raw_client(b.port, V5)
    c.send(Connect("u", V5, username="u", password=password))
    # Packets pipelined behind the CONNECT wait for the verdict.
    c.send(PINGREQ)
    if rc == 0:
        assert recv(c).reason_code == 0
        assert recv(c) == PINGRESP
    else:
        expect(c, CONNACK(rc))


def test_will_topic_with_too_many_levels_refused(make_broker, raw_client):
    """The same limit as PUBLISH topics (test_errors_with_config[too-many-topic-levels*])."""
    b = make_broker("[limits]\nmax_topic_levels = 3\n")
    c = raw_client(b.port, V5)
    c.send(Connect("w", V5, will=Will("a/b/c/d", b"x")))
    expect(c, CONNACK(0x90))


class Broken(Hook):
    """Fails for the client id "h" only, so the broker can still be checked with others."""

    auth_methods = {"broken"}

    def authenticate(self, client, connect):
        if connect.client_id == "h":
            raise RuntimeError("auth backend down")
        return None

    def enhanced_auth(self, client, method, data, step):
        raise RuntimeError("auth backend down")


class BrokenAsync(Hook):
    async def authenticate(self, client, connect):
        if connect.client_id == "h":
            raise RuntimeError("auth backend down")
        return None


@pytest.mark.parametrize("hook,props", [
    (Broken(), {}),
    (BrokenAsync(), {}),
    (Broken(), {"authentication_method": "broken"}),
], ids=["authenticate", "authenticate-async", "enhanced-auth"])
def test_failing_auth_hook_refuses_with_0x80(make_broker, raw_client, hook, props):
    """A hook that raises refuses the client (0x80 Unspecified error), it does not kill anything."""
    b = make_broker(hooks=[hook])
    c = raw_client(b.port, V5)
    c.send(Connect("h", V5, properties=props))
    expect(c, CONNACK(0x80))
    assert_alive(b.port)
