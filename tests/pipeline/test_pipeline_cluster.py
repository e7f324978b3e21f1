"""The Spark source over a cluster: every node's log read together, each message once.

A real etcd and two `wrenmq serve` nodes (disk storage), real clients, one SparkSession.
"""

import pytest

pytest.importorskip("pyspark")

from test_cluster import Cluster, Etcd, await_route  # noqa: E402
from mqtt_helpers import drain, publish, sub  # noqa: E402


def test_a_clusters_logs_read_together_each_message_once(spark, tmp_path):
    etcd = Etcd(tmp_path)
    cl = Cluster(tmp_path, etcd)
    try:
        dirs = {n: tmp_path / f"data-{n}" for n in "ab"}
        for n, d in dirs.items():
            cl.start(n, storage=f"data_dir = \"{d}\"")
        watcher = cl.client("a")
        sub(watcher, "plant/#", 1)
        sub(watcher, "probe/#", 1)
        pub_b = cl.client("b", client_id="pub-b")
        await_route(pub_b, watcher, "probe/1")  # (not under plant/: not read below)
        pub_a = cl.client("a", client_id="pub-a")
        publish(pub_a, "plant/a/1", b"a1", 1)
        publish(pub_a, "plant/a/2", b"a2", 1)
        publish(pub_b, "plant/b/1", b"b1", 1)
        # Node a delivered node b's message; it records only what its own clients published.
        assert sorted(m.payload for m in drain(watcher, 1.0) if m.topic.startswith("plant/")) == [b"a1", b"a2", b"b1"]
        for node in cl.nodes.values():
            assert node.stop() == 0
        rows = (spark.read.format("wrenmq").option("topics", "plant/#")
                .load(",".join(str(d) for d in dirs.values())).collect())
        got = sorted((r.node, r.offset >= 0, r.topic, bytes(r.payload), r.client_id) for r in rows)
        assert got == [("a", True, "plant/a/1", b"a1", "pub-a"), ("a", True, "plant/a/2", b"a2", "pub-a"),
                       ("b", True, "plant/b/1", b"b1", "pub-b")]
    finally:
        cl.close()
        etcd.stop()
        etcd.log.close()


def test_two_data_dirs_with_one_node_id_are_refused(tmp_path):
    from wrenmq.pipeline.common import Readers, log_root

    for d in ("x", "y"):
        (tmp_path / d / "log" / "same").mkdir(parents=True)
    root = log_root(f"{tmp_path / 'x'},{tmp_path / 'y'}")
    assert isinstance(root, tuple) and len(root) == 2
    with pytest.raises(ValueError, match="log partition 'same' is in both"):
        Readers(root).refresh()
