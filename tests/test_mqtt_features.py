"""MQTT features end to end: real paho-mqtt clients (and raw sockets) against a real broker.

Sessions, wills, takeover and redelivery live in test_sessions.py.
"""

import asyncio
import re
import socket
import time

import pytest

from conftest import get_messages, no_message
from mqtt_helpers import (clean_disconnect, connack_rc, drain, kill, persistent, pprops, publish,
                          raw_connect, raw_subscribe, rc_int, session_present, sub, uid, unsub,
                          wait_for)
from wrenmq import Broker
from wrenmq.config import load
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.codec import Decoder, encode
from wrenmq.mqtt.packets import (Connect, Pingreq, Publish, Pubrel, Subscribe,
                                 SubscribeTopic)

VERSIONS = pytest.mark.parametrize("version", [4, 5])


# --- QoS -------------------------------------------------------------------------


@pytest.mark.parametrize("sub_version,pub_version", [(4, 4), (5, 5), (4, 5), (5, 4)])
def test_qos_delivered_at_min_of_publish_and_subscription(broker, clients, sub_version, pub_version):
    subs = {}
    for sq in (0, 1, 2):
        c = clients(broker.port, version=sub_version)
        assert sub(c, f"qos/{sq}/#", sq) == [sq]
        subs[sq] = c
    pub = clients(broker.port, version=pub_version)
    for pq in (0, 1, 2):
        for sq in (0, 1, 2):
            publish(pub, f"qos/{sq}/{pq}", f"{pq}>{sq}".encode(), pq)
    for sq, c in subs.items():
        got = sorted((m.topic, m.payload, m.qos) for m in get_messages(c, 3))
        assert got == [(f"qos/{sq}/{pq}", f"{pq}>{sq}".encode(), min(pq, sq)) for pq in range(3)]
        no_message(c, 0.2)


@pytest.mark.parametrize("sub_version,pub_version", [(4, 4), (5, 5), (4, 5), (5, 4)])
def test_qos2_to_qos2_subscriber_arrives_exactly_once(broker, clients, sub_version, pub_version):
    s = clients(broker.port, version=sub_version)
    assert sub(s, "q2/t", 2) == [2]
    p = clients(broker.port, version=pub_version)
    for i in range(20):
        publish(p, "q2/t", b"%d" % i, 2)
    got = get_messages(s, 20)
    assert [m.payload for m in got] == [b"%d" % i for i in range(20)]
    assert all(m.qos == 2 and not m.dup for m in got)
    no_message(s, 0.3)


@VERSIONS
def test_qos2_resent_publish_is_delivered_once(broker, clients, raw_client, version):
    """A QoS 2 PUBLISH resent with DUP before PUBREL must not be delivered twice."""
    s = clients(broker.port, version=5)
    sub(s, "q2dup/t", 2)
    c, ack = raw_connect(raw_client, broker.port, version)
    assert ack.reason_code == 0
    c.send(Publish("q2dup/t", b"once", qos=2, packet_id=7))
    assert c.recv().TYPE == C.PUBREC
    c.send(Publish("q2dup/t", b"once", qos=2, dup=True, packet_id=7))
    assert c.recv().TYPE == C.PUBREC
    c.send(Pubrel(7))
    comp = c.recv()
    assert comp.TYPE == C.PUBCOMP and comp.packet_id == 7 and comp.reason_code == 0
    [m] = get_messages(s, 1)
    assert (m.payload, m.qos) == (b"once", 2)
    no_message(s, 0.3)


# --- retained messages ---------------------------------------------------------------


@VERSIONS
def test_retained_set_replace_clear(broker, clients, version):
    pub = clients(broker.port, version=version)
    publish(pub, "ret/a", b"one", 1, retain=True)

    s1 = clients(broker.port, version=version)
    sub(s1, "ret/#", 1)
    [m] = get_messages(s1, 1)
    assert (m.topic, m.payload, m.qos, m.retain) == ("ret/a", b"one", 1, True)

    publish(pub, "ret/a", b"two", 1, retain=True)  # replace
    [m] = get_messages(s1, 1)
    assert (m.payload, m.retain) == (b"two", False), "live delivery must have retain 0"

    s2 = clients(broker.port, version=version)
    sub(s2, "ret/#", 1)
    [m] = get_messages(s2, 1)
    assert (m.payload, m.retain) == (b"two", True)
    no_message(s2, 0.2)

    publish(pub, "ret/a", b"", 1, retain=True)  # clear
    [m] = get_messages(s1, 1)
    assert (m.payload, m.retain) == (b"", False)
    s3 = clients(broker.port, version=version)
    sub(s3, "ret/#", 1)
    no_message(s3, 0.3)


@VERSIONS
@pytest.mark.parametrize("qos", [0, 1])
def test_normal_delivery_has_retain_0(broker, clients, version, qos):
    s = clients(broker.port, version=version)
    sub(s, "rn/t", qos)
    p = clients(broker.port, version=version)
    publish(p, "rn/t", b"r", qos, retain=True)
    publish(p, "rn/t", b"n", qos, retain=False)
    got = get_messages(s, 2)
    assert [(m.payload, m.retain) for m in got] == [(b"r", False), (b"n", False)]


@pytest.mark.parametrize("rh,first,again", [(0, True, True), (1, True, False), (2, False, False)])
def test_retain_handling(broker, clients, rh, first, again):
    p = clients(broker.port)
    publish(p, "rh/x", b"kept", 1, retain=True)
    s = clients(broker.port)
    sub(s, "rh/#", 1, rh=rh)
    got = get_messages(s, 1, timeout=0.5 if not first else 5)
    assert bool(got) is first
    if got:
        assert (got[0].payload, got[0].retain) == (b"kept", True)
    sub(s, "rh/#", 1, rh=rh)  # re-subscribe: the subscription exists now
    got = get_messages(s, 1, timeout=0.5 if not again else 5)
    assert bool(got) is again
    no_message(s, 0.1)


