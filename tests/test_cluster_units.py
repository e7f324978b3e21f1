"""The cluster's sans-IO parts, without etcd, a broker or a socket: the link's frames
(frames.py), who wants what (interest.py), a session as data (handover.py) and the
shared groups' choices kept for replays (replay.GroupsSent).
"""

import pytest

from wrenmq.cluster import frames as F
from wrenmq.cluster.interest import (LocalInterest, RemoteInterest, parse_route_key, parse_route_value, route_key,
                                     route_value)
from wrenmq.cluster.replay import GroupsSent
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.codec import encode
from wrenmq.mqtt.packets import Publish


FORWARDS = [
    # (flags, client id, timestamp, groups, PUBLISH, offset in the sender's log)
    (F.TO_SUBSCRIBERS, "dev-1", 1.5, [], Publish("a/b", b"payload", 0, properties={}), 0),
    (F.TO_SUBSCRIBERS | F.SET_RETAINED, "", 0.0, [], Publish("a/b", b"", 1, True, packet_id=1, properties={}),
     2**40 + 7),
    (F.SYNC, "d", 2.0, [], Publish("r", b"x" * 70000, 2, True, packet_id=1, properties={"content_type": "t"}), -1),
    (0, "d\u00e9", 3.25, [("g", "s/#"), ("h", "+/x")], Publish("s/x", b"1", 1, packet_id=1,
                                                                properties={"user_property": [("k", "v")]}), 12),
]


@pytest.mark.parametrize("case", FORWARDS, ids=range(len(FORWARDS)))
def test_forward_frames_round_trip(case):
    flags, cid, ts, groups, pkt, offset = case
    frame = F.encode_forward(encode(pkt, C.MQTT5), flags, cid, ts, groups, offset)
    reader = F.FrameReader(1 << 20)
    frames = []
    for i in range(0, len(frame), 7):  # in pieces, as a socket delivers them
        frames += reader.feed(frame[i:i + 7])
    assert len(frames) == 1 and reader.buffered == 0
    kind, body = frames[0]
    assert kind == F.FORWARD
    got = F.decode_forward(body)
    assert got[:4] == (flags, cid, ts, groups) and got[5] == offset
    assert (got[4].topic, bytes(got[4].payload), got[4].qos, got[4].retain) == (pkt.topic, pkt.payload, pkt.qos, pkt.retain)
    assert (got[4].properties or {}) == pkt.properties
    # The same message for other groups, as an old node passes it on (Moves.relay_groups).
    again = F.decode_forward(F.regroup_forward(body, 0, [("k", "s/+")]))
    assert again[:4] == (0, cid, ts, [("k", "s/+")]) and again[5] == offset
    assert (again[4].topic, bytes(again[4].payload), again[4].qos) == (pkt.topic, pkt.payload, pkt.qos)


def test_hello_resume_round_trip_and_bad_frames():
    kind, body = F.FrameReader(1024).feed(F.encode_hello("c", "n", "s", "0123abcd", 4096, "r"))[0]
    assert kind == F.HELLO and F.decode_hello(body) == ("c", "n", "s", "0123abcd", 4096, "r")
    for offset in (-1, 0, 2**40):
        kind, body = F.FrameReader(1024).feed(F.encode_resume(offset, 77))[0]
        assert kind == F.RESUME and F.decode_resume(body) == (offset, 77)
    assert F.decode_resume(b'{"offset": 5}') == (5, 0)  # (a node that does not say where its filters are)
    with pytest.raises(F.FrameError):
        F.decode_resume(b'{"offset": "x"}')
    for group, flt, online, removed in ((None, "a/+/#", True, False), ("g", "s/#", False, False),
                                        (None, "a/+/#", False, True)):
        kind, body = F.FrameReader(1024).feed(F.encode_route(9, group, flt, online, removed))[0]
        assert kind == F.ROUTE and F.decode_route(body) == (9, group, flt, online, removed)
    kind, body = F.FrameReader(1024).feed(F.encode_route_ack(9))[0]
    assert kind == F.ROUTE_ACK and F.decode_route_ack(body) == 9
    kind, body = F.FrameReader(1024).feed(F.encode_mark(41))[0]
    assert kind == F.MARK and F.decode_mark(body) == 41
    with pytest.raises(F.FrameError):
        F.decode_route(b'{"seq": 1}')
    with pytest.raises(F.FrameError):
        F.FrameReader(1024).feed(b"\x00\x01\x00\x00\x02")  # larger than allowed
    with pytest.raises(F.FrameError):
        F.FrameReader(1024).feed(b"\x00\x00\x00\x00\x02")  # empty
    with pytest.raises(F.FrameError):
        F.decode_hello(b"not json")
    good = F.encode_forward(encode(Publish("t", b"x"), C.MQTT5), 1, "c", 0.0)
    for cut in (3, 12, len(good) - 1):
        with pytest.raises(F.FrameError):
            F.decode_forward(good[5:cut])
    with pytest.raises(F.FrameError):  # not a PUBLISH inside
        F.decode_forward(good[5:5 + 22] + b"\xc0\x00")  # (header 19, client id 1, group count 2)
    kind, body = F.FrameReader(1024).feed(F.encode_relay("dev-7", "0123abcd", good[5:]))[0]
    cid, origin, inner = F.decode_relay(body)
    assert kind == F.RELAY and (cid, origin, bytes(inner)) == ("dev-7", "0123abcd", good[5:])
    assert F.decode_forward(inner)[4].topic == "t"
    for cut in (1, 8, 14):
        with pytest.raises(F.FrameError):
            F.decode_relay(body[:cut])


