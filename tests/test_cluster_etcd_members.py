"""A cluster on an etcd of three members, one of which is killed: every etcd user of a node
(its membership session, the bridges' ownership, `wrenmq cluster status`) goes on through
the other members, and the node stays in the cluster.

Real `wrenmq serve` nodes reaching etcd directly, three real etcd processes on loopback
forming one etcd cluster (cluster_harness.EtcdCluster), real MQTT clients; the member
killed is the one the node says it uses (`$SYS/broker/cluster/etcd/endpoint`).
"""

import json
import subprocess
import time

import pytest

from bridge_helpers import collect
from cluster_harness import EtcdCluster
from conftest import WRENMQ, free_port, paho_client, subscribe
from mqtt_helpers import drain, publish, sub, wait_for
from test_bridge import edge_config
from test_cluster import Cluster, await_route, sys_value

LEASE_TTL = 4
# Seconds after a kill by which a lease nobody kept alive is gone: its TTL, and what etcd
# adds when the member killed was its leader (the election, then the new leader's extension
# of every lease by an election timeout, 1 s here).
EXPIRED_AFTER = LEASE_TTL + 3


class Members(EtcdCluster):
    """cluster_harness's three etcd members, named by their endpoints."""

    def kill(self, endpoint):
        super().kill(self.endpoints.index(endpoint))

    def restart(self, endpoint, timeout=30):
        super().restart(self.endpoints.index(endpoint), timeout)


@pytest.fixture
def members(tmp_path):
    m = Members(tmp_path / "etcd", size=3)
    yield m
    m.close()


@pytest.fixture
def cluster(tmp_path, members):
    """test_cluster's nodes, on the three members (each node given its list of endpoints)."""
    cl = Cluster(tmp_path, members, lease_ttl=LEASE_TTL)
    yield cl
    cl.close()


def rotated(endpoints, first):
    i = endpoints.index(first)
    return endpoints[i:] + endpoints[:i]


def etcd_session(cl, node):
    """{"endpoint": the etcd endpoint node `node` says its session uses ("" while none),
    "connected": "1" while its session is up, "switches": ...} ($SYS/broker/cluster/etcd/...)."""
    c = cl.client(node)
    sub(c, "$SYS/broker/cluster/etcd/+")
    got = {m.topic.rsplit("/", 1)[1]: m.payload.decode() for m in drain(c, 0.8)}
    c.disconnect()
    return got


def etcd_endpoint(cl, node):
    return etcd_session(cl, node).get("endpoint")


def moved_off(cl, node, dead, timeout=20):
    """Wait until node `node`'s etcd session is up on another member than `dead`: the
    endpoint of the one it uses."""
    def moved():
        got = etcd_session(cl, node)
        return got.get("connected") == "1" and got.get("endpoint") not in (None, "", dead) and got["endpoint"]
    got = wait_for(moved, timeout=timeout, interval=0.2)
    assert got, f"node {node} never left etcd member {dead}:\n{cl.nodes[node].log[-3000:]}"
    return got


def crosses_both_ways(cl, x, y, topic):
    """A new subscription on each of nodes x and y gets what the other publishes."""
    for here, there in ((x, y), (y, x)):
        s = cl.client(here)
        sub(s, f"{topic}/{here}/#", 1)
        pub = cl.client(there)
        await_route(pub, s, f"{topic}/{here}/probe")
        publish(pub, f"{topic}/{here}/m", b"from " + there.encode(), 1)
        assert [m.payload for m in drain(s, 1.0)] == [b"from " + there.encode()]