def test_retain_as_published(broker, clients):
    rap = clients(broker.port)
    sub(rap, "rap/t", 1, rap=True)
    plain = clients(broker.port)
    sub(plain, "rap/t", 1, rap=False)
    p = clients(broker.port)
    publish(p, "rap/t", b"r", 1, retain=True)
    publish(p, "rap/t", b"n", 1)
    assert [(m.payload, m.retain) for m in get_messages(rap, 2)] == [(b"r", True), (b"n", False)]
    assert [(m.payload, m.retain) for m in get_messages(plain, 2)] == [(b"r", False), (b"n", False)]


@VERSIONS
def test_retained_matched_by_wildcard_filters(broker, clients, version):
    p = clients(broker.port, version=version)
    for t in ("rw", "rw/a", "rw/a/b", "rw/x/b", "rw/x/c/b", "other/a"):
        publish(p, t, t.encode(), 1, retain=True)
    cases = {"rw/#": {"rw", "rw/a", "rw/a/b", "rw/x/b", "rw/x/c/b"},
             "rw/+/b": {"rw/a/b", "rw/x/b"},
             "+/a": {"rw/a", "other/a"},
             "rw/a": {"rw/a"}}
    for flt, want in cases.items():
        s = clients(broker.port, version=version)
        sub(s, flt, 1)
        got = get_messages(s, len(want))
        assert {m.topic for m in got} == want, flt
        assert all(m.retain and m.payload == m.topic.encode() for m in got)
        no_message(s, 0.1)


def test_retained_message_expires(broker, clients):
    p = clients(broker.port)
    publish(p, "rx/short", b"s", 1, retain=True, properties=pprops(MessageExpiryInterval=1))
    publish(p, "rx/long", b"l", 1, retain=True, properties=pprops(MessageExpiryInterval=60))
    time.sleep(1.3)
    s = clients(broker.port)
    sub(s, "rx/#", 1)
    [m] = get_messages(s, 1)
    assert m.payload == b"l" and 55 <= m.properties.MessageExpiryInterval <= 59
    no_message(s, 0.3)


# --- wildcards and $SYS ------------------------------------------------------------


@VERSIONS
def test_wildcards(broker, clients, version):
    plus = clients(broker.port, version=version)
    sub(plus, "w/+/c", 1)
    hash_ = clients(broker.port, version=version)
    sub(hash_, "w/#", 1)
    mixed = clients(broker.port, version=version)
    sub(mixed, "+/b/#", 1)
    every = clients(broker.port, version=version)
    sub(every, "#", 1)
    p = clients(broker.port, version=version)
    topics = ["w/b/c", "w/b/d", "w/b/c/d", "w", "w//c", "x/b/c", "x/b", "wx/b/c"]
    for t in topics:
        publish(p, t, t.encode(), 1)
    assert [m.topic for m in get_messages(plus, 2)] == ["w/b/c", "w//c"]
    assert [m.topic for m in get_messages(hash_, 5)] == ["w/b/c", "w/b/d", "w/b/c/d", "w", "w//c"]
    assert [m.topic for m in get_messages(mixed, 6)] == ["w/b/c", "w/b/d", "w/b/c/d", "x/b/c", "x/b", "wx/b/c"]
    assert [m.topic for m in get_messages(every, len(topics))] == topics
    for c in (plus, hash_, mixed, every):
        no_message(c, 0.1)


@VERSIONS
def test_leading_wildcards_do_not_match_sys(make_broker, clients, version):
    b = make_broker("[sys]\ninterval = 0.2\n")
    c = clients(b.port, version=version)
    for flt in ("#", "+/broker/version", "+/broker/#", "+/+/+"):
        sub(c, flt, 0)
    time.sleep(0.6)  # three $SYS rounds
    p = clients(b.port, version=version)
    publish(p, "plain/t/x", b"x", 1)
    wait_for(lambda: not c.messages.empty(), 2)
    topics = [m.topic for m in drain(c, 0.2)]
    assert "plain/t/x" in topics
    assert not [t for t in topics if t.startswith("$")], topics


@VERSIONS
def test_sys_topics(make_broker, clients, version):
    b = make_broker("[sys]\ninterval = 0.2\n")
    c = clients(b.port, version=version)
    sub(c, "$SYS/#", 0)
    p = clients(b.port, version=version)
    for i in range(5):
        publish(p, "sys/x", b"%d" % i, 1)
    seen = {}

    def collect():
        for m in drain(c):
            seen[m.topic] = m.payload.decode()
        return int(seen.get("$SYS/broker/messages/received", "0")) >= 5 and \
            int(seen.get("$SYS/broker/clients/connected", "0")) >= 2

    assert wait_for(collect, 5), seen
    assert seen["$SYS/broker/version"].startswith("wrenmq version ")
    assert re.fullmatch(r"\d+ seconds", seen["$SYS/broker/uptime"])
    for t in ("clients/total", "clients/maximum", "messages/sent", "bytes/received",
              "bytes/sent", "subscriptions/count", "publish/messages/received"):
        assert int(seen[f"$SYS/broker/{t}"]) >= 0, t
    assert int(seen["$SYS/broker/subscriptions/count"]) >= 1


