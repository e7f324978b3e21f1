"""Spark reads a running cluster over the network, on a real Spark cluster, exactly once.

A standalone Spark cluster started from pyspark's own launcher (a master and two workers on
127.0.0.1, executors in processes of their own), a driver that is this test's SparkSession
(`spark://127.0.0.1:PORT`) or a `wrenmq pipeline` command, and two `wrenmq serve` nodes joined
through a real etcd whose admin listeners serve their logs over HTTPS to users of a password
file. The source is given the nodes' admin addresses only (`wrenmq://...`): no executor is
told where a data dir is. Started once for the module (Spark's start is slow); the test that
kills a node runs last.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from admin_helpers import PASSWORDS, make_password_file  # noqa: E402
from conftest import free_port, paho_client, wait_port  # noqa: E402
from test_cluster import Cluster, Etcd  # noqa: E402

from .pipeline_helpers import StandaloneSpark, duckdb_counts, lake_offsets, wait_for  # noqa: E402

WRENMQ = str(Path(sys.executable).with_name("wrenmq"))
VIEWER = ("viewer", PASSWORDS["viewer"])
# Each app takes one core on each worker (workers have two): the test's session and a
# `wrenmq pipeline` driver run side by side.
APP_CONF = {"spark.cores.max": "2", "spark.executor.cores": "1", "spark.executor.memory": "512m",
            "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
            "spark.sql.shuffle.partitions": "2"}


class Nodes:
    """Two cluster nodes, a and b, each with an HTTPS admin listener (users from one password
    file: `viewer` may only read) and its log on disk, fsynced every 100 ms."""

    def __init__(self, tmp, etcd):
        import trustme

        self.tmp = tmp
        ca = trustme.CA()
        ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(tmp / "server.pem"))
        self.cafile = str(tmp / "ca.pem")
        ca.cert_pem.write_to_path(self.cafile)
        self.pwfile = make_password_file(tmp / "passwords")
        self.cl = Cluster(tmp, etcd)
        self.admin_ports = {}
        self.dirs = {}
        for name in "ab":
            self.admin_ports[name] = free_port()
            self.dirs[name] = tmp / f"data-{name}"
            self.start(name)

    def start(self, name):
        if name in self.cl.nodes:
            node = self.cl.nodes[name]
            node.start()
        else:
            self.cl.extra_listeners = (
                f'[[listener]]\nport = 0\n[[listener]]\ntype = "admin"\nport = {self.admin_ports[name]}\n'
                f'users = ["ops"]\nreadonly_users = ["viewer"]\ntls = true\ncertfile = "{self.tmp / "server.pem"}"\n'
                f'cafile = "{self.cafile}"\n[auth]\npassword_file = "{self.pwfile}"\nallow_anonymous = true\n')
            node = self.cl.start(name, storage=f'data_dir = "{self.dirs[name]}"\nfsync = "interval"\n'
                                               f'fsync_interval_ms = 100')
        wait_port(self.admin_ports[name], proc=node.proc)
        return node

    def url(self, *names):
        return "wrenmq://" + ",".join(f"127.0.0.1:{self.admin_ports[n]}" for n in names)

    def listing(self, via="a"):
        from wrenmq.pipeline.netlog import Net, list_partitions

        net = Net(self.url(via), *VIEWER, cafile=self.cafile, request_timeout=10)
        return list_partitions(net)

    def durable_ends(self):
        return {p: max(s["end_offset"] for s in servers) for p, servers in self.listing().items()}

    def close(self):
        self.cl.close()


def publish(port, topic_prefix, n, qos=1, props_every=3, start=0):
    """n messages, MQTT 5, some with properties, all acknowledged."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    c = paho_client(port, client_id=f"pub-{topic_prefix.replace('/', '-')}-{start}")
    infos = []
    for i in range(start, start + n):
        props = None
        if i % props_every == 0:
            props = Properties(PacketTypes.PUBLISH)
            props.ContentType = "application/json"
            props.UserProperty = [("seq", str(i))]
        infos.append(c.publish(f"{topic_prefix}/{i % 5}/v", json.dumps({"value": i}).encode(), qos=qos,
                               properties=props))
    for info in infos:
        info.wait_for_publish(20)
    c.disconnect()
    c.loop_stop()


