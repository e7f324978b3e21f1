"""Sessions end to end: persistence, expiry, redelivery, offline queues, wills, takeover."""

import time

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from conftest import get_messages, no_message
from mqtt_helpers import (clean_disconnect, kill, no_reconnect, persistent, pprops, publish,
                          raw_connect, raw_next, raw_subscribe, router, session_present, sub, uid,
                          wait_for, wait_offline)
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.packets import Disconnect, Puback, Pubcomp, Pubrec

VERSIONS = pytest.mark.parametrize("version", [4, 5])


def _payloads(msgs):
    return [m.payload for m in msgs]


# --- persistent sessions -----------------------------------------------------------------


@VERSIONS
def test_persistent_session_keeps_subscriptions_and_queues_messages(broker, clients, version):
    cid = uid("ps")
    s = persistent(clients, broker.port, version, cid)
    assert not session_present(s)
    sub(s, "ps/#", 2)
    clean_disconnect(broker, s, cid)

    p = clients(broker.port, version=version)
    sent = []
    for i in range(8):
        q = 1 + i % 2
        publish(p, f"ps/{i}", b"%d" % i, q)
        sent.append((f"ps/{i}", b"%d" % i, q))
    publish(p, "ps/qos0", b"not queued", 0)
    # The broker handles one connection's packets in order: once this PUBACK is back, the
    # QoS 0 message above was routed (while the session was offline), not after s2 connects.
    publish(p, "elsewhere/barrier", b"", 1)

    s2 = persistent(clients, broker.port, version, cid)
    assert session_present(s2)
    got = [(m.topic, m.payload, m.qos) for m in get_messages(s2, 8)]
    # paho hands a QoS 2 message over only at PUBREL, so order is compared per QoS level
    # (the wire order across levels is checked with a raw client below).
    for q in (1, 2):
        assert [g for g in got if g[2] == q] == [x for x in sent if x[2] == q], "queued in order"
    assert sorted(got) == sorted(sent), "QoS kept"
    no_message(s2, 0.3)  # QoS 0 is not queued for offline sessions by default
    publish(p, "ps/live", b"live", 1)  # the subscription survived: no re-subscribe
    [m] = get_messages(s2, 1)
    assert m.payload == b"live"


@VERSIONS
def test_queue_qos0_for_offline_sessions_when_enabled(make_broker, clients, version):
    b = make_broker("[broker]\nqueue_qos0_messages = true\n")
    cid = uid("q0")
    s = persistent(clients, b.port, version, cid)
    sub(s, "q0/t", 1)
    clean_disconnect(b, s, cid)
    p = clients(b.port)
    publish(p, "q0/t", b"zero", 0)
    publish(p, "q0/t", b"one", 1)
    s2 = persistent(clients, b.port, version, cid)
    got = get_messages(s2, 2)
    assert [(m.payload, m.qos) for m in got] == [(b"zero", 0), (b"one", 1)]


@VERSIONS
def test_clean_start_discards_session(broker, clients, version):
    cid = uid("cs")
    s = persistent(clients, broker.port, version, cid)
    sub(s, "cs/t", 1)
    clean_disconnect(broker, s, cid)
    p = clients(broker.port)
    publish(p, "cs/t", b"queued", 1)
    s2 = persistent(clients, broker.port, version, cid, clean=True)
    assert not session_present(s2)
    no_message(s2, 0.3)
    publish(p, "cs/t", b"after", 1)
    no_message(s2, 0.3)  # the subscription went with the session


def test_clean_session_v311_not_kept(broker, clients):
    cid = uid("c311")
    s = clients(broker.port, version=4, client_id=cid, clean=True)
    sub(s, "c311/t", 1)
    clean_disconnect(broker, s, cid)
    s2 = clients(broker.port, version=4, client_id=cid, clean=False)
    assert not session_present(s2)


def test_session_expiry_elapsed_v5(broker, clients):
    cid = uid("se")
    s = persistent(clients, broker.port, 5, cid, expiry=1)
    sub(s, "se/t", 1)
    clean_disconnect(broker, s, cid)
    p = clients(broker.port)
    publish(p, "se/t", b"lost", 1)
    # Still there before the interval ends...
    time.sleep(0.3)
    assert broker.call(lambda: cid in router(broker).sessions)
    time.sleep(1.2)  # 1.5 s offline in all
    s2 = persistent(clients, broker.port, 5, cid, expiry=1)
    assert not session_present(s2)
    no_message(s2, 0.3)


