"""Retained messages at scale: what the retained tree counts against max_retained_bytes for
deep topics. Real brokers (in-process and `wrenmq serve`), raw sockets."""

import time

from conftest import RawClient
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.codec import encode
from wrenmq.mqtt.packets import Connect, Pingreq, Publish, Subscribe, SubscribeTopic


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