def test_groups_sent_remembers_the_last_choices_by_offset():
    sent = GroupsSent(kept=3)
    g, h = ("g", "s/#"), ("h", "s/+")
    assert sent.add(10, [g]) == -1 and sent.add(11, [g, h]) == -1 and sent.add(12, [g]) == -1
    assert sent.get(10) == (g,) and sent.get(11) == (g, h) and sent.get(9) == ()
    assert sent.get(10) is sent.get(12)  # one tuple for the same groups
    assert sent.add(13, [h]) == 10  # full: the oldest is forgotten, and said
    assert sent.get(10) == () and sent.get(13) == (h,)
    sent.forget_before(13)  # the node has everything before 13
    assert sent.get(11) == sent.get(12) == () and sent.get(13) == (h,) and list(sent.order) == [13]


def test_interest_counts_and_matches():
    local = LocalInterest()
    assert local.add(None, "a/#") and not local.add(None, "a/#")
    assert not local.remove(None, "a/#") and local.remove(None, "a/#")
    assert not local.remove(None, "a/#")
    # A group's key says whether a member is connected.
    assert local.add("g", "s/#", online=False) and local.value("g", "s/#") == b"0"
    assert local.connected("g", "s/#", 1) and local.value("g", "s/#") == b"1"
    assert not local.add("g", "s/#", online=True)  # a second connected member: no change
    assert local.remove("g", "s/#", online=True) is None
    assert local.remove("g", "s/#", online=True) == "delete"
    assert local.add("g", "s/#", online=True) and not local.add("g", "s/#", online=False)
    assert local.remove("g", "s/#", online=True) == "update" and local.value("g", "s/#") == b"0"
    r = RemoteInterest()
    r.add("n1", None, "a/#")
    r.add("n2", None, "a/+")
    r.add("n2", "g", "a/#", online=False)
    r.add("n3", "g", "a/#")
    assert r.match("a/b") == (frozenset({"n1", "n2"}), {("g", "a/#"): (("n3",), ("n2", "n3"))})
    assert r.match("$SYS/x") == (frozenset(), {})
    r.add("n2", "g", "a/#", online=True)
    assert r.match("a/b")[1] == {("g", "a/#"): (("n2", "n3"), ("n2", "n3"))}
    r.drop_node("n2")
    assert r.match("a/b") == (frozenset({"n1"}), {("g", "a/#"): (("n3",), ("n3",))})
    r.remove("n1", None, "a/#")
    assert r.match("a/b") == (frozenset(), {("g", "a/#"): (("n3",), ("n3",))})