def test_session_within_expiry_is_resumed_v5(broker, clients):
    cid = uid("sw")
    s = persistent(clients, broker.port, 5, cid, expiry=2)
    sub(s, "sw/t", 1)
    clean_disconnect(broker, s, cid)
    time.sleep(0.5)
    s2 = persistent(clients, broker.port, 5, cid, expiry=2)
    assert session_present(s2)


def test_session_expiry_zero_ends_at_disconnect_v5(broker, clients):
    cid = uid("s0")
    s = persistent(clients, broker.port, 5, cid, expiry=0)
    sub(s, "s0/t", 1)
    clean_disconnect(broker, s, cid)
    assert not broker.call(lambda: cid in router(broker).sessions)
    s2 = persistent(clients, broker.port, 5, cid, expiry=60)
    assert not session_present(s2)


def _disconnect_with(client, reason=0, **props):
    rc = ReasonCode(PacketTypes.DISCONNECT, identifier=reason)
    client.disconnect(reasoncode=rc, properties=pprops("DISCONNECT", **props) if props else None)
    client.disconnected_event.wait(5)
    client.loop_stop()


def test_disconnect_sets_session_expiry_zero_v5(broker, clients):
    cid = uid("dz")
    s = persistent(clients, broker.port, 5, cid, expiry=60)
    sub(s, "dz/t", 1)
    _disconnect_with(s, SessionExpiryInterval=0)
    wait_offline(broker, cid)
    assert wait_for(lambda: not broker.call(lambda: cid in router(broker).sessions), 2)
    s2 = persistent(clients, broker.port, 5, cid)
    assert not session_present(s2)


def test_disconnect_extends_session_expiry_v5(broker, clients):
    cid = uid("dx")
    s = persistent(clients, broker.port, 5, cid, expiry=1)
    sub(s, "dx/t", 1)
    _disconnect_with(s, SessionExpiryInterval=60)
    wait_offline(broker, cid)
    time.sleep(1.5)
    p = clients(broker.port)
    publish(p, "dx/t", b"kept", 1)
    s2 = persistent(clients, broker.port, 5, cid)
    assert session_present(s2)
    assert _payloads(get_messages(s2, 1)) == [b"kept"]


def test_disconnect_expiry_after_zero_is_protocol_error_v5(broker, raw_client):
    cid = uid("dp")
    c, ack = raw_connect(raw_client, broker.port, 5, client_id=cid, clean_start=False)
    assert ack.reason_code == 0
    c.send(Disconnect(0, {"session_expiry_interval": 30}))
    pkt = c.recv(3)
    assert pkt is not None and pkt.TYPE == C.DISCONNECT and pkt.reason_code == C.PROTOCOL_ERROR
    assert c.closed(2)
    c2, ack = raw_connect(raw_client, broker.port, 5, client_id=cid, clean_start=False)
    assert not ack.session_present


@VERSIONS
def test_offline_queue_wire_order_across_qos_levels(broker, clients, raw_client, version):
    cid = uid("wo")
    props = {"session_expiry_interval": 60} if version == 5 else None
    c, ack = raw_connect(raw_client, broker.port, version, client_id=cid, clean_start=False,
                         properties=props)
    assert raw_subscribe(c, "wo/#", 2) == [2]
    c.close()
    wait_offline(broker, cid)
    p = clients(broker.port)
    for i in range(6):
        publish(p, f"wo/{i}", b"%d" % i, 1 + i % 2)
    c2, ack = raw_connect(raw_client, broker.port, version, client_id=cid, clean_start=False,
                          properties=props)
    assert ack.session_present
    got = [raw_next(c2, C.PUBLISH) for _ in range(6)]
    assert [(g.topic, g.qos, g.dup) for g in got] == [(f"wo/{i}", 1 + i % 2, False) for i in range(6)]


# --- redelivery ----------------------------------------------------------------------------


@VERSIONS
@pytest.mark.parametrize("how", ["disconnect", "kill"])
def test_unacked_messages_redelivered_with_dup_in_order(broker, clients, version, how):
    cid = uid("rd")
    s = persistent(clients, broker.port, version, cid)
    s.manual_ack_set(True)
    sub(s, "rd/t", 1)
    p = clients(broker.port)
    want = [b"%d" % i for i in range(5)]
    for x in want:
        publish(p, "rd/t", x, 1)
    first = get_messages(s, 5)
    assert _payloads(first) == want and not any(m.dup for m in first)
    s.ack(first[1].mid, 1)  # one acknowledged: not resent
    time.sleep(0.1)
    if how == "kill":
        kill(s)
        wait_offline(broker, cid)
    else:
        clean_disconnect(broker, s, cid)
    publish(p, "rd/t", b"new", 1)
    s2 = persistent(clients, broker.port, version, cid)
    assert session_present(s2)
    got = get_messages(s2, 5)
    assert [(m.payload, m.dup) for m in got] == \
        [(b"0", True), (b"2", True), (b"3", True), (b"4", True), (b"new", False)]
    no_message(s2, 0.3)


