"""A node restarted after kill -9 takes back only the clients that did not come back elsewhere.

Real `wrenmq serve` nodes with disk storage, one real etcd for the module (test_cluster's
fixtures) and paho clients. While a node is down, some of its clients reconnect to another
node with clean start 0 and start a new session there; when the node comes back on its data
dir, the sessions it restores for them are stale: it must not register those clients as its
own again (the node they are on would close their live connection and end their session)
nor publish their wills; the others get their sessions back as they were.
"""

import time

from mqtt_helpers import drain, sub, uid, wait_for
from test_cluster import (await_route, cluster, collect, disk, etcd, publish_all,  # noqa: F401 (fixtures)
                          sys_value)

TTL = 3  # lease_ttl of the cluster (s)


def persistent(cl, node, cid, version, **kw):
    """A client of `node` whose session outlives its connection (3.1.1 clean session 0, 5.0
    session expiry 3600), that does not reconnect by itself."""
    if version == 5:
        kw["properties"] = {"SessionExpiryInterval": 3600}
    c = cl.client(node, client_id=cid, version=version, clean=False, **kw)
    c._reconnect_on_failure = False
    return c


def test_a_restarted_node_takes_back_only_the_clients_that_did_not_come_back_elsewhere(cluster, etcd):
    cl = cluster(lease_ttl=TTL)
    a = cl.start("a", storage=disk(cl, "a"))
    cl.start("b", storage=disk(cl, "b"))
    cl.start("c", storage=disk(cl, "c"))
    topic = uid("rc")
    watcher = cl.client("b")  # every will published anywhere
    sub(watcher, f"will/{topic}/#", 1)
    # On node a: persistent subscribers with a will, 3.1.1 and 5.0 at QoS 1 and 2. The
    # movers reconnect to node c while a is down; the stayers reconnect nowhere until a is back.
    movers = [(uid(f"mv{v}{q}"), v, q) for v in (4, 5) for q in (1, 2)]
    stayers = [(uid("st41"), 4, 1), (uid("st52"), 5, 2)]
    first = {}
    for cid, version, qos in movers + stayers:
        first[cid] = persistent(cl, "a", cid, version, will={"topic": f"will/{topic}/{cid}", "payload": b"gone"})
        sub(first[cid], f"{topic}/#", qos)
    pub = cl.client("b")
    await_route(pub, first[stayers[-1][0]], f"{topic}/probe")
    publish_all(pub, f"{topic}/x", [b"m%d" % i for i in range(5)], qos=2)
    for cid, client in first.items():
        assert collect(client, 5) == [b"m%d" % i for i in range(5)], cid
    time.sleep(1.2)  # (node a saves how far it got in b's log once a second)
    a.kill()
    for client in first.values():
        client.loop_stop()
    keys = f"/wrenmq/{cl.name}/"
    assert wait_for(lambda: not etcd.keys(f"{keys}nodes/a"), TTL + 5), "node a's lease did not run out"

    # The movers come back on node c: node a does not answer, so new sessions (present 0).
    moved = {}
    for cid, version, qos in movers:
        moved[cid] = persistent(cl, "c", cid, version)
        assert moved[cid].connack[1].session_present is False, cid
        sub(moved[cid], f"{topic}/#", qos)
    await_route(pub, moved[movers[-1][0]], f"{topic}/probe")
    publish_all(pub, f"{topic}/x", [b"n%d" % i for i in range(5)], qos=2)

    a.start()  # on its data dir: it restores all six sessions
    publish_all(pub, f"{topic}/x", [b"p%d" % i for i in range(5)], qos=2)
    after = [b"n%d" % i for i in range(5)] + [b"p%d" % i for i in range(5)]
    for cid, client in moved.items():  # on c, each message once, in order
        assert collect(client, len(after)) == after, cid
    owner = lambda cid: etcd.ctl("get", f"{keys}clients/{cid}", "--print-value-only").stdout.strip()  # noqa: E731
    assert {cid: owner(cid) for cid, *_ in movers} == {cid: "c" for cid, *_ in movers}
    assert {cid: owner(cid) for cid, *_ in stayers} == {cid: "a" for cid, *_ in stayers}
    # Node a ended the movers' restored sessions (counted as taken over) and did not close
    # the movers' connections on c.
    assert wait_for(lambda: sys_value(lambda: cl.client("a"), "$SYS/broker/cluster/takeovers") == "4", 5)
    assert [cid for cid, client in moved.items() if client.disconnected_event.is_set()] == []
    # The stayers' wills went when node a came back (their clients did not); the movers' did not.
    wills = []
    wait_for(lambda: wills.extend(m.topic for m in drain(watcher)) or len(wills) >= len(stayers), 10, 0.1)
    wills += [m.topic for m in drain(watcher, 1.0)]
    assert sorted(wills) == sorted(f"will/{topic}/{cid}" for cid, *_ in stayers)

    # The stayers get their sessions back from node a, with every message owed them.
    for cid, version, qos in stayers:
        again = persistent(cl, "a", cid, version)
        assert again.connack[1].session_present is True, cid
        got = collect(again, len(after))
        if qos == 1:  # (QoS 1 may bring again what a took from b in its last second)
            got = [p for p in got if not p.startswith(b"m")]
        assert got == after, cid