@VERSIONS
def test_clients_cannot_publish_into_sys(make_broker, clients, version):
    b = make_broker("[sys]\ninterval = 0.2\n")
    watch = clients(b.port)
    sub(watch, "$SYS/test/#", 1)
    p = clients(b.port, version=version)
    info = p.publish("$SYS/test/x", b"forged", 1)
    info.wait_for_publish(5)
    info2 = p.publish("$SYS/broker/version", b"forged", 1, retain=True)
    info2.wait_for_publish(5)
    acks = {}
    while len(acks) < 2:
        kind, mid, rc, _ = p.acks.get(timeout=5)
        if kind == "puback":
            acks[mid] = rc_int(rc)
    if version == 5:
        assert acks == {info.mid: C.NOT_AUTHORIZED, info2.mid: C.NOT_AUTHORIZED}
    no_message(watch, 0.4)
    late = clients(b.port)
    sub(late, "$SYS/broker/version", 0)
    [m] = get_messages(late, 1)
    assert m.payload.startswith(b"wrenmq version")
    assert all(m.payload != b"forged" for m in drain(late, 0.5))
    publish(p, "after/sys", b"ok", 1)  # still connected


# --- overlapping subscriptions ----------------------------------------------------------


def test_overlapping_subscriptions_v311_one_copy_highest_qos(broker, clients):
    c = clients(broker.port, version=4)
    sub(c, "ov/#", 0)
    sub(c, "ov/+", 2)
    sub(c, "ov/t", 1)
    p = clients(broker.port, version=4)
    # One message at a time: paho hands a QoS 2 message over only at PUBREL, so a QoS 1
    # message sent right after can reach the application first.
    publish(p, "ov/t", b"q2", 2)
    [m] = get_messages(c, 1)
    assert (m.payload, m.qos) == (b"q2", 2)
    publish(p, "ov/t", b"q1", 1)
    [m] = get_messages(c, 1)
    assert (m.payload, m.qos) == (b"q1", 1)
    no_message(c, 0.3)


def test_overlapping_subscriptions_v5_one_copy_with_all_identifiers(broker, clients):
    c = clients(broker.port)
    sub(c, "ov/#", 0, sub_id=1)
    sub(c, "ov/+", 2, sub_id=2)
    sub(c, "ov/t", 1)  # no identifier
    p = clients(broker.port)
    publish(p, "ov/t", b"x", 2)
    [m] = get_messages(c, 1)
    assert m.qos == 2
    assert sorted(m.properties.SubscriptionIdentifier) == [1, 2]
    no_message(c, 0.3)


# --- 5.0 subscription options ------------------------------------------------------


def test_no_local(broker, clients):
    me = clients(broker.port)
    sub(me, "nl/t", 1, no_local=True)
    other = clients(broker.port)
    sub(other, "nl/t", 1)
    publish(me, "nl/t", b"mine", 1)
    [m] = get_messages(other, 1)
    assert m.payload == b"mine"
    no_message(me, 0.3)
    publish(other, "nl/t", b"theirs", 1)
    [m] = get_messages(me, 1)
    assert m.payload == b"theirs"


def test_subscription_identifiers(broker, clients):
    p = clients(broker.port)
    publish(p, "si/r", b"retained", 1, retain=True)
    c = clients(broker.port)
    sub(c, "si/#", 1, sub_id=7)
    [m] = get_messages(c, 1)
    assert (m.payload, m.properties.SubscriptionIdentifier) == (b"retained", [7])
    for q in (0, 1):
        publish(p, "si/x", b"live%d" % q, q)
        [m] = get_messages(c, 1)
        assert (m.payload, m.properties.SubscriptionIdentifier) == (b"live%d" % q, [7])
    sub(c, "si/#", 1, rh=2)  # replaced without an identifier
    publish(p, "si/x", b"noid", 1)
    [m] = get_messages(c, 1)
    assert m.payload == b"noid"
    assert not hasattr(m.properties, "SubscriptionIdentifier")
    big = clients(broker.port)
    sub(big, "si/#", 0, sub_id=268435455, rh=2)
    publish(p, "si/x", b"max", 0)
    [m] = get_messages(big, 1)
    assert m.properties.SubscriptionIdentifier == [268435455]


@VERSIONS
def test_unsubscribe_stops_delivery(broker, clients, version):
    c = clients(broker.port, version=version)
    sub(c, "un/t", 1)
    sub(c, "un/other", 1)
    p = clients(broker.port, version=version)
    publish(p, "un/t", b"1", 1)
    assert [m.payload for m in get_messages(c, 1)] == [b"1"]
    rcs = unsub(c, "un/t")
    if version == 5:
        assert rcs == [0]
    publish(p, "un/t", b"2", 1)
    publish(p, "un/other", b"3", 1)
    assert [m.topic for m in get_messages(c, 1)] == ["un/other"]
    no_message(c, 0.3)
    if version == 5:
        assert unsub(c, "never/subscribed") == [C.NO_SUBSCRIPTION_EXISTED]


# --- shared subscriptions ------------------------------------------------------------


@VERSIONS
def test_shared_subscription_one_member_each_round_robin(broker, clients, version):
    members = [clients(broker.port, version=version) for _ in range(3)]
    for m in members:
        assert sub(m, "$share/g/sh/t", 1) == [1]
    p = clients(broker.port, version=version)
    for i in range(30):
        publish(p, "sh/t", b"%d" % i, 1)
    assert wait_for(lambda: sum(m.messages.qsize() for m in members) >= 30, 5)
    time.sleep(0.2)
    got = [[x.payload for x in drain(m)] for m in members]
    flat = [x for g in got for x in g]
    assert sorted(flat) == sorted(b"%d" % i for i in range(30)), "each message exactly once"
    counts = [len(g) for g in got]
    assert max(counts) - min(counts) <= 1, counts
    publish(p, "sh/t", b"topic", 0)
    assert wait_for(lambda: any(not m.messages.empty() for m in members), 3)
    [m] = [x for mem in members for x in drain(mem, 0.1)]
    assert m.topic == "sh/t"


