"""High availability with real processes: `[cluster] replicas = 3, min_insync = 2` on
`wrenmq serve` nodes, a real etcd and real MQTT clients (ha_helpers.py).

Each test runs its own cluster (a unique [cluster] name) against one etcd server for the
module, with a short lease (3 s) and small loads: the long runs are `make chaos`.
"""

import sqlite3
import time

import pytest

from ha_helpers import Etcd, HACluster
from mqtt_helpers import drain, publish, raw_connect, raw_next, session_present, sub, uid, unsub, wait_for
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.packets import Publish
from wrenmq.config import load
from wrenmq.store.replica import ReplicaLog

TABLES = ("sessions", "subscriptions", "retained", "qos2_in", "outgoing")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    e = Etcd(tmp_path_factory.mktemp("etcd"))
    yield e
    e.close()


@pytest.fixture
def ha(tmp_path, etcd):
    made = []

    def factory(**kw):
        cl = HACluster(tmp_path / f"cl{len(made)}", etcd, **kw)
        made.append(cl)
        return cl

    yield factory
    for cl in made:
        cl.close()


def state_tables(path):
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {t: sorted(conn.execute(f"SELECT * FROM {t}").fetchall(), key=repr) for t in TABLES}
    finally:
        conn.close()


def meta(path):
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return dict(conn.execute("SELECT key, value FROM meta").fetchall())
    finally:
        conn.close()


def caught_up(cl):
    """Every leader's figures: HW at its log end and every replica at it."""
    status = cl.status()
    if set(status) != set(cl.nodes):
        return False
    for p, s in status.items():
        if s["hw"] != s["log_end"] or any(r["end"] != s["log_end"] for r in s["replicas"].values()):
            return False
    return True


def test_followers_logs_and_state_equal_the_leaders(ha, clients):
    """Messages and session state published on every node end up byte for byte the same on
    the partition's three replicas: the followers' logs hold the leader's records at the
    same offsets, and their state databases, applied from the state records up to the
    high watermark, hold the leader's sessions, subscriptions and retained messages."""
    cl = ha().start()
    for name, node in cl.nodes.items():
        sub_ = clients(node.port, client_id=uid(f"s{name}"), clean=False, properties={"SessionExpiryInterval": 600})
        sub(sub_, f"rt/{name}/#", 1)
        pub = clients(node.port)
        for i in range(20):
            publish(pub, f"rt/{name}/{i}", f"{name}-{i}".encode(), qos=1 + i % 2, retain=i % 5 == 0)
        got = drain(sub_, 1.0)
        assert sorted(m.payload for m in got if not m.retain) == sorted(f"{name}-{i}".encode() for i in range(20))
    assert wait_for(lambda: caught_up(cl), 30, 0.25), cl.status()
    for node in cl.nodes.values():
        node.kill()
    for p in cl.nodes:
        leader = cl[p].log_records(p)
        assert len(leader) >= 20
        leader_db = cl[p].partition_dir(p) / "state.db"
        leader_state = state_tables(leader_db)
        assert leader_state["sessions"] and leader_state["subscriptions"] and leader_state["retained"]
        committed = int(meta(leader_db)["applied_through"])
        for other in cl.nodes.values():
            if other.name != p:
                assert other.log_records(p) == leader, f"{other.name}'s copy of {p} differs"
                # A follower applies what it knows is committed; the last HW may not have
                # reached it when it was killed: it applies the rest, from its own log.
                rep = ReplicaLog(other.partition_dir(p), p, load(text=f"[storage]\ndata_dir = '{other.data_dir}'"))
                rep.start()
                rep.apply_through(committed)
                rep.close()
                assert rep.applied_through == committed
                assert state_tables(other.partition_dir(p) / "state.db") == leader_state, \
                    f"{other.name}'s state of {p} differs"


def await_route(pub, subscriber, topic):
    """Probes published on `topic` until `subscriber` gets one (its route reached the
    publisher's node); drains them."""
    def probe():
        publish(pub, topic, b"probe", 1)
        return any(m.payload == b"probe" for m in drain(subscriber, 0.2))
    assert wait_for(probe, 20, 0.1), f"{topic} never reached the subscriber"
    time.sleep(0.3)
    drain(subscriber)


def test_acknowledgements_and_forwards_wait_for_every_in_sync_replica(ha, clients):
    """min_insync = 3: a QoS 1 PUBLISH on node a is acknowledged, delivered to a subscriber
    on a and forwarded to one on node b only once all three replicas hold it. With node c
    stopped (SIGSTOP, well within its lease) nothing leaves node a for the message; once c
    runs again, the PUBACK and both deliveries come. (Without the commit gate on the links,
    the subscriber on b got the message at once: the message was seen elsewhere while a
    crash of a could still lose it.)"""
    cl = ha(min_insync=3, lag_ms=8000, lease_ttl=10).start()
    a, b, c = cl["a"], cl["b"], cl["c"]
    remote = clients(b.port)
    sub(remote, "held/#", 1)
    local = clients(a.port)
    sub(local, "held/#", 1)
    pub = clients(a.port)
    await_route(pub, remote, "held/probe")
    drain(local)
    c.pause()
    try:
        info = pub.publish("held/1", b"wait for c", 1)
        time.sleep(1.5)
        assert not info.is_published(), "acknowledged while a replica of the in-sync set lacked it"
        assert drain(local) == [] and drain(remote) == [], "delivered while a replica of the in-sync set lacked it"
    finally:
        c.resume()
    info.wait_for_publish(10)
    assert info.is_published()
    assert [m.payload for m in drain(remote, 1.0)] == [b"wait for c"]
    assert [m.payload for m in drain(local)] == [b"wait for c"]
    assert any(p == b"wait for c" for _, _, p in c.log_records("a"))


