"""The Spark source over a replicated cluster (`[cluster] replicas = 3, min_insync = 2`): every
partition read exactly once, whichever of its copies serves it, also after a node's kill -9.

Three real `wrenmq serve` nodes (ha_helpers.py) with admin listeners, a real etcd, real MQTT
publishers on every node, the local SparkSession reading over `wrenmq://` only.
"""

import pytest

pytest.importorskip("pyspark")

from conftest import paho_client  # noqa: E402
from ha_helpers import Etcd, HACluster  # noqa: E402
from mqtt_helpers import publish, wait_for  # noqa: E402

PER_NODE = 40


def listing(cl):
    """{partition: servers} as the cluster lists them (any live node answers)."""
    from wrenmq.pipeline.netlog import Net, list_partitions

    return list_partitions(Net(url(cl), request_timeout=10), retry_for=10)


def url(cl):
    return "wrenmq://" + ",".join(f"127.0.0.1:{n.admin_port}" for n in cl.nodes.values())


def read_all(spark, cl):
    rows = (spark.read.format("wrenmq").option("topics", "hr/#").option("retryTimeoutMs", "60000")
            .load(url(cl)).select("node", "offset", "topic", "payload").collect())
    return [(r.node, r.offset, r.topic, bytes(r.payload)) for r in rows]


def assert_each_once(rows, want):
    offsets = [(node, offset) for node, offset, _, _ in rows]
    assert len(offsets) == len(set(offsets)), "a record was read twice"
    assert sorted((node, topic, payload) for node, _, topic, payload in rows) == want


@pytest.mark.timeout(300)
def test_partitions_read_once_from_any_replica_and_after_a_kill(spark, tmp_path):
    etcd = Etcd(tmp_path)
    cl = HACluster(tmp_path / "cl", etcd, admin=True)
    try:
        cl.start()
        want = []
        for name, node in cl.nodes.items():
            pub = paho_client(node.port, client_id=f"hr-pub-{name}")
            for i in range(PER_NODE):
                publish(pub, f"hr/{name}/{i}", f"{name}-{i}".encode(), qos=1, timeout=20)
                want.append((name, f"hr/{name}/{i}", f"{name}-{i}".encode()))
            pub.disconnect()
            pub.loop_stop()
        want.sort()

        def every_copy_complete():
            parts = listing(cl)
            return set(parts) == set(cl.nodes) and all(
                len(servers) == 3 and len({s["end_offset"] for s in servers}) == 1 for servers in parts.values())
        # Each partition is listed with its three copies, its leader (its own node) first.
        assert wait_for(every_copy_complete, 30, 0.25), listing(cl)
        for p, servers in listing(cl).items():
            assert [(s["node"], s["role"]) for s in servers] == [
                (p, "leader"), *((n, "in_sync") for n in sorted(set(cl.nodes) - {p}))]
        assert_each_once(read_all(spark, cl), want)

        # Node a is gone: its partition is read from the copies on b and c, each record once.
        cl["a"].kill()
        assert_each_once(read_all(spark, cl), want)

        # Once a survivor leads a's partition (a hosted broker for a), the listing names it
        # first and the other in-sync copy after it; the read is the same.
        assert wait_for(lambda: cl.records()["a"]["leader"] in ("b", "c"), 60, 0.25), cl.records()
        leader = cl.records()["a"]["leader"]
        (other,) = {"b", "c"} - {leader}

        def leader_listed_first():
            servers = listing(cl).get("a", [])
            return [(s["node"], s["role"]) for s in servers] == [(leader, "leader"), (other, "in_sync")]
        assert wait_for(leader_listed_first, 60, 0.5), listing(cl)
        assert_each_once(read_all(spark, cl), want)
    finally:
        cl.close()
        etcd.close()