def test_a_node_whose_etcd_member_is_killed_stays_in_the_cluster(cluster, members):
    """Nodes a (on member 0) and b (on member 1); member 0 is killed: a goes on through
    another member with its lease kept alive (its registration is the same key, never
    deleted), what it subscribes afterwards reaches etcd and the other nodes (a node c that
    joins afterwards, member 0 first in its list, learns it from etcd), messages cross both
    ways, nobody is dropped. Member 0 comes back (the etcd cluster needs it when member 1 is
    killed next, the one b, and now a and c, use), and they all go on again."""
    eps = members.endpoints
    cl = cluster
    cl.start("a", etcd=eps)
    cl.start("b", etcd=rotated(eps, eps[1]))
    prefix = f"/wrenmq/{cl.name}/"
    assert wait_for(lambda: len(members.entries(prefix + "nodes/")) == 2, timeout=10)
    crosses_both_ways(cl, "a", "b", "before")
    assert etcd_endpoint(cl, "a") == eps[0] and etcd_endpoint(cl, "b") == eps[1]
    registered = members.entries(prefix + "nodes/")

    killed_at = time.monotonic()
    members.kill(eps[0])
    now_a = moved_off(cl, "a", eps[0])
    assert "etcd session lost" in cl.nodes["a"].log and "etcd session back through" in cl.nodes["a"].log
    # A subscription made now is written to etcd (through the member a uses now) and
    # reaches the other node; messages go both ways.
    s = cl.client("a")
    sub(s, "after/#", 1)
    assert wait_for(lambda: prefix + "routes/a/n/after/#" in members.entries(prefix + "routes/a/"), timeout=10)
    crosses_both_ways(cl, "a", "b", "during")
    # A node joining now (the dead member first in its list) has a's new filter from etcd:
    # no ROUTE frame told it, it was made before c was there.
    cl.start("c", etcd=eps)
    pub_c = cl.client("c")
    await_route(pub_c, s, "after/c")
    assert etcd_endpoint(cl, "c") not in ("", eps[0])
    # Past the lease's TTL since the kill: a's registration is the one it had, on the same
    # lease (kept alive on the new member), and so is b's; no node dropped another.
    time.sleep(max(0.0, killed_at + EXPIRED_AFTER - time.monotonic()))
    now = members.entries(prefix + "nodes/")
    for n in "ab":
        assert now[prefix + "nodes/" + n][1:] == registered[prefix + "nodes/" + n][1:], (n, registered, now)
    for n in "abc":
        assert sys_value(lambda: cl.client(n), "$SYS/broker/cluster/nodes") == "3", n
        assert "joining again" not in cl.nodes[n].log
    assert etcd_session(cl, "a")["switches"] == "1"
    # `wrenmq cluster status` reads etcd past the dead member and says which member each
    # node uses.
    cfg = cl.tmp / "status.toml"
    cfg.write_text(cl.config("x", 0, etcd=eps))
    r = subprocess.run([WRENMQ, "cluster", "status", "--config", str(cfg), "--json"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    status = json.loads(r.stdout)
    assert status["etcd"] in eps[1:]
    assert wait_for(lambda: json.loads(subprocess.run(
        [WRENMQ, "cluster", "status", "--config", str(cfg), "--json"], capture_output=True, text=True,
        timeout=30).stdout)["nodes"]["a"]["etcd"] == now_a, timeout=10)
    assert sorted(status["nodes"]) == ["a", "b", "c"]

    # The member comes back; then the one b (and a) use goes: with member 0 back, etcd
    # keeps its quorum, and the nodes go on to a member that answers.
    members.restart(eps[0])
    registered = members.entries(prefix + "nodes/")
    on_b = etcd_endpoint(cl, "b")
    killed_at = time.monotonic()
    members.kill(on_b)
    for n in "abc":
        if etcd_endpoint(cl, n) in ("", on_b):
            moved_off(cl, n, on_b)
    crosses_both_ways(cl, "a", "b", "again")
    crosses_both_ways(cl, "b", "c", "again")
    time.sleep(max(0.0, killed_at + EXPIRED_AFTER - time.monotonic()))
    now = members.entries(prefix + "nodes/")
    for n in "abc":
        assert now[prefix + "nodes/" + n][1:] == registered[prefix + "nodes/" + n][1:], (n, registered, now)
        assert "joining again" not in cl.nodes[n].log


# The bridge test's lease: killing the member that leads etcd costs an election of a
# second or more before any member answers, which a 4 s lease, held with a 1 s margin,
# does not always leave room for.
BRIDGE_LEASE_TTL = 8


def test_the_node_holding_a_bridge_keeps_it_when_its_etcd_member_is_killed(tmp_path, serve_broker, mosquitto,
                                                                            members):
    """Two nodes with one bridge, both on etcd member 0 first: member 0 is killed; the
    bridge's key stays on the same node and lease (its ownership session went on to another
    member and kept the lease alive), and what the remote publishes still comes in."""
    remote = mosquitto()
    name = f"cl{int(time.time() * 1000) % 10 ** 8}"
    topics = '[[bridge.topic]]\npattern = "down/#"\ndirection = "in"\n'
    eps = members.endpoints

    def node(n):
        cluster = (f'[cluster]\nenabled = true\nname = "{name}"\nnode = "{n}"\netcd = {json.dumps(eps)}\n'
                   f'port = {free_port()}\nlease_ttl = {BRIDGE_LEASE_TTL}\n')
        return serve_broker(edge_config(remote.port, topics, extra=cluster), args=("--data-dir", n))
    nodes = {"a": node("a"), "b": node("b")}
    key = f"/wrenmq/{name}/bridges/cloud"
    assert wait_for(lambda: key in members.entries(key), timeout=20, interval=0.2)
    held = members.entries(key)[key]
    subs = {n: paho_client(b.port, client_id=f"sub-{n}", version=5) for n, b in nodes.items()}
    for c in subs.values():
        subscribe(c, "down/#", 1)
    cloud = paho_client(remote.port, version=5)

    def comes_in():  # the holder's subscription is on the remote
        cloud.publish("down/probe", b"p", 1).wait_for_publish(5)
        return all(any(m.payload == b"p" for m in drain(c, 0.3)) for c in subs.values())
    assert wait_for(comes_in, timeout=30, interval=0.2)
    time.sleep(0.5)
    for c in subs.values():
        drain(c)

    killed_at = time.monotonic()
    members.kill(eps[0])
    time.sleep(max(0.0, killed_at + BRIDGE_LEASE_TTL + 3 - time.monotonic()))
    # Past the lease's TTL: the holder's key is the one it created, on the same lease, and
    # the holder did not let go of the bridge.
    assert members.entries(key).get(key) == held, (held, members.entries(key))
    for i in range(5):
        cloud.publish("down/x", b"in%d" % i, 1).wait_for_publish(5)
    for n, c in subs.items():
        got = collect(c, lambda g: len({m.payload for m in g}) >= 5, timeout=15)
        assert sorted({m.payload for m in got}) == [b"in%d" % i for i in range(5)], n
    assert members.entries(key).get(key) == held
    log = nodes[held[0]].log
    assert "bridges: etcd session back through" in log, log[-3000:]
    assert "another node runs the remote session now" not in log, log[-3000:]