@pytest.fixture(scope="module")
def env(tmp_path_factory, java):
    """(standalone Spark, the nodes, a SparkSession of this process on the standalone master)."""
    from pyspark.sql import SparkSession

    tmp = tmp_path_factory.mktemp("netsource")
    etcd = Etcd(tmp)
    nodes = spark_cluster = spark = None
    old_ip = os.environ.get("SPARK_LOCAL_IP")
    try:
        nodes = Nodes(tmp, etcd)
        spark_cluster = StandaloneSpark(tmp, workers=2, cores=2, memory="2g")
        active = SparkSession.getActiveSession()
        if active is not None:  # (the local[2] session of the other pipeline tests: one per process)
            active.stop()
        os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
        from wrenmq.pipeline.spark import session
        spark = session(spark_cluster.url, app_name="wrenmq-netsource-tests", conf=APP_CONF)
        yield spark_cluster, nodes, spark
    finally:
        # Each step whatever the one before did: nothing of it may outlive the module.
        for step in (spark and spark.stop, spark_cluster and spark_cluster.stop, nodes and nodes.close,
                     etcd.stop, etcd.log.close):
            try:
                if step:
                    step()
            except Exception as e:  # (reported, not hidden: the test's own failure comes first)
                print(f"teardown: {step}: {e!r}")
        if old_ip is None:
            os.environ.pop("SPARK_LOCAL_IP", None)
        else:
            os.environ["SPARK_LOCAL_IP"] = old_ip


def _net_reader(spark, nodes, *via, **options):
    r = spark.read.format("wrenmq").option("username", VIEWER[0]).option("password", VIEWER[1]) \
        .option("cafile", nodes.cafile)
    for k, v in options.items():
        r = r.option(k, v)
    return r.load(nodes.url(*via))


@pytest.mark.timeout(300)  # (the module's Spark cluster starts in the first test's time)
def test_batch_read_over_the_network_equals_the_filesystem_read(env):
    spark_cluster, nodes, spark = env
    publish(nodes.cl.nodes["a"].port, "net/a", 3000)
    publish(nodes.cl.nodes["b"].port, "net/b", 2000)
    assert wait_for(lambda: nodes.durable_ends() == {"a": 3000, "b": 2000}, timeout=20), nodes.durable_ends()
    # Any one node lists the cluster: both partitions, each served by its node.
    listing = nodes.listing(via="b")
    assert {p: [s["admin"] for s in servers] for p, servers in listing.items()} == {
        n: [f"https://127.0.0.1:{nodes.admin_ports[n]}"] for n in "ab"}

    # Node a's address only; ranges of at most 700 records, so each node's log is several tasks.
    net = _net_reader(spark, nodes, "a", maxRecordsPerPartition="700")
    assert net.rdd.getNumPartitions() == 5 + 3
    fs = spark.read.format("wrenmq").load(f"{nodes.dirs['a']},{nodes.dirs['b']}")
    got = net.orderBy("node", "offset").toArrow()
    want = fs.orderBy("node", "offset").toArrow()
    assert got.num_rows == 5000 and got.equals(want)
    assert got.column("properties")[3].as_py() == {
        "payload_format_indicator": None, "message_expiry_interval": None, "content_type": "application/json",
        "response_topic": None, "correlation_data": None, "user_properties": [{"key": "seq", "value": "3"}]}
    # The tasks ran in the workers' executors (a JVM and Python workers each), not in this process.
    assert spark.sparkContext._jsc.sc().getExecutorIds().size() == 2
    assert len(spark_cluster.apps()) == 2
    # Options as in the filesystem form: topic filters, starting offsets, times.
    import pyarrow.compute as pc
    opts = {"topics": "net/a/1/#,net/b/+/v", "startingOffsets": json.dumps({"a": 100, "b": -1})}
    got = _net_reader(spark, nodes, "a", "b", **opts).orderBy("node", "offset").toArrow()
    a_rows = want.filter(pc.and_(pc.equal(want["node"], "a"), pc.greater_equal(want["offset"], 100)))
    assert got.equals(a_rows.filter(pc.starts_with(a_rows["topic"], "net/a/1/")))
    assert got.num_rows == (3000 - 100) // 5
    ts_us = want.filter(pc.equal(want["node"], "b"))["timestamp"].cast("int64").to_numpy()
    t_ms = int(ts_us[1500]) // 1000 + 1
    first = int((ts_us >= t_ms * 1000).argmax())  # the first record at or after the time
    got = _net_reader(spark, nodes, "b", startingTimestamp=str(t_ms)).where("node = 'b'").count()
    assert got == 2000 - first and 0 < got < 500