@VERSIONS
def test_qos2_redelivery_resends_pubrel_then_publish(broker, clients, raw_client, version):
    cid = uid("rq2")
    c, ack = raw_connect(raw_client, broker.port, version, client_id=cid, clean_start=False,
                         properties={"session_expiry_interval": 60} if version == 5 else None)
    assert raw_subscribe(c, "rq2/t", 2) == [2]
    p = clients(broker.port)
    publish(p, "rq2/t", b"a", 2)
    publish(p, "rq2/t", b"b", 2)
    m1, m2 = raw_next(c, C.PUBLISH), raw_next(c, C.PUBLISH)
    assert (m1.payload, m2.payload) == (b"a", b"b")
    c.send(Pubrec(m1.packet_id))
    rel = c.recv()
    assert rel.TYPE == C.PUBREL and rel.packet_id == m1.packet_id
    c.close()  # m1 released (PUBCOMP missing), m2 not acknowledged at all
    wait_offline(broker, cid)
    c2, ack = raw_connect(raw_client, broker.port, version, client_id=cid, clean_start=False,
                          properties={"session_expiry_interval": 60} if version == 5 else None)
    assert ack.session_present
    rel = c2.recv()
    assert rel.TYPE == C.PUBREL and rel.packet_id == m1.packet_id
    pub = c2.recv()
    assert pub.TYPE == C.PUBLISH and pub.dup and pub.packet_id == m2.packet_id and pub.payload == b"b"
    c2.send(Pubcomp(m1.packet_id))
    c2.send(Pubrec(m2.packet_id))
    rel = c2.recv()
    assert rel.TYPE == C.PUBREL and rel.packet_id == m2.packet_id
    c2.send(Pubcomp(m2.packet_id))
    publish(p, "rq2/t", b"c", 1)
    pub = raw_next(c2, C.PUBLISH)
    assert pub.payload == b"c" and not pub.dup
    c2.send(Puback(pub.packet_id))


def _collect(c, wait=0.5):
    """Every packet a RawClient receives until it has been quiet for `wait` seconds."""
    got = []
    try:
        while True:
            pkt = c.recv(wait)
            if pkt is None:
                return got
            got.append(pkt)
    except TimeoutError:
        return got


def test_offline_queue_drained_within_receive_maximum(broker, clients, raw_client):
    cid = uid("qr")
    s = persistent(clients, broker.port, 5, cid)
    sub(s, "qr/t", 1)
    clean_disconnect(broker, s, cid)
    p = clients(broker.port)
    for i in range(5):
        publish(p, "qr/t", b"%d" % i, 1)
    c, ack = raw_connect(raw_client, broker.port, 5, client_id=cid, clean_start=False,
                         properties={"session_expiry_interval": 60, "receive_maximum": 2})
    assert ack.session_present
    got = [g for g in _collect(c, 0.4) if g.TYPE == C.PUBLISH]
    assert [g.payload for g in got] == [b"0", b"1"]
    for i in range(2, 5):
        c.send(Puback(got[-2].packet_id))
        nxt = raw_next(c, C.PUBLISH)
        assert nxt.payload == b"%d" % i
        got.append(nxt)


@pytest.mark.parametrize("qos", [1, 2])
def test_redelivery_respects_new_receive_maximum(broker, clients, raw_client, qos):
    """Unacknowledged messages resent at reconnect count against the client's new
    Receive Maximum [MQTT-3.3.4-9]: with 2 allowed, only 2 may be in flight."""
    cid = uid("rr")
    props = {"session_expiry_interval": 60}
    c, _ = raw_connect(raw_client, broker.port, 5, client_id=cid, clean_start=False,
                       properties=props)
    raw_subscribe(c, "rrm/t", qos)
    p = clients(broker.port)
    for i in range(5):
        publish(p, "rrm/t", b"%d" % i, qos)
    assert [raw_next(c, C.PUBLISH).payload for _ in range(5)] == [b"%d" % i for i in range(5)]
    c.close()
    wait_offline(broker, cid)
    c2, ack = raw_connect(raw_client, broker.port, 5, client_id=cid, clean_start=False,
                          properties=dict(props, receive_maximum=2))
    assert ack.session_present
    resent = [g for g in _collect(c2) if g.TYPE == C.PUBLISH]
    assert [g.dup for g in resent] == [True, True], \
        f"{len(resent)} unacknowledged PUBLISHes resent with receive maximum 2"
    # Acknowledging one lets the next one through.
    ack_pkt = Puback(resent[0].packet_id) if qos == 1 else Pubrec(resent[0].packet_id)
    c2.send(ack_pkt)
    if qos == 2:
        assert raw_next(c2, C.PUBREL).packet_id == resent[0].packet_id
        c2.send(Pubcomp(resent[0].packet_id))
    assert raw_next(c2, C.PUBLISH).payload == b"2"


