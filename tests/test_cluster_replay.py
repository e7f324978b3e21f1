"""A node killed (SIGKILL) and restarted on its data dir gets, by replay from the other
nodes' logs, what they acknowledged for its persistent sessions while it was down.

Real `wrenmq serve` nodes, one real etcd for the module (test_cluster's fixtures) and
paho clients. The restarted node reaches etcd through a relay that delays its requests:
its filters land in etcd well after the registration the other nodes link to it on, a
window a replay to it must not run in without them.
"""

import time

import pytest

from conftest import free_port
from mqtt_helpers import drain, publish, sub, uid, wait_for
from test_cluster import SlowLink, await_route, cluster, disk, etcd, publish_all, sys_value  # noqa: F401 (fixtures)


@pytest.fixture
def slow_etcd(etcd):
    """The module's etcd behind a relay that hands on each request 0.2 s late (the answers
    come back at once): `.port`. A node that reaches etcd through it writes its filters
    well after the registration the other nodes link to it on."""
    relay = SlowLink(int(etcd.endpoint.rsplit(":", 1)[1]), 0.2)
    yield relay
    relay.close()


def persistent(cl, node, cid, version):
    """A client of `node` whose session outlives its connection (3.1.1 clean session 0,
    5.0 session expiry 3600)."""
    if version == 5:
        return cl.client(node, client_id=cid, version=5, clean=False, properties={"SessionExpiryInterval": 3600})
    return cl.client(node, client_id=cid, version=4, clean=False)


def restart_elsewhere(cl, node, name, **over):
    """Start a killed node again on its data dir, with its link on a new port (and
    `over` in [cluster]): the other nodes can reach it only at the address it registers,
    once it has rejoined, not at the old one while they still count it in."""
    link = free_port()
    cfg = node.cmd[node.cmd.index("--config") + 1]
    with open(cfg, "w") as f:
        f.write(cl.config(name, link, storage=disk(cl, name), **over))
    node.link_port = link
    node.start()


def collect_all(clients, n, timeout=20.0):
    """What each of `clients` receives until each has `n` messages (or `timeout`), probes
    left out: a list per client, in arrival order."""
    got = [[] for _ in clients]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i, c in enumerate(clients):
            got[i] += [m.payload for m in drain(c) if m.payload != b"probe"]
        if all(len(g) >= n for g in got):
            break
        time.sleep(0.1)
    time.sleep(0.3)  # (and nothing more comes)
    for i, c in enumerate(clients):
        got[i] += [m.payload for m in drain(c) if m.payload != b"probe"]
    return got


TTL = 3  # lease_ttl of these clusters (s): the outage is made shorter or longer than it


@pytest.mark.parametrize("outage", ["short", "long"])
@pytest.mark.parametrize("at_kill", ["connected", "disconnected"])
def test_a_killed_node_gets_what_the_others_acknowledged_meanwhile(cluster, etcd, slow_etcd, at_kill, outage):
    # Persistent sessions on node a, 3.1.1 and 5.0, subscribed to x/# and members of
    # shared groups with no member elsewhere, connected or cleanly disconnected when a
    # is killed. Nodes b and c acknowledge 100 QoS 1 messages for them while a is down,
    # for less than its lease (its keys still in etcd) or longer (it has left the
    # cluster). Restarted on its data dir, a rejoins and each session gets every one.
    cl = cluster(lease_ttl=TTL)
    a = cl.start("a", storage=disk(cl, "a"))
    cl.start("b", storage=disk(cl, "b"))
    cl.start("c", storage=disk(cl, "c"))
    sessions = []  # (client id, version, filter, client)
    for version in (4, 5):
        for flt in (f"$share/g{version}/x/#", "x/#"):
            cid = uid(f"v{version}")
            client = persistent(cl, "a", cid, version)
            sub(client, flt, 1)
            sessions.append((cid, version, flt, client))
    pb, pc = cl.client("b"), cl.client("c")
    await_route(pb, sessions[-1][3], "x/probe")  # (the groups' routes were written before)
    await_route(pc, sessions[-1][3], "x/probe")
    for *_, client in sessions:
        client._reconnect_on_failure = False
        if at_kill == "disconnected":
            client.disconnect()
    time.sleep(0.3)  # (the DISCONNECTs reach node a)
    a.kill()
    for *_, client in sessions:
        client.loop_stop()
    keys = f"/wrenmq/{cl.name}/"
    if outage == "long":
        for name in "bc":
            assert wait_for(lambda: nodes_seen(cl, name) == "2", timeout=TTL + 5), f"node {name} still counts a in"
    sent = [b"b%d" % i for i in range(50)] + [b"c%d" % i for i in range(50)]
    publish_all(pb, "x/b", sent[:50])
    publish_all(pc, "x/c", sent[50:])
    if outage == "short":
        assert etcd.keys(f"{keys}routes/a/"), "node a's lease ran out before the messages were acknowledged"
    restart_elsewhere(cl, a, "a", etcd=[f"127.0.0.1:{slow_etcd.port}"])
    again = []
    for cid, version, *_ in sessions:
        again.append(persistent(cl, "a", cid, version))
        assert again[-1].connack[1].session_present
    for (cid, version, flt, _), got in zip(sessions, collect_all(again, len(sent))):
        assert sorted(got) == sorted(sent), f"{flt} (MQTT {version}): {len(got)} of {len(sent)}"


