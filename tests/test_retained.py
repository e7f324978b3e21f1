"""Retained messages at scale: what the retained tree counts against max_retained_bytes for
deep topics, and a SUBSCRIBE matching thousands of them sent a share per loop turn, in an
order MQTT allows, within the client's flow control, stopped by an UNSUBSCRIBE or a
disconnect. Real brokers (in-process and `wrenmq serve`), raw sockets."""

import socket
import time

from conftest import RawClient
from mqtt_helpers import wait_for
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.codec import encode
from wrenmq.mqtt.packets import (Connect, Pingreq, Puback, Publish, Subscribe, SubscribeTopic,
                                 Unsubscribe)


def connect(port, cid, version=5, props=None, clean=True):
    c = RawClient(port, version)
    c.send(Connect(cid, version, clean, 60, properties=props))
    ack = c.recv()
    assert ack.TYPE == C.CONNACK and ack.reason_code == 0, ack
    return c


def deep(i, levels):
    """Topic `i` of `levels` levels, parting from the others at its first level."""
    return str(i) + "/x" * (levels - 1)


def retain_many(port, n, levels, payload=b"r", qos=0):
    """Publish `n` retained messages on deep topics; return once they are handled."""
    p = connect(port, "retainer")
    for start in range(0, n, 500):  # (within the broker's receive maximum)
        p.send(b"".join(encode(Publish(deep(i, levels), payload, qos, True, packet_id=i % 500 + 1 if qos else None), 5)
                        for i in range(start, min(n, start + 500))))
        p.send(Pingreq())
        got = read_until(p, last=C.PINGRESP, timeout=60)
        assert got[-1].TYPE == C.PINGRESP and len(got) == (min(n, start + 500) - start if qos else 0) + 1
    p.close()


def stalled(port, cid, props=None):
    """A client that reads nothing after its CONNACK (until the test says): what the kernel
    takes for it (about 4 MB on loopback) fills, and then the broker's buffer."""
    c = RawClient(port, 5)
    c.send(Connect(cid, 5, True, 60, properties=props))
    assert c.recv().TYPE == C.CONNACK
    return c


def read_until(c, publishes=None, last=None, timeout=10.0):
    """Packets from `c` until `publishes` PUBLISHes or a packet of type `last` came (or
    `timeout` passed without a packet)."""
    got = []
    n = 0
    while publishes is None or n < publishes:
        try:
            pkt = c.recv(timeout=timeout)
        except TimeoutError:
            break
        if pkt is None:
            break
        got.append(pkt)
        n += pkt.TYPE == C.PUBLISH
        if pkt.TYPE == last:
            break
    return got


def retained_in(packets):
    return [p for p in packets if p.TYPE == C.PUBLISH and p.retain]


# --------------------------------------------------------------------------- what is counted

def test_deep_topics_count_what_the_retained_tree_holds(make_broker):
    """10,000 retained 1-byte messages on 128-level topics that part at the first level:
    each is counted with its message and its node (one node, not 128: a chain that does
    not branch is one node), so max_retained_bytes = 3,000,000 keeps about 2,000 of them
    and refuses the rest. The running sum is what the tree holds, counted afresh."""
    from wrenmq.broker.message import MESSAGE_OVERHEAD
    from wrenmq.broker.topics import RETAINED_NODE_COST

    b = make_broker("[limits]\nmax_retained_bytes = 3000000\n")
    retain_many(b.port, 10_000, 128)
    router = b.broker.router
    count, kept, memory = b.call(router.retained.recount)
    assert b.call(lambda: (router.retained.client_count, router.retained.memory)) == (kept, memory)
    assert memory <= 3_000_000
    topic = len(deep(9999, 128))
    assert 3_000_000 // (2 * topic + MESSAGE_OVERHEAD + RETAINED_NODE_COST + 2 * topic) <= kept < 3000
    assert router.stats.retained_refused == 10_000 - kept
    values = b.call(b.broker.sys_topics.snapshot)
    assert values["$SYS/broker/retained messages/bytes"] == memory