def test_fewer_than_min_insync_in_sync_refuses_qos1_and_qos2(ha, raw_client):
    """With both followers of node a's partition gone (their fetches silent past
    replica_lag_ms), a QoS 1/2 PUBLISH on a is refused before it is logged: MQTT 5 gets
    PUBACK / PUBREC 0x83 with the reason string "not enough in-sync replicas" (not a success
    it could not keep), 3.1.1 has no refusal and its connection is closed."""
    cl = ha(lag_ms=1000).start()
    a = cl["a"]
    cl["b"].kill()
    cl["c"].kill()
    # (A QoS 1/2 PUBLISH that came before the silence was noticed would be logged, and its
    # acknowledgement, with all the output after it, would wait for a follower's return.)
    assert wait_for(lambda: cl.status()["a"]["accepting"] is False, 20, 0.1), cl.status()["a"]
    c, _ = raw_connect(raw_client, a.port, C.MQTT5)
    c.send(Publish("ir/1", b"x", qos=1, packet_id=7))
    ack = raw_next(c, C.PUBACK)
    assert (ack.packet_id, ack.reason_code) == (7, C.IMPLEMENTATION_SPECIFIC_ERROR)
    assert ack.properties.get("reason_string") == "not enough in-sync replicas"
    c.send(Publish("ir/2", b"y", qos=2, packet_id=8))
    rec = raw_next(c, C.PUBREC)
    assert (rec.packet_id, rec.reason_code) == (8, C.IMPLEMENTATION_SPECIFIC_ERROR)
    old, _ = raw_connect(raw_client, a.port, C.MQTT311)
    old.send(Publish("ir/3", b"z", qos=1, packet_id=9))
    assert old.closed(5), "a 3.1.1 publisher kept its connection without an acknowledgement"
    c.send(Publish("ir/4", b"q0", qos=0))  # QoS 0 is still taken
    time.sleep(0.5)
    payloads = {p for _, _, p in a.log_records("a")}
    assert b"q0" in payloads and not payloads & {b"x", b"y", b"z"}, "a refused PUBLISH was logged"


def state_record_run(clients, node, count):
    """`count` state records in a row in `node`'s log: a persistent session's subscription
    changes, one per loop turn (each waits for its acknowledgement), no message between."""
    churn = clients(node.port, client_id=uid("churn"), clean=False, properties={"SessionExpiryInterval": 600},
                    version=5)
    for _ in range(count // 2):
        sub(churn, "churn/x", 1)
        unsub(churn, "churn/x")


def test_a_restarted_cluster_catches_sessions_up_past_a_long_run_of_state_records(ha, clients):
    """A replicated log holds one state record per loop turn that changed session state:
    600 subscription changes in a row, with no message between, are 600 records no read
    returns. A persistent session owed the messages before and after them gets both after
    every node is killed (-9) and restarted: the catch-up from the session's place in the
    log passes over the state records, not over what follows them. (It used to take a read
    that came back empty as the log's end, and the message was never sent.)"""
    cl = ha().start()
    a = cl["a"]
    cid = uid("owed")
    s = clients(a.port, client_id=cid, clean=False, properties={"SessionExpiryInterval": 600}, version=5)
    assert sub(s, "after/#", 1) == [1]
    s.disconnect()
    s.loop_stop()
    pub = clients(a.port)
    publish(pub, "after/0", b"owed 0", qos=1)  # (the session's place in the log: the catch-up starts here)
    state_record_run(clients, a, 600)
    publish(pub, "after/1", b"owed 1", qos=1)
    assert wait_for(lambda: caught_up(cl), 30, 0.25), cl.status()
    for node in cl.nodes.values():
        node.kill()
    offsets = [o for o, t, _ in a.log_records("a") if t == "after/1"]
    assert offsets, "the message is not in node a's log"
    before = [o for o, _, _ in a.log_records("a") if o < offsets[0]]
    assert offsets[0] - (before[-1] if before else -1) > 600, "no long run of state records before the message"
    cl.start()
    s = clients(a.port, client_id=cid, clean=False, properties={"SessionExpiryInterval": 600}, version=5)
    assert session_present(s)
    got = []
    wait_for(lambda: got.extend(m.payload for m in drain(s)) or b"owed 1" in got, 20, 0.2)
    assert got == [b"owed 0", b"owed 1"], got


def test_a_bridge_on_a_replicated_log_passes_over_runs_of_state_records(ha, clients, mosquitto):
    """Each node's bridge sends what its own clients publish, read from its log; with
    replicas > 1 that log holds a state record per loop turn that changed session state,
    which no read returns. 200 subscription changes in a row between two messages do not
    stop the bridge: the second message reaches the remote too. (A read that came back
    empty used to be tried again from the same place, and once more state records than
    one read looks at had piled up there, the bridge sent nothing more.)"""
    remote = mosquitto()
    app = clients(remote.port, client_id=uid("cloud-app"), version=4)
    sub(app, "up/#", 1)
    bridge = (f'[[bridge]]\nname = "cloud"\naddress = "127.0.0.1:{remote.port}"\nreconnect_delay = 0.1\n'
              'reconnect_max = 0.5\n[[bridge.topic]]\npattern = "up/#"\n')
    cl = ha(toml=bridge).start()
    a = cl["a"]
    pub = clients(a.port)
    publish(pub, "up/0", b"first", qos=1)
    got = []
    assert wait_for(lambda: got.extend(m.payload for m in drain(app)) or b"first" in got, 20, 0.2), got
    state_record_run(clients, a, 200)
    publish(pub, "up/1", b"second", qos=1)
    assert wait_for(lambda: got.extend(m.payload for m in drain(app)) or b"second" in got, 20, 0.2), got
    assert got == [b"first", b"second"], got