@VERSIONS
def test_shared_subscription_two_groups_each_get_a_copy(broker, clients, version):
    g1 = [clients(broker.port, version=version) for _ in range(2)]
    g2 = [clients(broker.port, version=version) for _ in range(2)]
    plain = clients(broker.port, version=version)
    for m in g1:
        sub(m, "$share/one/sg/#", 1)
    for m in g2:
        sub(m, "$share/two/sg/+", 1)
    sub(plain, "sg/t", 1)
    p = clients(broker.port, version=version)
    want = [b"%d" % i for i in range(10)]
    for x in want:
        publish(p, "sg/t", x, 1)
    assert [m.payload for m in get_messages(plain, 10)] == want
    for group in (g1, g2):
        assert wait_for(lambda: sum(m.messages.qsize() for m in group) >= 10, 5)
        time.sleep(0.1)
        flat = [x.payload for m in group for x in drain(m)]
        assert sorted(flat) == sorted(want)


@VERSIONS
@pytest.mark.parametrize("how", ["disconnect", "kill"])
def test_shared_unacked_messages_go_to_another_member(broker, clients, version, how):
    lazy = clients(broker.port, version=version)
    lazy.manual_ack_set(True)
    sub(lazy, "$share/g/su/t", 1)
    busy = clients(broker.port, version=version)
    sub(busy, "$share/g/su/t", 1)
    p = clients(broker.port, version=version)
    want = [b"%d" % i for i in range(6)]
    for x in want:
        publish(p, "su/t", x, 1)
    assert wait_for(lambda: lazy.messages.qsize() + busy.messages.qsize() >= 6, 5)
    held = [m.payload for m in drain(lazy)]
    first = [m.payload for m in drain(busy)]
    assert held and first and sorted(held + first) == sorted(want)
    if how == "kill":
        kill(lazy)
    else:
        lazy.disconnect()
    moved = get_messages(busy, len(held))
    assert sorted(m.payload for m in moved) == sorted(held)
    assert sorted(first + [m.payload for m in moved]) == sorted(want)
    no_message(busy, 0.3)


def test_unsubscribed_shared_member_gets_nothing(broker, clients):
    a = clients(broker.port)
    b = clients(broker.port)
    sub(a, "$share/g/us/t", 1)
    sub(b, "$share/g/us/t", 1)
    assert unsub(a, "$share/g/us/t") == [0]
    p = clients(broker.port)
    for i in range(4):
        publish(p, "us/t", b"%d" % i, 1)
    assert [m.payload for m in get_messages(b, 4)] == [b"%d" % i for i in range(4)]
    no_message(a, 0.2)


# --- keepalive and client identifiers -----------------------------------------------


@VERSIONS
def test_keepalive_timeout_disconnects_silent_client(broker, raw_client, version):
    c, ack = raw_connect(raw_client, broker.port, version, keepalive=1)
    assert ack.reason_code == 0
    t0 = time.monotonic()
    if version == 5:
        pkt = c.recv(4)
        assert pkt is not None and pkt.TYPE == C.DISCONNECT and pkt.reason_code == C.KEEP_ALIVE_TIMEOUT
    assert c.closed(4)
    assert 1.0 <= time.monotonic() - t0 <= 3.0


def test_keepalive_longer_than_connect_timeout_still_enforced(make_broker, raw_client):
    """Keepalive checks of a client whose 1.5 x keepalive outlasts the connect timeout
    start from the connect-timeout check (Broker.expect_connect), not a timer of their own:
    the hand-over must keep both the idle client's timeout and an active client alive."""
    b = make_broker("[limits]\nconnect_timeout = 1\n")
    idle, ack = raw_connect(raw_client, b.port, 4, keepalive=2)
    t0 = time.monotonic()
    busy, ack2 = raw_connect(raw_client, b.port, 4, keepalive=2)
    assert ack.reason_code == 0 and ack2.reason_code == 0
    while time.monotonic() - t0 < 2.5:  # past the connect timeout, not yet 1.5 x keepalive
        time.sleep(0.4)
        busy.send(Pingreq())
        assert busy.recv(2).TYPE == C.PINGRESP
        if time.monotonic() - t0 < 2.8:  # (a slow machine may overrun the loop)
            assert not idle.closed(0.01)
    assert idle.closed(3.5)
    assert 2.9 <= time.monotonic() - t0 <= 6.0
    for _ in range(3):
        busy.send(Pingreq())
        assert busy.recv(2).TYPE == C.PINGRESP
        time.sleep(0.5)


def test_keepalive_activity_keeps_connection(broker, raw_client):
    c, ack = raw_connect(raw_client, broker.port, 4, keepalive=1)
    for _ in range(4):
        time.sleep(0.5)
        c.send(Pingreq())
        assert c.recv(2).TYPE == C.PINGRESP


def test_server_keep_alive_v5(make_broker, clients):
    b = make_broker("[limits]\nmax_keepalive = 5\n")
    c = clients(b.port, version=5, keepalive=60)
    assert connack_rc(c) == 0
    assert c.connack[2].ServerKeepAlive == 5
    c0 = clients(b.port, version=5, keepalive=0)
    assert c0.connack[2].ServerKeepAlive == 5
    ok = clients(b.port, version=5, keepalive=4)
    assert not hasattr(ok.connack[2], "ServerKeepAlive")


