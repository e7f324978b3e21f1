"""Failover with real processes: `[cluster] replicas = 3, min_insync = 2` nodes under the
fault harness (cluster_harness.py: real etcd, `wrenmq serve` nodes, links and etcd through
relays the test controls) and its workload and checker (persistent QoS 1 and QoS 2
publishers and subscribers on every node, reconnecting to any node).

Small loads and a short lease (3 s), so that `make test` stays quick; `make chaos
ARGS="--replicas 3"` runs the same faults many times.
"""

import json
import time

import pytest

from cluster_harness import Cluster, EtcdCluster, under_load
from conftest import paho_client
from mqtt_helpers import drain, sub, uid, wait_for

HA = {"replicas": 3, "min_insync": 2, "replica_lag_ms": 2000, "replica_heartbeat_ms": 200,
      "replica_fetch_timeout_ms": 1500}


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    e = EtcdCluster(tmp_path_factory.mktemp("etcd"), size=1)
    yield e
    e.close()


@pytest.fixture
def cluster(tmp_path, etcd):
    made = []

    def factory(**kw):
        cl = Cluster(tmp_path / f"cl{len(made)}", etcd, cluster_options={**HA, **kw.pop("options", {})}, **kw)
        made.append(cl)
        return cl

    yield factory
    for cl in made:
        cl.close()


def records(cl):
    prefix = f"{cl.prefix}ha/partitions/"
    return {k[len(prefix):]: json.loads(v) for k, v in cl.etcd.get_prefix(prefix).items()}


def status(cl):
    prefix = f"{cl.prefix}ha/status/"
    return {k[len(prefix):]: json.loads(v) for k, v in cl.etcd.get_prefix(prefix).items()}


def partitions_whole(cl, nodes=None):
    """Every node leads its own partition, serving and taking QoS 1/2, with all its replicas in
    sync."""
    recs, st = records(cl), status(cl)
    for n in nodes or cl.nodes:
        r, s = recs.get(n), st.get(n)
        if r is None or s is None or r["leader"] != n or len(r["replicas"]) < HA["replicas"] or \
                set(r["isr"]) != set(r["replicas"]) or s["epoch"] != r["epoch"] or s["state"] != "serving" or \
                not s["accepting"]:
            return False
    return True


def wait_whole(cl, timeout=60):
    assert wait_for(lambda: partitions_whole(cl) and cl.stable(), timeout, 0.25), \
        f"partitions not whole: {records(cl)} {status(cl)}"


def taken_over(cl, p):
    """The node whose hosted broker serves partition `p` (not `p` itself), or None."""
    r, s = records(cl).get(p), status(cl).get(p)
    if r is None or s is None or r["leader"] in (None, p) or s["leader"] != r["leader"] or \
            s["epoch"] != r["epoch"] or s["state"] != "serving":
        return None
    return r["leader"]


def test_kill_9_of_a_leader_under_qos1_and_qos2_load(cluster):
    """kill -9 of node a (leader of its partition, with publishers and persistent subscribers
    on it): an in-sync follower takes partition a over within the lease and a few seconds
    and hosts a's broker; a's clients reconnect to the other nodes and take their sessions
    from it (session present 1), every acknowledged message reaches every subscriber, no QoS
    2 message twice, the retained messages are the last acknowledged; then a restarts, catches
    up and takes its partition back (its own broker serving again)."""
    cl = cluster()
    cl.start()
    wait_whole(cl)
    measured = {}

    def fault():
        t0 = time.monotonic()
        cl["a"].kill()
        assert wait_for(lambda: taken_over(cl, "a"), 40, 0.1), f"nobody took a over: {records(cl)} {status(cl)}"
        measured["failover"] = time.monotonic() - t0
        time.sleep(2.0)  # (the clients of a reconnect and claim their sessions meanwhile)
        t1 = time.monotonic()
        cl["a"].start()
        wait_whole(cl, 90)
        measured["handback"] = time.monotonic() - t1

    report = under_load(cl, fault, rate=8.0, failover="any")
    print(f"failover {measured['failover']:.1f} s (lease {cl.lease_ttl} s), back {measured['handback']:.1f} s;",
          report.summary())
    assert report.ok and report.lost == report.duplicates == 0, report.summary()
    assert report.acknowledged > 0 and report.sessions_lost == 0, report.summary()
    assert measured["failover"] < cl.lease_ttl + 8, measured


def test_a_lost_nodes_will_is_published_once_by_the_node_that_takes_it_over(cluster):
    """A persistent session on node a with a will (delay 0): a is killed, so its client's
    connection goes with it and nobody could publish the will then. The node that takes
    partition a over restores the session and publishes the will, once; when a comes back
    and takes its partition back, it does not publish it again."""
    cl = cluster()
    cl.start()
    wait_whole(cl)
    watcher = paho_client(cl["b"].port)
    try:
        sub(watcher, "wills/#", 1)
        cid = uid("will")
        dev = paho_client(cl["a"].port, client_id=cid, clean=False, properties={"SessionExpiryInterval": 600},
                          will={"topic": "wills/dev", "payload": b"gone", "qos": 1})
        dev._reconnect_on_failure = False
        time.sleep(1.0)  # (the session, and its will, committed on a's replicas)
        cl["a"].kill()
        dev.loop_stop()
        got = []
        assert wait_for(lambda: got.extend(m.payload for m in drain(watcher)) or got, 30, 0.2), \
            "the will never came"
        assert wait_for(lambda: taken_over(cl, "a"), 20, 0.1) in ("b", "c"), records(cl)
        cl["a"].start()
        wait_whole(cl, 90)
        time.sleep(2.0)
        got += [m.payload for m in drain(watcher)]
        assert got == [b"gone"], got
    finally:
        watcher.disconnect()
        watcher.loop_stop()