def nodes_seen(cl, name):
    """How many nodes node `name` counts in the cluster (itself included), from $SYS."""
    return sys_value(lambda: cl.client(name), "$SYS/broker/cluster/nodes")


def test_a_group_whose_members_all_left_with_their_node_gets_what_was_sent_meanwhile(cluster):
    # Two nodes. The only member of a shared group is a persistent session on node a; a
    # is killed and its lease runs out: node b is alone, no node has a member of the
    # group. What b acknowledges for it meanwhile (a retained message too) waits in b's
    # log for a, which comes back with the session and gets each message.
    cl = cluster(lease_ttl=TTL)
    a = cl.start("a", storage=disk(cl, "a"))
    cl.start("b", storage=disk(cl, "b"))
    cid = uid("m")
    member = persistent(cl, "a", cid, 5)
    sub(member, "$share/g/y/#", 1)
    pub = cl.client("b")
    await_route(pub, member, "y/probe")
    member._reconnect_on_failure = False
    a.kill()
    member.loop_stop()
    assert wait_for(lambda: nodes_seen(cl, "b") == "1", timeout=TTL + 5)
    sent = [b"%d" % i for i in range(20)]
    publish_all(pub, "y/1", sent[:19])
    publish(pub, "y/r", sent[19], 1, retain=True)
    a.start()
    again = persistent(cl, "a", cid, 5)
    assert again.connack[1].session_present
    assert sorted(collect_all([again], len(sent))[0]) == sorted(sent)


def test_a_session_still_owed_messages_at_a_crash_gets_what_came_meanwhile_once(cluster):
    # A persistent QoS 2 session on node a has messages from node b in flight (its client
    # takes nothing more) when a is killed: restarted, a reads the session's messages back
    # from its log, from the first one not acknowledged. What b acknowledged meanwhile
    # reaches a by replay, each in a's log (a private record) and owed to the session: the
    # client, back, gets every message once, not once from the replay and again from the log.
    cl = cluster(lease_ttl=TTL)
    a = cl.start("a", storage=disk(cl, "a"))
    cl.start("b", storage=disk(cl, "b"))
    cid = uid("q2")
    member = persistent(cl, "a", cid, 5)
    sub(member, "z/#", 2)
    pub = cl.client("b")
    await_route(pub, member, "z/probe")
    member._reconnect_on_failure = False
    member.loop_stop()  # (its socket stays open: what a sends it now stays in flight)
    sent = [b"%d" % i for i in range(50)]
    publish_all(pub, "z/b", sent[:10], qos=2)
    time.sleep(0.5)  # (a has them in flight to the client, in its state database)
    a.kill()
    publish_all(pub, "z/b", sent[10:], qos=2)
    a.start()
    again = persistent(cl, "a", cid, 5)
    assert again.connack[1].session_present
    got = collect_all([again], len(sent))[0]
    assert sorted(got, key=int) == sent, f"{len(got)} messages for {len(sent)} sent"