def test_v311_keepalive_above_max_refused(make_broker, raw_client):
    b = make_broker("[limits]\nmax_keepalive = 5\n")
    c, ack = raw_connect(raw_client, b.port, 4, keepalive=60)
    assert ack.TYPE == C.CONNACK and ack.reason_code == C.CONNACK_REFUSED_IDENTIFIER_REJECTED
    assert c.closed(2)
    c, ack = raw_connect(raw_client, b.port, 4, keepalive=5)
    assert ack.reason_code == 0


@VERSIONS
def test_keepalive_zero_accepted(broker, raw_client, version):
    c, ack = raw_connect(raw_client, broker.port, version, keepalive=0)
    assert ack.reason_code == 0
    assert "server_keep_alive" not in ack.properties
    time.sleep(1.2)
    c.send(Pingreq())
    assert c.recv(2).TYPE == C.PINGRESP


def test_empty_client_id_v311(broker, raw_client):
    c, ack = raw_connect(raw_client, broker.port, 4, client_id="", clean_start=True)
    assert ack.reason_code == 0
    c.send(Pingreq())
    assert c.recv().TYPE == C.PINGRESP
    c, ack = raw_connect(raw_client, broker.port, 4, client_id="", clean_start=False)
    assert ack.reason_code == C.CONNACK_REFUSED_IDENTIFIER_REJECTED
    assert c.closed(2)


def test_empty_client_id_v5_gets_assigned_identifier(broker, clients):
    a = clients(broker.port, version=5, client_id="")
    b = clients(broker.port, version=5, client_id="")
    ida = a.connack[2].AssignedClientIdentifier
    idb = b.connack[2].AssignedClientIdentifier
    assert ida and idb and ida != idb
    sub(a, "assigned/t", 1)
    publish(b, "assigned/t", b"x", 1)
    assert [m.payload for m in get_messages(a, 1)] == [b"x"]
    named = clients(broker.port, version=5, client_id="named")
    assert not hasattr(named.connack[2], "AssignedClientIdentifier")


# --- CONNACK properties and disabled features -------------------------------------------


def test_connack_properties_defaults(broker, clients):
    c = clients(broker.port)
    props = c.connack[2]
    assert props.ReceiveMaximum == 1024
    assert props.MaximumPacketSize == 1048576
    assert props.TopicAliasMaximum == 64
    for absent in ("MaximumQoS", "RetainAvailable", "WildcardSubscriptionAvailable",
                   "SubscriptionIdentifierAvailable", "SharedSubscriptionAvailable"):
        assert not hasattr(props, absent), absent


RESTRICTED = """
[broker]
maximum_qos = 1
retain_available = false
wildcard_subscriptions = false
shared_subscriptions = false
subscription_identifiers = false
[limits]
receive_maximum = 10
max_packet_size = 2000
topic_alias_maximum = 5
"""


def test_connack_properties_reflect_config(make_broker, clients):
    b = make_broker(RESTRICTED)
    c = clients(b.port)
    props = c.connack[2]
    assert (props.ReceiveMaximum, props.MaximumPacketSize, props.TopicAliasMaximum) == (10, 2000, 5)
    assert props.MaximumQoS == 1
    assert props.RetainAvailable == 0
    assert props.WildcardSubscriptionAvailable == 0
    assert props.SubscriptionIdentifierAvailable == 0
    assert props.SharedSubscriptionAvailable == 0
    assert sub(c, "dis/+", 0) == [C.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED]
    assert sub(c, "dis/#", 0) == [C.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED]
    assert sub(c, "$share/g/dis/t", 0) == [C.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED]
    assert sub(c, "dis/t", 0, sub_id=3) == [C.SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED]
    assert sub(c, "dis/t", 2) == [1], "granted QoS capped at maximum_qos"
    p = clients(b.port)
    publish(p, "dis/t", b"x", 1)
    [m] = get_messages(c, 1)
    assert m.qos == 1


def test_v311_suback_failure_for_disabled_features(make_broker, clients):
    b = make_broker(RESTRICTED)
    c = clients(b.port, version=4)
    assert sub(c, "dis/+", 0) == [0x80]
    assert sub(c, "$share/g/dis/t", 0) == [0x80]
    assert sub(c, "dis/t", 2) == [1]


@pytest.mark.parametrize("what,reason", [("qos2", C.QOS_NOT_SUPPORTED), ("retain", C.RETAIN_NOT_SUPPORTED)])
def test_publish_beyond_server_capabilities_disconnects(make_broker, raw_client, what, reason):
    b = make_broker(RESTRICTED)
    c, ack = raw_connect(raw_client, b.port, 5)
    assert ack.reason_code == 0
    if what == "qos2":
        c.send(Publish("cap/t", b"x", qos=2, packet_id=1))
    else:
        c.send(Publish("cap/t", b"x", qos=0, retain=True))
    pkt = c.recv(3)
    assert pkt is not None and pkt.TYPE == C.DISCONNECT and pkt.reason_code == reason
    assert c.closed(2)


# --- topic aliases ---------------------------------------------------------------------