def test_deep_topics_rss_stays_near_what_is_counted(serve_broker, tmp_path):
    """The same against `wrenmq serve`, measured as the broker's RSS (a coarse bound: the
    margin itself is measured by `python -m wrenmq.bench.bounds retained`, docs/SECURITY.md):
    the RSS the retained messages take stays within a few times what max_retained_bytes
    counts for them, where a tree of a node per level held 120 times as much."""
    b = serve_broker('[storage]\nmode = "memory"\n[sys]\ninterval = 1\n'
                     '[limits]\nmax_retained_bytes = 3000000\n')

    def rss():
        with open(f"/proc/{b.proc.pid}/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))

    warm = connect(b.port, "warm")
    warm.send(Pingreq())
    assert warm.recv().TYPE == C.PINGRESP
    before = rss()
    retain_many(b.port, 10_000, 128)
    grown = rss() - before
    time.sleep(1.5)  # a $SYS update
    warm.send(Subscribe(1, [SubscribeTopic("$SYS/broker/retained messages/bytes")]))
    got = read_until(warm, 1)
    counted = int(next(p for p in got if p.TYPE == C.PUBLISH).payload)
    assert 2_000_000 < counted <= 3_000_000
    assert grown < 3 * counted + 8 * 2**20, (grown, counted)


# --------------------------------------------------------------------------- a large match

def test_a_large_retained_match_goes_out_over_loop_turns_and_before_what_follows(make_broker):
    """One write: SUBSCRIBE '#' (5,000 retained messages on 63-level topics), PINGREQ, and a
    new retained PUBLISH on the last of those topics. The PINGRESP comes back while the
    retained messages are still going out (the SUBSCRIBE did not hold the loop until the
    last one was written); every retained message arrives once; the new message comes
    after all of them, and the value it replaced, which the walk had not reached yet, is
    not sent after it (nor at all: the subscription got the new one live)."""
    n = 5000
    b = make_broker()
    retain_many(b.port, n, 63)
    c = connect(b.port, "big")
    last = deep(n - 1, 63)
    c.send(encode(Subscribe(1, [SubscribeTopic("#")]), 5) + encode(Pingreq(), 5)
           + encode(Publish(last, b"new", 0, True), 5))
    got = read_until(c, n)
    assert got[0].TYPE == C.SUBACK
    kinds = [p.TYPE for p in got]
    pong = kinds.index(C.PINGRESP)
    retained = retained_in(got)
    assert pong < got.index(retained[-1]), "the PINGRESP waited for every retained message"
    assert sorted(p.topic for p in retained) == sorted(deep(i, 63) for i in range(n - 1))
    live = [p for p in got if p.TYPE == C.PUBLISH and not p.retain]
    assert [(p.topic, p.payload) for p in live] == [(last, b"new")]
    assert got.index(live[0]) > got.index(retained[-1])
    assert b.call(lambda: b.broker.router.sessions["big"].retained_due) is None


def test_an_unrelated_client_is_served_while_a_large_match_waits_for_its_reader(make_broker):
    """A subscriber to '+/x/#' over 5,000 retained messages that does not read: its socket
    fills and the rest of its match waits (nothing dropped). Meanwhile another client
    subscribes and gets what a third publishes. Then the first reads: it gets every
    retained message once, and after them what was published for it while it waited."""
    n = 5000
    b = make_broker("[limits]\nwrite_buffer_high = 65536\n")
    retain_many(b.port, n, 63, b"r" * 2000)  # 10 MB
    slow = stalled(b.port, "slow")
    slow.send(Subscribe(1, [SubscribeTopic("+/x/#", 1)]))
    router = b.broker.router
    assert wait_for(lambda: b.call(lambda: router.sessions["slow"].conn.congested))
    other = connect(b.port, "other")
    other.send(Subscribe(1, [SubscribeTopic("elsewhere/#")]))
    assert other.recv().TYPE == C.SUBACK
    pub = connect(b.port, "pub")
    pub.send(Publish("elsewhere/y", b"hello", 0))
    pub.send(Publish("later/x/y", b"for slow", 1, False, packet_id=1))
    assert pub.recv().TYPE == C.PUBACK
    got = other.recv()
    assert (got.topic, got.payload) == ("elsewhere/y", b"hello")
    packets = read_until(slow, n + 1)
    publishes = [p for p in packets if p.TYPE == C.PUBLISH]
    retained = [p.topic for p in publishes if p.retain]
    assert sorted(retained) == sorted(deep(i, 63) for i in range(n))
    assert [(p.topic, p.qos) for p in publishes[n:]] == [("later/x/y", 1)]
    assert router.stats.pub_dropped == 0


def test_retained_messages_keep_to_the_window_and_go_before_live_ones(make_broker):
    """QoS 1, receive maximum 5, 1,500 retained messages (several turns' worth): never more
    than 5 unacknowledged, all of them arrive, and a QoS 1 message published after the
    SUBSCRIBE comes after the last of them."""
    n = 1500
    b = make_broker()
    retain_many(b.port, n, 8, qos=1)
    c = connect(b.port, "windowed", 5, {"receive_maximum": 5})
    c.send(Subscribe(1, [SubscribeTopic("+/#", 1)]))
    assert c.recv().TYPE == C.SUBACK
    pub = connect(b.port, "pub")
    pub.send(Publish(deep(7, 8), b"live", 1, False, packet_id=1))
    assert pub.recv().TYPE == C.PUBACK
    seen = []
    unacked = set()
    while len(seen) < n + 1:
        try:
            pkt = c.recv(timeout=0.3)
        except TimeoutError:
            assert unacked, f"stalled after {len(seen)} with nothing to acknowledge"
            pid = unacked.pop()
            c.send(Puback(pid))
            continue
        assert pkt.TYPE == C.PUBLISH and pkt.qos == 1
        unacked.add(pkt.packet_id)
        assert len(unacked) <= 5
        seen.append((pkt.topic, pkt.payload, pkt.retain))
        if len(unacked) == 5 or len(seen) % 3 == 0:
            c.send(b"".join(encode(Puback(pid), 5) for pid in unacked))
            unacked.clear()
    assert sorted(t for t, _, r in seen if r) == sorted(deep(i, 8) for i in range(n))
    assert seen[-1] == (deep(7, 8), b"live", False)


def test_unsubscribe_stops_the_retained_messages_still_to_send(make_broker):
    """A subscriber with a window of 10 subscribes at QoS 1 to 2,000 retained messages and
    acknowledges none: 10 come. It unsubscribes, then acknowledges them: nothing follows,
    and nothing is left counted for the rest."""
    n = 2000
    b = make_broker()
    retain_many(b.port, n, 8, qos=1)
    c = connect(b.port, "fickle", 5, {"receive_maximum": 10})
    c.send(Subscribe(1, [SubscribeTopic("#", 1)]))
    got = read_until(c, 10)
    assert got[0].TYPE == C.SUBACK and len(retained_in(got)) == 10
    c.send(Unsubscribe(2, ["#"]))
    assert c.recv().TYPE == C.UNSUBACK
    c.send(b"".join(encode(Puback(p.packet_id), 5) for p in retained_in(got)))
    assert read_until(c, timeout=1.0) == []
    router = b.broker.router
    assert b.call(lambda: (router.sessions["fickle"].retained_due, router.queued_bytes)) == (None, 0)


def test_what_waited_behind_stopped_retained_messages_goes_on_in_order(make_broker):
    """Live QoS 0 messages for a session wait behind its pending retained messages. When an
    UNSUBSCRIBE stops those, the waiting ones go at once, and a later one after them."""
    b = make_broker()
    retain_many(b.port, 2000, 8, qos=1)
    c = connect(b.port, "mixed", 5, {"receive_maximum": 10})
    c.send(Subscribe(1, [SubscribeTopic("+/x/#", 1), SubscribeTopic("live/#", 0)]))
    assert len(retained_in(read_until(c, 10))) == 10  # its window is full: the rest waits
    pub = connect(b.port, "pub")
    for i in range(3):
        pub.send(Publish("live/t", b"%d" % i, 1, False, packet_id=i + 1))
        assert pub.recv().TYPE == C.PUBACK
    c.send(Unsubscribe(2, ["+/x/#"]))
    got = read_until(c, 3)
    assert [p.TYPE for p in got] == [C.UNSUBACK] + [C.PUBLISH] * 3
    pub.send(Publish("live/t", b"3", 0))
    got += read_until(c, 1)
    assert [p.payload for p in got if p.TYPE == C.PUBLISH] == [b"0", b"1", b"2", b"3"]


def test_a_disconnect_midway_stops_them_cleanly(make_broker):
    """A persistent session's client subscribes to '#' over 5,000 retained messages, stops
    reading and drops its connection: the walk is let go (nothing counted for it in
    queue_memory), the session stays, and subscribing again gets every one."""
    n = 5000
    b = make_broker("[limits]\nwrite_buffer_high = 65536\n")
    retain_many(b.port, n, 63, b"r" * 2000)  # 10 MB
    stay = {"session_expiry_interval": 600}
    c = stalled(b.port, "leaver", stay)
    c.send(Subscribe(1, [SubscribeTopic("#")]))
    router = b.broker.router
    assert wait_for(lambda: b.call(lambda: router.sessions["leaver"].conn.congested))
    assert b.call(lambda: router.queued_bytes) > 0  # the walk's list of nodes
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    c.close()  # a reset
    assert wait_for(lambda: b.call(lambda: router.sessions["leaver"].conn is None))
    assert b.call(lambda: (router.sessions["leaver"].retained_due, router.queued_bytes)) == (None, 0)
    back = connect(b.port, "leaver", 5, stay, clean=False)
    back.send(Subscribe(2, [SubscribeTopic("#")]))
    got = read_until(back, n)
    assert sorted(p.topic for p in retained_in(got)) == sorted(deep(i, 63) for i in range(n))


def test_subscribing_again_and_again_holds_one_walk(make_broker):
    """A client that does not read sends SUBSCRIBE '#' 300 times: each starts its retained
    messages over (MQTT's retain handling 0) in the place of the last, so the session
    holds one walk, not 300, and the memory counted for it does not grow."""
    n = 5000
    b = make_broker("[limits]\nwrite_buffer_high = 65536\n")
    retain_many(b.port, n, 63, b"r" * 2000)  # 10 MB
    c = stalled(b.port, "again")
    router = b.broker.router
    c.send(Subscribe(1, [SubscribeTopic("#")]))
    assert wait_for(lambda: b.call(lambda: router.sessions["again"].conn.congested))
    first = b.call(lambda: router.queued_bytes)
    c.send(b"".join(encode(Subscribe(2 + i, [SubscribeTopic("#")]), 5) for i in range(300)))
    c.send(Pingreq())
    time.sleep(1.0)
    due, counted = b.call(lambda: (list(router.sessions["again"].retained_due or ()), router.queued_bytes))
    assert due == ["#"] and counted <= first
    c.close()


def test_the_walk_is_bounded_by_queue_memory(make_broker, caplog):
    """What a walk holds (a list of the nodes it has still to visit) counts in queue_memory:
    past it, the rest of that SUBSCRIBE's retained messages is dropped and counted."""
    n = 5000
    b = make_broker("[limits]\nqueue_memory = 20000\n")
    retain_many(b.port, n, 4)
    c = connect(b.port, "greedy")
    c.send(Subscribe(1, [SubscribeTopic("#")]))
    got = read_until(c, timeout=1.0)
    assert got[0].TYPE == C.SUBACK and 0 < len(retained_in(got)) < n
    router = b.broker.router
    assert b.call(lambda: (router.sessions["greedy"].retained_due, router.queued_bytes,
                           router.stats.pub_dropped)) == (None, 0, 1)
    assert "queue_memory 20000" in caplog.text