# --- offline queue limit -------------------------------------------------------------------


@VERSIONS
def test_offline_queue_bounded(make_broker, clients, version):
    b = make_broker("[limits]\nmax_queued_messages = 5\n")
    cid = uid("oq")
    s = persistent(clients, b.port, version, cid)
    sub(s, "oq/t", 1)
    clean_disconnect(b, s, cid)
    p = clients(b.port)
    for i in range(12):
        publish(p, "oq/t", b"%d" % i, 1)
    s2 = persistent(clients, b.port, version, cid)
    assert session_present(s2)
    assert _payloads(get_messages(s2, 12, timeout=1.5)) == [b"%d" % i for i in range(5)]
    assert b.call(lambda: router(b).stats.pub_dropped) >= 7
    # The broker keeps running and the session keeps working.
    publish(p, "oq/t", b"live", 1)
    assert _payloads(get_messages(s2, 1)) == [b"live"]
    other = clients(b.port, version=version)
    sub(other, "oq/t", 1)
    publish(p, "oq/t", b"x", 1)
    assert _payloads(get_messages(other, 1)) == [b"x"]


# --- wills ---------------------------------------------------------------------------------


def _watcher(clients, port, flt="will/#", qos=2):
    w = clients(port)
    sub(w, flt, qos)
    return w


@VERSIONS
def test_will_published_on_abnormal_disconnect(broker, clients, version):
    w = _watcher(clients, broker.port)
    c = clients(broker.port, version=version, will={"topic": "will/a", "payload": b"gone", "qos": 1})
    no_message(w, 0.2)
    kill(c)
    [m] = get_messages(w, 1)
    assert (m.topic, m.payload, m.qos) == ("will/a", b"gone", 1)
    no_message(w, 0.3)


@VERSIONS
def test_will_published_on_keepalive_timeout(broker, raw_client, clients, version):
    from wrenmq.mqtt.packets import Will
    w = _watcher(clients, broker.port)
    c, ack = raw_connect(raw_client, broker.port, version, keepalive=1,
                         will=Will("will/ka", b"timeout", 0))
    assert ack.reason_code == 0
    [m] = get_messages(w, 1, timeout=4)
    assert m.payload == b"timeout"


@VERSIONS
def test_no_will_on_normal_disconnect(broker, clients, version):
    w = _watcher(clients, broker.port)
    c = clients(broker.port, version=version, will={"topic": "will/n", "payload": b"no", "qos": 1})
    c.disconnect()
    c.disconnected_event.wait(5)
    no_message(w, 0.5)


def test_will_published_on_disconnect_with_will_message_v5(broker, clients):
    w = _watcher(clients, broker.port)
    c = clients(broker.port, will={"topic": "will/d4", "payload": b"asked", "qos": 1})
    _disconnect_with(c, C.DISCONNECT_WITH_WILL)
    [m] = get_messages(w, 1)
    assert (m.topic, m.payload) == ("will/d4", b"asked")


@VERSIONS
def test_will_qos_retain_and_properties_passed_through(broker, clients, version):
    w = _watcher(clients, broker.port)
    will = {"topic": "will/p", "payload": b"props", "qos": 2, "retain": True}
    user = [("k", "v1"), ("a", "b"), ("k", "v2")]
    if version == 5:
        will["properties"] = pprops("WILLMESSAGE", UserProperty=user, ContentType="text/plain",
                                    PayloadFormatIndicator=1, ResponseTopic="will/resp",
                                    CorrelationData=b"cd")
    c = clients(broker.port, version=version, will=will)
    kill(c)
    [m] = get_messages(w, 1)
    assert (m.topic, m.payload, m.qos, m.retain) == ("will/p", b"props", 2, False)
    late = clients(broker.port)
    sub(late, "will/#", 2)
    [r] = get_messages(late, 1)
    assert (r.payload, r.qos, r.retain) == (b"props", 2, True)
    if version == 5:
        for msg in (m, r):
            mp = msg.properties
            assert mp.UserProperty == user
            assert mp.ContentType == "text/plain"
            assert mp.PayloadFormatIndicator == 1
            assert (mp.ResponseTopic, mp.CorrelationData) == ("will/resp", b"cd")