def test_topic_alias_inbound(broker, clients):
    s = clients(broker.port)
    sub(s, "ta/#", 1)
    p = clients(broker.port)
    publish(p, "ta/long/topic/name", b"1", 1, properties=pprops(TopicAlias=1))
    publish(p, "", b"2", 1, properties=pprops(TopicAlias=1))
    publish(p, "ta/other", b"3", 0, properties=pprops(TopicAlias=1))  # remap alias 1
    publish(p, "", b"4", 0, properties=pprops(TopicAlias=1))
    publish(p, "ta/plain", b"5", 1)
    got = get_messages(s, 5)
    assert [(m.topic, m.payload) for m in got] == [
        ("ta/long/topic/name", b"1"), ("ta/long/topic/name", b"2"),
        ("ta/other", b"3"), ("ta/other", b"4"), ("ta/plain", b"5")]
    assert not any(hasattr(m.properties, "TopicAlias") for m in got), \
        "the publisher's alias must not leak to a subscriber that allows none"


def test_topic_alias_outbound(broker, clients):
    """The broker may use up to the client's topic alias maximum.

    paho 2.x does not resolve inbound topic aliases (an alias-only PUBLISH reaches
    on_message with topic ""), so the test keeps the alias table itself.
    """
    s = clients(broker.port, properties={"TopicAliasMaximum": 2})
    sub(s, "tb/#", 1)
    p = clients(broker.port)
    sent = ["tb/a", "tb/b", "tb/c", "tb/a", "tb/b", "tb/c", "tb/a"]
    for i, t in enumerate(sent):
        publish(p, t, b"%d" % i, i % 2)
    got = get_messages(s, len(sent))
    table = {}
    resolved = []
    alias_only = 0
    for m in got:
        alias = getattr(m.properties, "TopicAlias", None)
        if alias is not None:
            assert 1 <= alias <= 2
            if m.topic:
                table[alias] = m.topic
            else:
                alias_only += 1
            resolved.append(m.topic or table[alias])
        else:
            assert m.topic
            resolved.append(m.topic)
    assert resolved == sent
    assert [m.payload for m in got] == [b"%d" % i for i in range(len(sent))]
    assert alias_only >= 2, "the broker never used an alias it had set"


@pytest.mark.parametrize("alias", [0, 65])
def test_topic_alias_out_of_range_disconnects(broker, raw_client, alias):
    c, ack = raw_connect(raw_client, broker.port, 5)
    assert ack.properties["topic_alias_maximum"] == 64
    c.send(Publish("tc/t", b"x", properties={"topic_alias": alias}))
    pkt = c.recv(3)
    assert pkt is not None and pkt.TYPE == C.DISCONNECT and pkt.reason_code == C.TOPIC_ALIAS_INVALID
    assert c.closed(2)


# --- message expiry ----------------------------------------------------------------------


@VERSIONS
def test_message_expiry_while_offline(broker, clients, version):
    cid = uid("exp")
    s = persistent(clients, broker.port, version, cid)
    sub(s, "me/t", 1)
    clean_disconnect(broker, s, cid)
    p = clients(broker.port)
    publish(p, "me/t", b"short", 1, properties=pprops(MessageExpiryInterval=1))
    publish(p, "me/t", b"long", 1, properties=pprops(MessageExpiryInterval=10))
    publish(p, "me/t", b"forever", 1)
    time.sleep(2.0)
    s2 = persistent(clients, broker.port, version, cid)
    assert session_present(s2)
    got = get_messages(s2, 2)
    assert [m.payload for m in got] == [b"long", b"forever"]
    if version == 5:
        remaining = got[0].properties.MessageExpiryInterval
        assert 1 <= remaining <= 8, remaining
        assert not hasattr(got[1].properties, "MessageExpiryInterval")
    no_message(s2, 0.3)


def test_message_expiry_forwarded_to_online_subscriber(broker, clients):
    s = clients(broker.port)
    sub(s, "me/on", 1)
    p = clients(broker.port)
    publish(p, "me/on", b"x", 1, properties=pprops(MessageExpiryInterval=30))
    publish(p, "me/on", b"y", 0, properties=pprops(MessageExpiryInterval=30))
    got = get_messages(s, 2)
    assert all(25 <= m.properties.MessageExpiryInterval <= 30 for m in got)


def test_max_message_expiry_cap(make_broker, clients):
    b = make_broker("[limits]\nmax_message_expiry = 5\n")
    s = clients(b.port)
    sub(s, "cap/#", 1)
    p = clients(b.port)
    publish(p, "cap/none", b"n", 1)
    publish(p, "cap/long", b"l", 1, properties=pprops(MessageExpiryInterval=100))
    publish(p, "cap/short", b"s", 1, properties=pprops(MessageExpiryInterval=2))
    got = {m.topic: m.properties.MessageExpiryInterval for m in get_messages(s, 3)}
    assert got["cap/short"] <= 2
    assert 4 <= got["cap/none"] <= 5 and 4 <= got["cap/long"] <= 5


def test_max_session_expiry_cap(make_broker, clients):
    b = make_broker("[limits]\nmax_session_expiry = 1\n")
    c = clients(b.port, properties={"SessionExpiryInterval": 3600})
    assert c.connack[2].SessionExpiryInterval == 1


# --- request / response properties -----------------------------------------------------


@pytest.mark.parametrize("qos", [0, 1, 2])
def test_request_response_properties_unchanged(broker, clients, qos):
    responder = clients(broker.port)
    sub(responder, "rr/req", qos)
    requester = clients(broker.port)
    sub(requester, "rr/resp/+", qos)
    user = [("b", "2"), ("a", "1"), ("b", "3"), ("ünï", "cödé")]
    props = pprops(ResponseTopic="rr/resp/1", CorrelationData=b"\x00\x01corr\xff",
                   UserProperty=user, PayloadFormatIndicator=1, ContentType="application/json")
    publish(requester, "rr/req", b'{"q": 1}', qos, properties=props)
    [m] = get_messages(responder, 1)
    mp = m.properties
    assert m.payload == b'{"q": 1}'
    assert mp.ResponseTopic == "rr/resp/1"
    assert mp.CorrelationData == b"\x00\x01corr\xff"
    assert mp.UserProperty == user
    assert mp.PayloadFormatIndicator == 1
    assert mp.ContentType == "application/json"
    publish(responder, mp.ResponseTopic, b"answer", qos,
            properties=pprops(CorrelationData=mp.CorrelationData))
    [r] = get_messages(requester, 1)
    assert (r.topic, r.payload, r.properties.CorrelationData) == ("rr/resp/1", b"answer", b"\x00\x01corr\xff")