def test_remote_interest_takes_the_newest_of_link_and_etcd():
    assert parse_route_value(route_value(b"", 7)) == (True, 7)
    assert parse_route_value(route_value(b"0", 8)) == (False, 8)
    assert parse_route_value(b"1") == (True, 0) and parse_route_value(b"0@x") == (False, 0)
    r = RemoteInterest()
    nodes = lambda: r.match("t/x")[0]  # noqa: E731
    # Unsubscribed (etcd delete in flight), subscribed again over the link: etcd's late
    # delete of the value of change 1 does not undo change 3; its put of change 3 is taken.
    r.put("n1", None, "t/#", True, 1)
    r.linked("n1", None, "t/#", False, True, 2)
    assert nodes() == frozenset()
    r.linked("n1", None, "t/#", True, False, 3)
    r.deleted("n1", None, "t/#", 1)
    assert nodes() == {"n1"}
    r.put("n1", None, "t/#", True, 3)
    assert nodes() == {"n1"} and not r._told
    # A late put older than the link's removal does not add the filter back; the delete
    # that follows it settles it.
    r.linked("n1", None, "t/#", False, True, 4)
    r.put("n1", None, "t/#", True, 3)
    assert nodes() == frozenset()
    r.deleted("n1", None, "t/#", 3)
    assert nodes() == frozenset() and not r._told
    # Without a link, etcd decides; a delete newer than the link's add removes.
    r.put("n2", None, "t/+", True, 5)
    r.linked("n2", None, "t/+", True, False, 6)
    r.deleted("n2", None, "t/+", 7)
    assert nodes() == frozenset()
    # Rereading etcd keeps what the links said since; a node that leaves takes it along.
    r.linked("n3", "g", "t/#", True, False, 9)
    r.clear()
    r.restore_told()
    assert r.match("t/x")[1] == {("g", "t/#"): (("n3",), ("n3",))}
    r.drop_node("n3")
    assert r.match("t/x") == (frozenset(), {}) and not r._told
    # Removals etcd never hears of (added and removed before the node wrote etcd): the
    # oldest are let go past TOLD_MAX.
    for i in range(RemoteInterest.TOLD_MAX + 5):
        r.linked("n4", None, f"c/{i}", True, False, 10 + 2 * i)
        r.linked("n4", None, f"c/{i}", False, True, 11 + 2 * i)
    assert len(r._told) == RemoteInterest.TOLD_MAX and ("n4", None, "c/4") not in r._told
    assert ("n4", None, "c/5") in r._told and r.match("c/1") == (frozenset(), {})


@pytest.mark.parametrize("group,flt", [(None, "a/b/#"), ("g1", "+/x"), (None, "/lead/slash"), ("g", "#")])
def test_route_keys_round_trip(group, flt):
    prefix = "/wrenmq/c/"
    key = route_key(prefix, "node-1", group, flt).decode()
    assert parse_route_key(key[len(prefix) + len("routes/"):]) == ("node-1", group, flt)


def test_link_frames_from_garbage_only_ever_raise_frame_error():
    """Whatever bytes a peer sends, the reader and decoders answer with FrameError (the
    link is closed) or frames; nothing else escapes to crash the node's loop."""
    from hypothesis import given, settings, strategies as st

    good = F.encode_forward(encode(Publish("a/b", b"x", 1, packet_id=1, properties={"content_type": "t"}), C.MQTT5),
                            F.TO_SUBSCRIBERS, "c", 1.0, [("g", "a/#")])

    @settings(max_examples=400, deadline=None)
    @given(st.one_of(st.binary(max_size=200),
                     st.builds(lambda i, b: good[:i] + b + good[i + len(b):], st.integers(0, len(good)),
                               st.binary(min_size=1, max_size=8))))
    def check(data):
        decoders = (F.decode_forward, F.decode_hello, F.decode_resume, F.decode_route, F.decode_route_ack,
                    F.decode_mark, F.decode_session_ask, F.decode_session, F.decode_relay)
        try:
            frames = F.FrameReader(4096).feed(data)
        except F.FrameError:
            return
        for kind, body in frames:
            for dec in decoders:
                try:
                    dec(body)
                except F.FrameError:
                    pass
        d = F.forward_decoder()
        for kind, body in frames:
            try:
                F.decode_forward(body, d)
            except F.FrameError:
                pass

    check()