@pytest.mark.timeout(300)
def test_credentials_and_tls_are_required(env):
    from pyspark.errors import PySparkException
    from py4j.protocol import Py4JJavaError

    _, nodes, spark = env
    refused = (PySparkException, Py4JJavaError)
    plain = spark.read.format("wrenmq").option("cafile", nodes.cafile)
    with pytest.raises(refused, match="401"):
        plain.load(nodes.url("a")).count()
    with pytest.raises(refused, match="401"):
        plain.option("username", "viewer").option("password", "wrong").load(nodes.url("a")).count()
    with pytest.raises(refused, match="TLS: .*give the listener's CA with cafile"):
        spark.read.format("wrenmq").option("username", VIEWER[0]).option("password", VIEWER[1]) \
            .option("tls", "true").load(nodes.url("a")).count()
    # The command line says so at once, before any Spark starts.
    t = time.monotonic()
    run = subprocess.run([WRENMQ, "pipeline", "archive", "--brokers", nodes.url("a")[len("wrenmq://"):],
                          "--cafile", nodes.cafile, "--output", str(nodes.tmp / "refused")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "401" in run.stderr and "--user/--password or --token" in run.stderr, run.stderr
    assert time.monotonic() - t < 20 and not (nodes.tmp / "refused").exists()
    for brokers, says in ((f"https://127.0.0.1:{nodes.admin_ports['a']}", "TLS: "),
                          (f"127.0.0.1:{nodes.admin_ports['a']}", "an HTTPS listener?")):
        run = subprocess.run([WRENMQ, "pipeline", "archive", "--brokers", brokers, "--user", "viewer",
                              "--output", str(nodes.tmp / "refused")], capture_output=True, text=True, timeout=60,
                             env=dict(os.environ, WRENMQ_PASSWORD=VIEWER[1]))
        assert run.returncode == 2 and says in run.stderr and "--cafile" in run.stderr, run.stderr


def _published_batches(out):
    mdir = Path(out) / "_wrenmq" / "manifests"
    n = 0
    for f in mdir.glob("*.json") if mdir.is_dir() else ():
        try:
            n += json.loads(f.read_text()).get("state") == "published"
        except ValueError:
            pass
    return n


def _staged(staging):
    """The Parquet files staged now; [] while the job moves a directory under the walk
    (the caller looks again)."""
    try:
        return [f for f in Path(staging).rglob("*.parquet") if "_temporary" not in str(f)]
    except FileNotFoundError:
        return []


class Publisher(threading.Thread):
    """QoS 1 messages to one node, one at a time, until stopped; rides out the node's restart."""

    def __init__(self, node, prefix):
        super().__init__(daemon=True)
        self.node = node
        self.prefix = prefix
        self.stop = threading.Event()
        self.sent = 0

    def run(self):
        c = None
        while not self.stop.is_set():
            try:
                if c is None:
                    c = paho_client(self.node.port, client_id=f"live-{self.prefix}")
                c.publish(f"{self.prefix}/{self.sent % 5}", b"%d" % self.sent, qos=1).wait_for_publish(2)
                self.sent += 1
                time.sleep(0.02)
            except Exception:
                if c is not None:
                    c.loop_stop()
                c = None
                time.sleep(0.3)
        if c is not None:
            c.disconnect()
            c.loop_stop()


@pytest.mark.timeout(420)
def test_archive_exactly_once_across_kill9_of_the_driver_and_of_a_node(env):
    """`wrenmq pipeline archive --brokers ... --master spark://...` killed with SIGKILL (driver,
    JVM and Python workers) while a batch is staged, not committed; node b killed with SIGKILL
    too; the job started again from its checkpoint while b is down (on this test's session:
    the same job code, without a third JVM start), b started again on its data dir; both
    nodes take messages all along. The lake then holds every record of both logs once."""
    from wrenmq.pipeline import jobs

    spark_cluster, nodes, spark = env
    tmp = nodes.tmp
    out = tmp / "lake"
    staging = tmp / ".lake.wrenmq-staging"
    brokers = nodes.url("a")[len("wrenmq://"):]  # (node a's address only: b is found through it)
    cmd = [WRENMQ, "pipeline", "archive", "--brokers", brokers, "--user", "viewer", "--cafile", nodes.cafile,
           "--output", str(out), "--master", spark_cluster.url, "--quiet", "--continuous", "--trigger", "0 seconds",
           "--max-records-per-trigger", "3000"]
    for k, v in APP_CONF.items():
        cmd += ["--conf", f"{k}={v}"]
    env_vars = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", WRENMQ_PASSWORD=VIEWER[1],
                    WRENMQ_PIPELINE_TEST_STAGE_DELAY="1.0")
    pubs = [Publisher(nodes.cl.nodes[n], f"live/{n}") for n in "ab"]
    for p in pubs:
        p.start()
    log_path = tmp / "pipeline.log"
    job = q = None
    try:
        with open(log_path, "ab") as lf:
            job = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env_vars, start_new_session=True)
        ok = wait_for(lambda: job.poll() is None and _published_batches(out) >= 1 and _staged(staging),
                      timeout=240, interval=0.05)
        assert ok, f"the job did not get going:\n{log_path.read_text()[-3000:]}"
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(30)
        assert _staged(staging)
        mid = lake_offsets(str(out))
        assert mid and len(mid) == len(set(mid))
        nodes.cl.nodes["b"].kill()
        # Started again from the checkpoint, b down: the batch staged when the driver died
        # runs again, its range of b waits for b (the tasks retry), a goes on.
        o = jobs.JobOptions(brokers=brokers, user=VIEWER[0], password=VIEWER[1], cafile=nodes.cafile,
                            output=str(out), once=False, trigger="0 seconds", max_records_per_trigger=3000)
        jobs.check_options("archive", o)
        q = jobs.start_archive(spark, o)
        time.sleep(3)
        nodes.start("b")
        assert wait_for(lambda: _published_batches(out) >= 3 or not q.isActive, timeout=120, interval=0.2)
        for p in pubs:
            p.stop.set()
        for p in pubs:
            p.join(15)
        assert all(p.sent > 20 for p in pubs)
        time.sleep(0.5)  # (one fsync interval: what was written is durable now)
        ends = nodes.durable_ends()

        def caught_up():
            have = {}
            for node, _ in lake_offsets(str(out)):
                have[node] = have.get(node, 0) + 1
            return not q.isActive or all(have.get(n, 0) >= e for n, e in ends.items())

        assert wait_for(caught_up, timeout=120, interval=0.5), ends
        assert q.isActive and q.exception() is None
        q.stop()
    finally:
        for p in pubs:
            p.stop.set()
        if job is not None and job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(30)
        if q is not None and q.isActive:
            q.stop()
    # Every record of both logs, exactly once, whatever reads the lake.
    rows = lake_offsets(str(out))
    assert len(rows) == len(set(rows))
    for n, e in ends.items():
        assert sorted(o for node, o in rows if node == n) == list(range(e)), n
    assert duckdb_counts(out) in (None, (len(rows), len(rows)))
    import pandas as pd
    df = pd.read_parquet(out)
    assert len(df) == len(rows) and not df.duplicated(["node", "offset"]).any()