# --- maximum packet size ---------------------------------------------------------------


@pytest.mark.parametrize("qos", [0, 1])
def test_client_maximum_packet_size_respected(broker, clients, qos):
    s = clients(broker.port, properties={"MaximumPacketSize": 100})
    sub(s, "mp/#", qos)
    p = clients(broker.port)
    publish(p, "mp/big", b"x" * 200, qos)
    publish(p, "mp/small", b"y" * 10, qos)
    publish(p, "mp/edge", b"z" * 95, qos)  # payload fits, packet does not
    publish(p, "mp/big", b"x" * 5000, qos, retain=True)
    for i in range(5):
        publish(p, "mp/after", b"%d" % i, qos)
    got = get_messages(s, 6)
    assert [(m.topic, m.payload) for m in got] == \
        [("mp/small", b"y" * 10)] + [("mp/after", b"%d" % i) for i in range(5)]
    no_message(s, 0.3)
    late = clients(broker.port, properties={"MaximumPacketSize": 100})
    sub(late, "mp/#", qos)  # the big retained message is not sent either
    no_message(late, 0.3)


@VERSIONS
def test_packet_above_server_maximum_disconnects(make_broker, raw_client, clients, version):
    b = make_broker("[limits]\nmax_packet_size = 1024\n")
    s = clients(b.port)
    sub(s, "ps/#", 0)
    c, ack = raw_connect(raw_client, b.port, version)
    assert ack.reason_code == 0
    c.send(Publish("ps/ok", b"x" * 900))
    [m] = get_messages(s, 1)
    assert len(m.payload) == 900
    c.send(Publish("ps/big", b"x" * 2000))
    if version == 5:
        pkt = c.recv(3)
        assert pkt is not None and pkt.TYPE == C.DISCONNECT and pkt.reason_code == C.PACKET_TOO_LARGE
    assert c.closed(3)
    no_message(s, 0.2)
    c2, ack = raw_connect(raw_client, b.port, version)
    c2.send(Pingreq())
    assert c2.recv().TYPE == C.PINGRESP


# --- flow control ----------------------------------------------------------------------


@pytest.mark.parametrize("qos", [1, 2])
def test_receive_maximum_respected_outbound(broker, clients, qos):
    s = clients(broker.port, properties={"ReceiveMaximum": 2})
    s.manual_ack_set(True)
    sub(s, "fc/t", qos)
    p = clients(broker.port)
    for i in range(5):
        publish(p, "fc/t", b"%d" % i, qos)
    first = get_messages(s, 5, timeout=0.8)
    assert [m.payload for m in first] == [b"0", b"1"]
    s.ack(first[0].mid, qos)
    [m] = get_messages(s, 1)
    assert m.payload == b"2"
    no_message(s, 0.3)
    got = first + [m]
    for _ in range(2):
        s.ack(got[len(got) - 2].mid, qos)  # ack the older of the two in flight
        got += get_messages(s, 1)
        no_message(s, 0.1)
    assert [m.payload for m in got] == [b"%d" % i for i in range(5)]


def test_max_inflight_limits_v311_window(make_broker, clients):
    b = make_broker("[limits]\nmax_inflight = 2\n")
    s = clients(b.port, version=4)
    s.manual_ack_set(True)
    sub(s, "mi/t", 1)
    p = clients(b.port, version=4)
    for i in range(4):
        publish(p, "mi/t", b"%d" % i, 1)
    first = get_messages(s, 4, timeout=0.8)
    assert [m.payload for m in first] == [b"0", b"1"]
    for m in first:
        s.ack(m.mid, 1)
    assert [m.payload for m in get_messages(s, 2)] == [b"2", b"3"]


def test_receive_maximum_exceeded_inbound(make_broker, raw_client):
    b = make_broker("[limits]\nreceive_maximum = 2\n")
    c, ack = raw_connect(raw_client, b.port, 5)
    assert ack.properties["receive_maximum"] == 2
    # Within the window (completed exchanges free their slot).
    for pid in (1, 2, 3):
        c.send(Publish("rm/t", b"x", qos=2, packet_id=pid))
        assert c.recv().TYPE == C.PUBREC
        c.send(Pubrel(pid))
        assert c.recv().TYPE == C.PUBCOMP
    c.send(Publish("rm/t", b"a", qos=2, packet_id=10))
    c.send(Publish("rm/t", b"b", qos=2, packet_id=11))
    assert [c.recv().TYPE, c.recv().TYPE] == [C.PUBREC, C.PUBREC]
    c.send(Publish("rm/t", b"c", qos=2, packet_id=12))
    pkt = c.recv(3)
    assert pkt is not None and pkt.TYPE == C.DISCONNECT and pkt.reason_code == C.RECEIVE_MAXIMUM_EXCEEDED
    assert c.closed(2)


