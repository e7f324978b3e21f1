"""Failover with real processes: `[cluster] replicas = 3, min_insync = 2` nodes under the
fault harness (cluster_harness.py: real etcd, `wrenmq serve` nodes, links and etcd through
relays the test controls) and its workload and checker (persistent QoS 1 and QoS 2
publishers and subscribers on every node, reconnecting to any node).

Small loads and a short lease (3 s), so that `make test` stays quick; `make chaos
ARGS="--replicas 3"` runs the same faults many times.
"""

import json
import subprocess
import time

import pytest

from cluster_harness import WRENMQ, Cluster, EtcdCluster, link_certificates, under_load
from conftest import paho_client
from mqtt_helpers import drain, publish, raw_connect, raw_next, sub, uid, wait_for
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.packets import Connect, Publish, Pubrel

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


def status_json(cl, node):
    r = subprocess.run([WRENMQ, "cluster", "status", "--json", "--config", str(cl[node].config_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def reassign(cl, lost, new):
    return subprocess.run([WRENMQ, "cluster", "reassign", lost, new, "--config", str(cl[new].config_path)],
                          capture_output=True, text=True, timeout=60)


def taken_over(cl, p):
    """The node whose hosted broker serves partition `p` (not `p` itself), or None."""
    r, s = records(cl).get(p), status(cl).get(p)
    if r is None or s is None or r["leader"] in (None, p) or s["leader"] != r["leader"] or \
            s["epoch"] != r["epoch"] or s["state"] != "serving":
        return None
    return r["leader"]


def test_kill_9_of_a_leader_five_times_under_qos1_and_qos2_load(cluster):
    """kill -9 of node a (leader of its partition, with publishers and persistent subscribers
    on it), five times in a round: each time an in-sync follower takes partition a over
    within the lease and a few seconds and hosts a's broker; a's clients reconnect to the
    other nodes and take their sessions from it (session present 1); then a restarts,
    catches up and takes its partition back (its own broker serving again), and is killed
    again. Through all five: every acknowledged message reaches every subscriber, no QoS 2
    message twice, the retained messages are the last acknowledged."""
    cl = cluster()
    cl.start()
    wait_whole(cl)
    failovers, handbacks = [], []

    def fault():
        for _ in range(5):
            t0 = time.monotonic()
            cl["a"].kill()
            assert wait_for(lambda: taken_over(cl, "a"), 40, 0.1), f"nobody took a over: {records(cl)} {status(cl)}"
            failovers.append(time.monotonic() - t0)
            time.sleep(2.0)  # (the clients of a reconnect and claim their sessions meanwhile)
            t1 = time.monotonic()
            cl["a"].start()
            wait_whole(cl, 90)
            handbacks.append(time.monotonic() - t1)

    report = under_load(cl, fault, rate=8.0, failover="any")
    print(f"failovers {', '.join(f'{t:.1f}' for t in failovers)} s (lease {cl.lease_ttl} s), back "
          f"{', '.join(f'{t:.1f}' for t in handbacks)} s;", report.summary())
    assert report.ok and report.lost == report.duplicates == 0, report.summary()
    assert report.acknowledged > 0 and report.sessions_lost == 0, report.summary()
    assert len(failovers) == 5 and max(failovers) < cl.lease_ttl + 8, failovers


def test_with_replication_a_node_lost_for_good_loses_nothing_acknowledged(cluster):
    """The scenario of test_cluster_harness.py's
    test_without_replication_a_node_lost_for_good_loses_acknowledged_messages, with
    replicas 3 / min_insync 2: node b is killed, its data dir deleted and an empty node
    started under its name at once, under QoS 1 and QoS 2 load. b's partition is taken
    over by an in-sync follower that hosts b's broker, b's clients reconnect to the other
    nodes and claim their sessions from it (session present 1), the empty b catches up and
    takes its partition back. Where replicas = 1 loses acknowledged messages and sessions,
    here nothing acknowledged is lost, no QoS 2 message comes twice, no session is lost."""
    cl = cluster()
    cl.start()
    wait_whole(cl)

    def lose_b():
        cl["b"].wipe(wait=False)
        wait_whole(cl, 120)

    report = under_load(cl, lose_b, rate=8.0, failover="any", recover=120)
    print(report.summary())
    assert report.ok and report.lost == report.duplicates == 0, report.summary()
    assert report.acknowledged > 0 and report.sessions_lost == 0, report.summary()
    assert report.retained_bad == report.owners_bad == 0, report.summary()


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


# Small segments and retention: a burst moves a log's start past 0; the workload's own
# records stay well within it while a node is away (a replay needs them).
RETENTION = "[log]\nsegment_bytes = 8192\nretention_bytes = 98304\nretention_check_interval = 0.5\n"


def test_a_node_lost_for_good_is_replaced_by_an_empty_one_that_catches_up(cluster):
    """Node a is killed and its data dir deleted, then started again empty under its name,
    under load. It holds no replica, so it first takes itself out of every in-sync set it is
    in (it must never be elected on an empty log), then fetches its partition from the node
    that took it over: the leader's log no longer starts at 0 (retention), so it gets the
    state database as a snapshot and the log from there. Once in sync it takes its partition
    back. Nothing acknowledged is lost, no QoS 2 message comes twice."""
    cl = cluster(extra_toml=RETENTION)
    cl.start()
    wait_whole(cl)

    def fault():
        burst = paho_client(cl["a"].port)
        for i in range(400):
            burst.publish(f"burst/{i % 10}", b"x" * 1024, 0)
        burst.disconnect()
        burst.loop_stop()
        assert wait_for(lambda: status(cl)["a"]["log_start"] > 0, 20, 0.2), status(cl)["a"]
        cl["a"].kill()
        # (The new leader's own retention moves its log start past 0 too: only then does an
        # empty replica's first fetch fall below it.)
        assert wait_for(lambda: taken_over(cl, "a") and status(cl)["a"]["log_start"] > 0, 40, 0.1), \
            f"nobody took a over, or its log still starts at 0: {records(cl)} {status(cl)}"
        cl["a"].wipe(wait=False)
        wait_whole(cl, 90)

    report = under_load(cl, fault, rate=8.0, failover="any")
    print(report.summary())
    assert report.ok and report.lost == report.duplicates == 0, report.summary()
    assert "receiving a state snapshot" in cl["a"].log, "the empty node did not catch up by snapshot"


def test_a_zombie_leader_acknowledges_nothing_after_waking(cluster, raw_client):
    """Node a is stopped (SIGSTOP) past its lease under load: the others take its partition
    over. A QoS 1 PUBLISH sent to a meanwhile is not acknowledged when a wakes (its lease ran
    out: it may not speak for the partition), its client is told to use another server
    (DISCONNECT 0x9C); a then follows its partition, drops the records it logged that the
    new leader never had, catches up and takes it back. Nothing acknowledged is lost."""
    cl = cluster()
    cl.start()
    wait_whole(cl)
    a = cl["a"]
    seen = {}

    def fault():
        c, _ = raw_connect(raw_client, a.port, C.MQTT5)
        a.pause()
        try:
            c.send(Publish("zombie/1", b"sent to a zombie", qos=1, packet_id=5))
            assert wait_for(lambda: taken_over(cl, "a"), 40, 0.1), f"nobody took a over: {records(cl)}"
        finally:
            a.resume()
        got = []
        while True:
            pkt = c.recv(10)
            if pkt is None:
                break
            got.append(pkt)
            if pkt.TYPE == C.DISCONNECT:
                break
        seen["packets"] = got
        wait_whole(cl, 90)

    report = under_load(cl, fault, rate=8.0, failover="any")
    print(report.summary(), seen)
    assert report.ok and report.lost == report.duplicates == 0, report.summary()
    assert not any(p.TYPE == C.PUBACK and p.reason_code < 0x80 for p in seen["packets"]), seen
    assert [p.reason_code for p in seen["packets"] if p.TYPE == C.DISCONNECT] in ([C.USE_ANOTHER_SERVER], []), seen


def test_a_node_cut_from_etcd_answers_its_clients_nothing_once_it_stopped_leading(cluster, raw_client):
    """Node a is cut from etcd (its links stay up) while a client there has a QoS 2 message
    past PUBREC. Once a's lease is in doubt it stops leading its partition, and what it would
    say from then on is not committed: its broker, whose leave of the cluster waits for the
    etcd it cannot reach (`etcd_timeout`, long here), must not answer the client meanwhile.
    Were it to answer the PUBREL with PUBCOMP, the release (never committed) would be
    unknown to the broker that takes a's partition over, which still holds the packet id:
    the client, reusing the id for its next message on another node, would have that
    message taken for a resend and never delivered."""
    cl = cluster(etcd_timeout=6.0)
    cl.start()
    wait_whole(cl)
    a, b = cl["a"], cl["b"]
    s = paho_client(cl["c"].port, version=5)
    assert sub(s, "cut/#", 2) == [2]
    cid = uid("cut")
    expiry = {"session_expiry_interval": 3600}
    try:
        c, ack = raw_connect(raw_client, a.port, C.MQTT5, client_id=cid, clean_start=False, properties=expiry)
        assert ack.TYPE == C.CONNACK and ack.reason_code == 0, ack
        c.send(Publish("cut/1", b"first", qos=2, packet_id=1))
        rec = raw_next(c, C.PUBREC)
        assert rec is not None and rec.reason_code == 0, rec
        fenced = len(a.log.split("partition a: no longer leading epoch"))
        cl.cut_from_etcd("a")
        assert wait_for(lambda: len(a.log.split("partition a: no longer leading epoch")) > fenced, 30, 0.05), \
            "node a went on leading its partition without etcd"
        try:
            c.send(Pubrel(1))
        except OSError:  # (a closed the connection already)
            pass
        after = []
        while True:
            try:
                pkt = c.recv(15)
            except (TimeoutError, OSError):
                break
            if pkt is None:
                break
            after.append(pkt)
        completed = any(p.TYPE == C.PUBCOMP for p in after)
        # The client goes on elsewhere as MQTT says: the release again if it had no PUBCOMP,
        # then its next message under the packet id it holds free.
        # (0x88 Server unavailable: b could not have the session handed over in time, and a
        # client comes back for it, as CLUSTER.md says; the session stays where it is.)
        for _ in range(3):
            c2 = raw_client(b.port, C.MQTT5, timeout=40)
            c2.send(Connect(cid, version=C.MQTT5, clean_start=False, properties=expiry))
            ack = c2.recv(40)
            if ack.TYPE != C.CONNACK or ack.reason_code != C.SERVER_UNAVAILABLE:
                break
        assert ack.TYPE == C.CONNACK and ack.reason_code == 0 and ack.session_present, ack
        if not completed:
            c2.send(Pubrel(1))
            assert raw_next(c2, C.PUBCOMP, 20) is not None
        c2.send(Publish("cut/2", b"second", qos=2, packet_id=1))
        rec = raw_next(c2, C.PUBREC, 20)
        assert rec is not None and rec.reason_code == 0, rec
        c2.send(Pubrel(1))
        assert raw_next(c2, C.PUBCOMP, 20) is not None
        got = []
        wait_for(lambda: got.extend(m.payload for m in drain(s)) or len(got) >= 2, 20, 0.2)
        assert got == [b"first", b"second"], f"{got}; node a said after it stopped leading: {after}"
        assert [p.TYPE for p in after] in ([C.DISCONNECT], []), after
    finally:
        cl.heal()
        s.disconnect()
        s.loop_stop()


def test_status_shows_the_partitions_and_reassign_moves_a_lost_nodes_replicas(cluster):
    """`wrenmq cluster status --json` lists each partition: leader, epoch, replicas in sync and
    their lag. Node c is lost for good; a new node d takes part, and `wrenmq cluster reassign
    c d` moves c's replicas to it: d catches up and joins every in-sync set c was in, c's own
    partition goes on hosted by a survivor."""
    cl = cluster(nodes="abcd")
    for n in "abc":
        cl[n].start(wait=False)
    for n in "abc":
        cl[n].wait_serving()
    wait_for(lambda: partitions_whole(cl, "abc"), 60, 0.25)
    assert partitions_whole(cl, "abc"), records(cl)
    # (a follower's lag is known once the leader has answered its first fetch, and the
    # figures reach etcd on the leader's next status write)
    lags_known = lambda: all(v["lag"] is not None for row in status_json(cl, "a")["partitions"].values()  # noqa: E731
                             for v in row["replicas"].values())
    wait_for(lags_known, 20, 0.5)
    out = status_json(cl, "a")
    parts = out["partitions"]
    assert set(parts) == {"a", "b", "c"}
    for p, row in parts.items():
        assert row["leader"] == p and set(row["replicas"]) == {"a", "b", "c"}
        assert all(v["in_sync"] and v["lag"] is not None for v in row["replicas"].values()), row
    cl["c"].kill()
    cl["d"].start(wait=False)
    assert wait_for(lambda: taken_over(cl, "c"), 40, 0.1), records(cl)
    r = reassign(cl, "c", "d")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "partition c: moved" in r.stdout
    recs_ok = lambda: all("c" not in rec["replicas"] and "d" in rec["replicas"] and "d" in rec["isr"]  # noqa: E731
                          for rec in records(cl).values())
    assert wait_for(recs_ok, 60, 0.25), records(cl)
    parts = status_json(cl, "a")["partitions"]
    assert parts["c"]["leader"] in ("a", "b") and parts["c"]["replicas"]["d"]["in_sync"]
    assert cl["d"].log  # (the new node's own partition exists too)
    assert records(cl)["d"]["leader"] == "d"


def test_a_session_handed_over_uncommitted_keeps_its_messages_coming(cluster):
    """With replicas > 1 the node that hands a session over sends it once committed, which
    can take seconds (here: the hosted broker of a killed node a cannot commit while its
    two in-sync replicas are cut from each other). Until the session is at its new node,
    what the other nodes publish for it goes on reaching it: its filters stay where the
    others send their messages, and what comes there is passed on (RELAY) once the session
    has gone. Four nodes, so that the node the client reconnects to, Z, is none of a's
    replicas and takes QoS 1 PUBLISHes throughout."""
    cl = cluster(nodes="abcd")
    cid = uid("moved")
    host, other, z = owed_session_of_killed_a(cl, cid, "gap/#", None)
    cl.partition(host, [other])  # (partition a's high watermark stops: its in-sync set is {host, other})
    s = paho_client(cl[z].port, client_id=cid, version=4, clean=False, connect=False)
    s.connect("127.0.0.1", cl[z].port, keepalive=60)
    s.loop_start()
    pub = paho_client(cl[z].port)
    sent = []
    try:
        for burst in range(3):  # (the first past the second a removal takes, the last past the relay's 5 s)
            time.sleep(2.5)
            for i in range(5):
                payload = f"{burst}-{i}".encode()
                pub.publish("gap/x", payload, 1).wait_for_publish(10)
                sent.append(payload)
        assert not s.connected_event.is_set(), "the session moved although b's partition could not commit"
        cl.heal()
        assert s.connected_event.wait(30), "no CONNACK after the heal"
        assert s.connack[1].session_present, s.connack
        got = []
        wait_for(lambda: got.extend(m.payload for m in drain(s)) or set(sent) <= set(got), 30, 0.2)
        assert sorted(set(got)) == sorted(sent), f"missing {sorted(set(sent) - set(got))}"
    finally:
        for c in (s, pub):
            c.disconnect()
            c.loop_stop()


def test_a_client_that_gives_up_a_claiming_connect_finds_its_session_elsewhere(cluster, raw_client):
    """A client's CONNECT (clean start 0) on node Z waits while its session is handed over
    from the hosted broker of a killed node a, which cannot commit (its two in-sync
    replicas are cut from each other); the client gives up and connects to another node W.
    W's ask reaches a's broker after it handed the session to Z: it says so, W asks Z,
    which answers once its own claim is over (the session it took for a client that
    left). The client gets its session on W (session present 1, with the message queued
    for it), not a new one."""
    cl = cluster(nodes="abcd")
    cid = uid("gaveup")
    host, other, z = owed_session_of_killed_a(cl, cid)
    cl.partition(host, [other])  # (partition a's high watermark stops: its in-sync set is {host, other})
    first = raw_client(cl[z].port, C.MQTT311)
    first.send(Connect(cid, version=C.MQTT311, clean_start=False))
    time.sleep(2.0)  # (b has handed the session to z, held until committed)
    first.sock.close()  # (the client gives up)
    s = paho_client(cl[host].port, client_id=cid, version=4, clean=False, connect=False)
    try:
        s.connect("127.0.0.1", cl[host].port, keepalive=60)
        s.loop_start()
        time.sleep(2.0)
        cl.heal()
        assert s.connected_event.wait(30), "no CONNACK"
        assert s.connack[1].session_present, "the session was lost: a new one was made"
        got = []
        assert wait_for(lambda: got.extend(m.payload for m in drain(s)) or got, 20, 0.2), "the owed message never came"
        assert got == [b"kept for it"], got
    finally:
        s.disconnect()
        s.loop_stop()


def test_replication_runs_over_the_links_mutual_tls(cluster, tmp_path):
    """With `[cluster] tls = true` the followers' replication connections run the links'
    mutual TLS on the link port: three nodes keep every partition's replicas in sync, what a
    acknowledged is on a follower that takes a's partition over after kill -9, and a node
    whose certificate another CA signed follows nothing and is followed by nobody."""
    good, files = link_certificates(tmp_path)
    cl = cluster(nodes="abcd", options=good)
    for n in "abcd":  # (the harness's relays read a link's HELLO, which TLS hides: connect directly)
        cl.node_options[n] = {"cluster": {"advertise": f"127.0.0.1:{cl[n].link_port}"}}
    cl.node_options["d"]["cluster"].update(certfile=str(files["rogue"][0]), cafile=str(files["rogue"][1]))
    for n in "abc":
        cl[n].start(wait=False)
    for n in "abc":
        cl[n].wait_serving()
    assert wait_for(lambda: partitions_whole(cl, "abc"), 60, 0.25), f"{records(cl)} {status(cl)}"
    pub = paho_client(cl["a"].port)
    try:
        for i in range(20):
            publish(pub, "tls/x", b"%d" % i, 1, timeout=10)  # (acknowledged: on a follower too)
    finally:
        pub.disconnect()
        pub.loop_stop()
    cl["a"].kill()
    host = wait_for(lambda: taken_over(cl, "a"), 40, 0.1)
    assert host in ("b", "c"), f"{records(cl)} {status(cl)}"
    assert status(cl)["a"]["log_end"] >= 20, status(cl)
    cl["d"].start()
    time.sleep(3 * cl.lease_ttl)  # (time for d to be picked as a follower and to try to fetch)
    recs = records(cl)
    assert recs["d"]["isr"] == ["d"], recs
    assert all("d" not in rec["isr"] for p, rec in recs.items() if p != "d"), recs
    assert wait_for(lambda: "CERTIFICATE_VERIFY_FAILED" in cl["d"].log, 30, 0.5), cl["d"].log[-3000:]


def owed_session_of_killed_a(cl, cid, flt="owed/#", owed=b"kept for it", also=()):
    """Client `cid`'s persistent session on node a (and those of the client ids in `also`),
    subscribed to `flt`, with message `owed` (on owed/1, unless None) queued for it; a then
    killed and its partition taken over. (host: the node hosting a's broker, b: a's other
    replica, z: the node that is no replica of a)."""
    cl.start()
    wait_whole(cl)
    for client_id in (cid, *also):
        s = paho_client(cl["a"].port, client_id=client_id, version=4, clean=False)
        assert sub(s, flt, 1) == [1]
        s.disconnect()
        s.loop_stop()
    if owed is not None:
        pub = paho_client(cl["a"].port)
        pub.publish("owed/1", owed, 1).wait_for_publish(10)
        pub.disconnect()
        pub.loop_stop()
    time.sleep(1.0)  # (the session and its message committed on a's replicas)
    replicas = records(cl)["a"]["replicas"]
    (z,) = set("bcd") - set(replicas)
    cl["a"].kill()
    host = wait_for(lambda: taken_over(cl, "a"), 40, 0.1)
    assert host, f"nobody took a over: {records(cl)} {status(cl)}"
    (b,) = set(replicas) - {"a", host}
    return host, b, z


def a_back(cl):
    """Restart the killed a; wait until it has taken its partition back."""
    cl["a"].start(wait=False)
    assert wait_for(lambda: records(cl)["a"]["leader"] == "a" and status(cl)["a"]["state"] == "serving", 60, 0.1), \
        f"a did not take its partition back: {records(cl)} {status(cl)}"


def assert_session_back(second):
    """`second` (a RawClient that sent CONNECT with clean start 0) got the session of
    `owed_session_of_killed_a`."""
    ack = raw_next(second, C.CONNACK, 60)
    assert ack is not None and ack.reason_code == 0, ack
    assert ack.session_present, "the session was lost: a new one was made"
    msg = raw_next(second, C.PUBLISH, 20)
    assert msg is not None and msg.payload == b"kept for it", msg


def claim_given_up(cl, raw_client, cid, b):
    """The client connects to `b`, which claims its session from a's hosted broker; the
    client gives up (closes) before the session comes (the hosted broker's answer to b
    waits, held by the harness's relay, until `cl.net.heal("a", b)`)."""
    cl.net.cut("a", b)
    first = raw_client(cl[b].port, C.MQTT311)
    first.send(Connect(cid, version=C.MQTT311, clean_start=False))
    time.sleep(2.0)  # (b's ask is at the hosted broker, which hands the session over)
    first.sock.close()


def test_a_session_claimed_for_a_client_that_left_is_found_after_the_hand_back(cluster, raw_client):
    """A client of a killed node a connects (clean start 0) to node B, which claims its session
    from a's hosted broker; the client gives up before the session comes and connects to node Z,
    which reads etcd (a still holds the client) and asks partition a. B gets the session after
    the client left: it keeps it and registers the client. a comes back and takes its partition
    back before Z's ask is answered: the restarted a holds none of the session (B took it) and
    knows nothing of where it went (the hosted broker that handed it over is gone). Z asks the
    node etcd names now (B) instead of starting a new session: session present 1, and the
    message queued for it."""
    cl = cluster(nodes="abcd", extra_toml="[limits]\nconnect_timeout = 60\n")
    cid = uid("claimleft")
    host, b, z = owed_session_of_killed_a(cl, cid)
    # (the harness's relays carry what a node, hosted or not, sends on its links under its
    # name: the hosted broker's answer to z waits too)
    cl.net.cut("a", z)
    claim_given_up(cl, raw_client, cid, b)
    second = raw_client(cl[z].port, C.MQTT311)
    second.send(Connect(cid, version=C.MQTT311, clean_start=False))
    time.sleep(1.0)  # (z has read etcd, which names a, and asked a's hosted broker)
    cl.net.heal("a", b)
    assert wait_for(lambda: cl.client_owners().get(cid) == b, 10, 0.1), \
        f"node {b} did not register the session it took: {cl.client_owners().get(cid)}"
    a_back(cl)
    cl.net.heal("a", z)  # (z's ask goes to a now: its link to the hosted broker went with it)
    assert_session_back(second)


def test_a_claim_outlasting_the_connect_timeout_gets_the_session(cluster, raw_client):
    """The connect timeout bounds a client that does not send its CONNECT, not the wait for
    its session: a client of the killed node a connects (MQTT 5, clean start 0) to node B,
    whose claim of the session from a's hosted broker waits (the answer held by the harness's
    relay) twice as long as B's 3 s connect timeout. The CONNECT stays open and gets CONNACK
    session present 1 and the message queued for the session; then its keepalive (2 s: 3 s
    without a packet) is enforced, though the connect-timeout check it would have started
    with was skipped while the claim waited."""
    cl = cluster(nodes="abcd", extra_toml="[limits]\nconnect_timeout = 3\n")
    cid = uid("claimslow")
    host, b, z = owed_session_of_killed_a(cl, cid)
    cl.net.cut("a", b)  # (the hosted broker's answer to b waits)
    first = raw_client(cl[b].port, C.MQTT5)
    first.send(Connect(cid, version=C.MQTT5, clean_start=False, keepalive=2))
    try:
        early = first.recv(6.0)
    except TimeoutError:
        early = "nothing"  # (still waiting, as it should)
    assert early == "nothing", f"b answered (or closed) the CONNECT before its session came: {early}"
    cl.net.heal("a", b)
    ack = raw_next(first, C.CONNACK, 30)
    assert ack is not None and ack.reason_code == 0, ack
    assert ack.session_present, "the session was lost: a new one was made"
    msg = raw_next(first, C.PUBLISH, 20)
    assert msg is not None and msg.payload == b"kept for it", msg
    assert first.closed(20), "the client's keepalive was not enforced after the claim"


def test_a_session_claimed_for_a_connection_closed_meanwhile_is_registered(cluster, raw_client):
    """A claim that outlasts its own bound (lease_ttl + 10 s and the etcd read): node B refuses
    the client's CONNECT, telling it the server is unavailable (3.1.1 return code 3, MQTT 5 0x88;
    the client did nothing wrong and is to come back), while the client has not closed its end,
    then gets the session from a's hosted broker. B keeps it, and registers the client in etcd,
    so that the client's next CONNECT, on node Z after a took its partition back (the restarted
    a holds none of the session), finds it on B: session present 1, and the message queued for
    it."""
    cl = cluster(nodes="abcd")
    cid, cid5 = uid("claimclosed"), uid("claimclosed5")
    host, b, z = owed_session_of_killed_a(cl, cid, also=(cid5,))
    cl.net.cut("a", b)  # (the hosted broker's answers to b wait)
    first = raw_client(cl[b].port, C.MQTT311)
    first.send(Connect(cid, version=C.MQTT311, clean_start=False))
    first5 = raw_client(cl[b].port, C.MQTT5)
    first5.send(Connect(cid5, version=C.MQTT5, clean_start=False))
    bound = cl.lease_ttl + 10 + 2.0  # (the claim's, with the harness's etcd_timeout)
    started = time.monotonic()
    refusal = raw_next(first, C.CONNACK, bound + 20)
    assert refusal is not None, "b did not answer the CONNECT whose claim outlasted its bound"
    assert refusal.reason_code == C.CONNACK_REFUSED_SERVER_UNAVAILABLE and not refusal.session_present, refusal
    assert time.monotonic() - started >= bound - 1.0, "refused before the claim's bound"
    refusal5 = raw_next(first5, C.CONNACK, 10)
    assert refusal5 is not None and refusal5.reason_code == C.SERVER_UNAVAILABLE, refusal5
    cl.net.heal("a", b)  # (the sessions come while b still lingers on the connections it closed)
    assert wait_for(lambda: cl.client_owners().get(cid) == b, 10, 0.1), \
        f"node {b} did not register the session it took: {cl.client_owners().get(cid)}"
    first.sock.close()
    a_back(cl)
    cl.wait_stable()
    second = raw_client(cl[z].port, C.MQTT311)
    second.send(Connect(cid, version=C.MQTT311, clean_start=False))
    assert_session_back(second)


def test_a_session_claimed_for_a_client_that_left_survives_its_new_node(cluster, raw_client):
    """A session node B took for a client that had left is stored and replicated as any of B's
    sessions: B killed, the client's CONNECT on node Z gets it from B's hosted broker."""
    cl = cluster(nodes="abcd")
    cid = uid("claimkept")
    host, b, z = owed_session_of_killed_a(cl, cid)
    claim_given_up(cl, raw_client, cid, b)
    cl.net.heal("a", b)
    assert wait_for(lambda: cl.client_owners().get(cid) == b, 10, 0.1), \
        f"node {b} did not register the session it took: {cl.client_owners().get(cid)}"
    a_back(cl)
    wait_whole(cl)  # (b's partition in sync on its replicas: one node lost at a time)
    cl[b].kill()
    assert wait_for(lambda: taken_over(cl, b), 40, 0.1), f"nobody took {b} over: {records(cl)} {status(cl)}"
    second = raw_client(cl[z].port, C.MQTT311)
    second.send(Connect(cid, version=C.MQTT311, clean_start=False))
    assert_session_back(second)