def _will_client(clients, port, cid, delay, expiry, topic="will/delay"):
    return clients(port, client_id=cid, clean=False, properties={"SessionExpiryInterval": expiry},
                   will={"topic": topic, "payload": b"late", "qos": 1,
                         "properties": pprops("WILLMESSAGE", WillDelayInterval=delay)})


def test_will_delay(broker, clients):
    w = _watcher(clients, broker.port)
    c = _will_client(clients, broker.port, uid("wd"), delay=1, expiry=10)
    t0 = time.monotonic()
    kill(c)
    no_message(w, 0.7)
    [m] = get_messages(w, 1, timeout=2.5)
    assert m.payload == b"late"
    assert 0.9 <= time.monotonic() - t0 <= 3.0


def test_will_delay_cancelled_by_reconnect(broker, clients):
    w = _watcher(clients, broker.port)
    cid = uid("wr")
    c = _will_client(clients, broker.port, cid, delay=1, expiry=10)
    kill(c)
    wait_offline(broker, cid)
    time.sleep(0.2)
    c2 = persistent(clients, broker.port, 5, cid, expiry=10)
    assert session_present(c2)
    no_message(w, 1.5)


def test_will_delay_cut_short_by_clean_start_reconnect(broker, clients):
    """A clean-start reconnect ends the old session, and with it the will delay."""
    w = _watcher(clients, broker.port)
    cid = uid("wc")
    c = _will_client(clients, broker.port, cid, delay=30, expiry=60)
    kill(c)
    wait_offline(broker, cid)
    no_message(w, 0.2)
    c2 = clients(broker.port, client_id=cid, clean=True)
    assert not session_present(c2)
    [m] = get_messages(w, 1, timeout=2)
    assert m.payload == b"late"


def test_will_delay_cut_short_by_session_expiry(broker, clients):
    w = _watcher(clients, broker.port)
    c = _will_client(clients, broker.port, uid("we"), delay=30, expiry=1)
    t0 = time.monotonic()
    kill(c)
    [m] = get_messages(w, 1, timeout=3)
    assert m.payload == b"late"
    assert 0.8 <= time.monotonic() - t0 <= 3.0


def test_will_delay_with_session_expiry_zero_publishes_at_disconnect(broker, clients):
    w = _watcher(clients, broker.port)
    c = clients(broker.port, will={"topic": "will/z", "payload": b"now", "qos": 1,
                                   "properties": pprops("WILLMESSAGE", WillDelayInterval=30)})
    kill(c)
    [m] = get_messages(w, 1, timeout=1.5)
    assert m.payload == b"now"


# --- takeover --------------------------------------------------------------------------------


@VERSIONS
def test_session_takeover(broker, clients, version):
    cid = uid("to")
    first = no_reconnect(persistent(clients, broker.port, version, cid))
    sub(first, "to/t", 1)
    second = persistent(clients, broker.port, version, cid)
    assert session_present(second)
    assert first.disconnected_event.wait(3), "the first connection was not closed"
    if version == 5:
        assert first.disconnect_reason.value == C.SESSION_TAKEN_OVER
    p = clients(broker.port)
    publish(p, "to/t", b"after", 1)
    assert _payloads(get_messages(second, 1)) == [b"after"]
    no_message(first, 0.2)
    assert broker.call(lambda: router(broker).online) == 2


@VERSIONS
def test_takeover_keeps_unacked_messages(broker, clients, version):
    cid = uid("tu")
    first = no_reconnect(persistent(clients, broker.port, version, cid))
    first.manual_ack_set(True)
    sub(first, "tu/t", 1)
    p = clients(broker.port)
    publish(p, "tu/t", b"pending", 1)
    assert _payloads(get_messages(first, 1)) == [b"pending"]
    second = persistent(clients, broker.port, version, cid)
    [m] = get_messages(second, 1)
    assert (m.payload, m.dup) == (b"pending", True)


def test_takeover_resuming_session_skips_delayed_will(broker, clients):
    w = _watcher(clients, broker.port)
    cid = uid("td")
    no_reconnect(_will_client(clients, broker.port, cid, delay=1, expiry=10))
    second = persistent(clients, broker.port, 5, cid, expiry=10)
    assert session_present(second)
    no_message(w, 1.5)


def test_takeover_publishes_will_of_first_connection(broker, clients):
    w = _watcher(clients, broker.port)
    cid = uid("tw")
    no_reconnect(clients(broker.port, client_id=cid, will={"topic": "will/to", "payload": b"old"}))
    clients(broker.port, client_id=cid)
    [m] = get_messages(w, 1)
    assert m.payload == b"old"