def test_receive_maximum_bounds_a_311_clients_qos2_ids_without_pubrel(make_broker, raw_client):
    """3.1.1 has no receive maximum, but the packet ids a session holds until PUBREL are
    memory: past receive_maximum of them the connection closes; back, the client
    releases them (PUBREL) and goes on."""
    b = make_broker("[limits]\nreceive_maximum = 3\n")
    c, ack = raw_connect(raw_client, b.port, 4, client_id="qos2-piler", clean_start=False)
    for pid in (1, 2, 3):
        c.send(Publish("rm/t", b"x", qos=2, packet_id=pid))
        assert c.recv().TYPE == C.PUBREC
    c.send(Publish("rm/t", b"x", qos=2, packet_id=4))
    assert c.closed(3)
    c, ack = raw_connect(raw_client, b.port, 4, client_id="qos2-piler", clean_start=False)
    assert ack.session_present
    c.send(Pubrel(1))
    assert c.recv().TYPE == C.PUBCOMP
    c.send(Publish("rm/t", b"x", qos=2, packet_id=4))
    assert c.recv().TYPE == C.PUBREC


# --- MQTT 3.1 ---------------------------------------------------------------------------


def test_mqtt31_client(broker, clients):
    c3 = clients(broker.port, version=3)
    assert connack_rc(c3) == 0
    assert sub(c3, "m31/#", 2) == [2]
    c5 = clients(broker.port, version=5)
    sub(c5, "m31/#", 2)
    for q in (0, 1, 2):
        publish(c3, "m31/from3", b"%d" % q, q)
        publish(c5, "m31/from5", b"%d" % q, q)
    got3 = sorted((m.topic, m.payload, m.qos) for m in get_messages(c3, 6))
    got5 = sorted((m.topic, m.payload, m.qos) for m in get_messages(c5, 6))
    want = sorted((f"m31/from{v}", b"%d" % q, q) for v in (3, 5) for q in (0, 1, 2))
    assert got3 == want and got5 == want


# --- embedding API --------------------------------------------------------------------


def test_embedded_publish_reaches_subscribers(broker, clients):
    c = clients(broker.port, version=4)
    sub(c, "emb/#", 1)
    assert broker.call(broker.broker.publish, "emb/t", b"x", 1, True) is True
    [m] = get_messages(c, 1)
    assert (m.topic, m.payload, m.qos, m.retain) == ("emb/t", b"x", 1, False)
    late = clients(broker.port)
    sub(late, "emb/#", 1)
    [m] = get_messages(late, 1)
    assert (m.payload, m.retain) == (b"x", True)
    assert broker.call(broker.broker.publish, "nobody/here", "str payload") is False


def test_async_with_broker(tmp_path):
    async def main():
        cfg = load(text='[[listener]]\nbind = "127.0.0.1"\nport = 0\n[sys]\ninterval = 0\n'
                        f'[storage]\ndata_dir = "{tmp_path}"\n')
        async with Broker(cfg) as b:
            assert b.running and b.port
            reader, writer = await asyncio.open_connection("127.0.0.1", b.port)
            dec = Decoder(C.MQTT5)
            pending = []

            async def next_packet():
                while not pending:
                    data = await reader.read(65536)
                    assert data, "broker closed the connection"
                    pending.extend(dec.feed(data))
                return pending.pop(0)

            writer.write(encode(Connect("async-embed", version=C.MQTT5), C.MQTT5))
            writer.write(encode(Subscribe(1, [SubscribeTopic("a/#", 1)]), C.MQTT5))
            assert (await next_packet()).TYPE == C.CONNACK
            assert (await next_packet()).reason_codes == [1]
            assert b.publish("a/b", "hello", 1) is True
            pkt = await next_packet()
            assert (pkt.topic, pkt.payload, pkt.qos) == ("a/b", b"hello", 1)
            writer.close()
        assert not b.running

    asyncio.run(asyncio.wait_for(main(), 10))


# --- slow subscribers ------------------------------------------------------------------


def test_slow_subscriber_does_not_block_others(make_broker, clients, raw_client):
    b = make_broker("[sys]\ninterval = 0.2\n")
    slow = raw_client(b.port)
    slow.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.send(Connect("slow-reader", keepalive=0))
    assert slow.recv().reason_code == 0
    assert raw_subscribe(slow, "flood/t", 0) == [0]
    # From here on `slow` never reads.
    pinger, _ = raw_connect(raw_client, b.port, 4, keepalive=0)
    fast = clients(b.port)
    sub(fast, "flood/t", 0)
    watch = clients(b.port)
    sub(watch, "$SYS/broker/publish/messages/dropped", 0)
    pub = clients(b.port, version=4)

    n, size, batch = 2000, 10_000, 50
    body = b"\xab" * (size - 4)
    received = []

    def pull():
        received.extend(m.payload for m in drain(fast))
        return len(received)

    t0 = time.monotonic()
    for i in range(n):
        pub.publish("flood/t", i.to_bytes(4, "big") + body, 0)
        if (i + 1) % batch == 0:
            # Keep the fast subscriber's own buffer small: we test the slow one's effect.
            assert wait_for(lambda: pull() >= i + 1, 10), f"fast subscriber stuck at {len(received)}/{i + 1}"
        if i == n // 2:
            pinger.send(Pingreq())
            assert pinger.recv(2).TYPE == C.PINGRESP
    assert wait_for(lambda: pull() >= n, 10)
    elapsed = time.monotonic() - t0
    assert [int.from_bytes(p[:4], "big") for p in received] == list(range(n))
    pinger.send(Pingreq())
    assert pinger.recv(2).TYPE == C.PINGRESP

    def dropped():
        vals = [int(m.payload) for m in drain(watch)]
        return vals and max(vals) > 0

    assert wait_for(dropped, 5), "no dropped messages reported in $SYS"
    assert elapsed < 30