def test_remote_interest_keeps_a_read_of_etcd_and_the_groups_of_nodes_that_left():
    r = RemoteInterest()
    nodes = lambda: r.match("t/x")[0]  # noqa: E731
    # Read from etcd before a replay (change 5): the watch's late delete of the value of
    # change 2 (before the node wrote the filter again) does not undo it, etcd's delete of
    # that value does, and a link's news newer than the read wins over it.
    r.read("n1", None, "t/#", True, 5)
    r.deleted("n1", None, "t/#", 2)
    assert nodes() == {"n1"}
    r.put("n1", None, "t/#", True, 5)
    r.deleted("n1", None, "t/#", 5)
    assert nodes() == frozenset() and not r._told
    r.linked("n1", None, "t/#", False, True, 8)
    r.read("n1", None, "t/#", True, 7)
    assert nodes() == frozenset()
    # A node that leaves keeps its groups (not its plain filters) until it is back, also
    # across leaving again before that with groups it had not told before.
    r.add("n2", "g", "t/#", online=True)
    r.add("n2", None, "t/+")
    r.left("n2")
    assert r.match("t/x") == (frozenset(), {})
    assert r.left_groups("t/x") == {("g", "t/#"): ("n2",)} and r.left_groups("u/x") == {}
    r.add("n2", "h", "t/x")
    r.left("n2")
    assert r.left_groups("t/x") == {("g", "t/#"): ("n2",), ("h", "t/x"): ("n2",)}
    r.add("n3", "g", "t/#")
    r.left("n3")
    assert r.left_groups("t/x")[("g", "t/#")] == ("n2", "n3")
    r.back("n2")
    r.back("n3")
    assert r.left_groups("t/x") == {} and not r.left_nodes


def test_a_session_as_data_and_back_is_the_same_session():
    """handover.py: a session becomes data (`session_state`), goes as a SESSION frame and
    comes back (`build_session`) with its subscriptions (a shared one too), the inbound
    QoS 2 ids still open, its in-flight messages with their packet ids and PUBREL state,
    and its queue in order; a message past the size bound is left out and counted."""
    from collections import deque

    from wrenmq.broker.message import Message
    from wrenmq.broker.session import Outgoing, Session, Subscription
    from wrenmq.cluster.handover import build_session, session_state

    s = Session("dev-9")
    s.version, s.v5, s.expiry_interval = 5, True, 3600
    s.subscriptions["a/#"] = Subscription("a/#", 1, True, True, 1, 7, None, s)
    s.subscriptions["$share/g/s/+"] = Subscription("s/+", 2, False, False, 0, None, "g", s)

    def owed(topic, payload, qos, pid=0, released=False):
        msg = Message(topic, payload, qos, False, {"content_type": "t"}, None, "pub-1", timestamp=12.5)
        out = Outgoing(msg, qos, False, (7,))
        out.packet_id, out.released = pid, released
        return out

    s.inflight = {5: owed("a/1", b"one", 1, 5), 6: owed("a/2", b"two", 2, 6, released=True)}
    s.queue = deque([owed("a/3", b"three", 1), owed("a/4", b"x" * 5000, 1), owed("a/5", b"five", 2)])
    s.add_incoming_qos2(3)
    state, pubs = session_state(s, 41, 100.0, 1000)  # (the 5,000-byte message does not fit)
    kind, body = F.FrameReader(1 << 20).feed(F.encode_session(state, pubs))[0]
    assert kind == F.SESSION
    state, pkts = F.decode_session(body)
    assert (state["id"], state["cid"], state["found"], state["dropped"]) == (41, "dev-9", True, 1)

    t, queued = build_session(state, pkts, lambda: 100.0, 1234)
    assert (t.client_id, t.version, t.v5, t.expiry_interval) == ("dev-9", 5, True, 3600)
    assert {full: (sub.filter, sub.group, sub.qos, sub.no_local, sub.retain_as_published, sub.retain_handling,
                   sub.sub_id, sub.since, sub.session is t) for full, sub in t.subscriptions.items()} == {
        "a/#": ("a/#", None, 1, True, True, 1, 7, 1234, True),
        "$share/g/s/+": ("s/+", "g", 2, False, False, 0, None, 1234, True)}
    assert t.incoming_qos2 == {3}
    assert [(pid, out.packet_id, out.qos, out.released, out.maybe_sent, out.msg.topic, bytes(out.msg.payload))
            for pid, out in t.inflight.items()] == [(5, 5, 1, False, True, "a/1", b"one"),
                                                    (6, 6, 2, True, True, "a/2", b"two")]
    assert t.next_pid == 7 and t.inflight_bytes == sum(out.size for out in t.inflight.values())
    assert [(out.msg.topic, bytes(out.msg.payload), out.qos, out.sub_ids, out.packet_id) for out in queued] == [
        ("a/3", b"three", 1, (7,), 0), ("a/5", b"five", 2, (7,), 0)]
    msg = queued[0].msg
    assert (msg.client_id, msg.timestamp, msg.properties) == ("pub-1", 12.5, {"content_type": "t"})
