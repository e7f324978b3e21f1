"""The fault harness itself (cluster_harness.py, chaos_workload.py, chaos_checker.py).

What the high-availability tests and `make chaos` rely on is proven here, against the
cluster as it is (no replication: `[cluster] replicas` 1): a 3-member etcd keeps a quorum
with a member down; a partition cuts what it says and heals; a node cut from etcd keeps its
links; the workload and checker pass a kill -9 and restart of a node (its data dir kept:
nothing acknowledged is lost) and report the loss when a node's data dir is lost for good.
The checker's rules are also tested on made-up logs, so that a check that cannot fail would
show here.
"""

import socket
import threading
import time

import pytest

from chaos_checker import PublisherLog, SubscriberLog, check, unavailability
from cluster_harness import Cluster, EtcdCluster, Network, under_load
from conftest import paho_client
from mqtt_helpers import drain, publish, sub, uid, wait_for
from wrenmq.cluster import frames as F

TTL = 3  # lease_ttl of these clusters (s)


@pytest.fixture(scope="module")
def etcd3(tmp_path_factory):
    e = EtcdCluster(tmp_path_factory.mktemp("etcd3"), size=3)
    yield e
    e.close()


@pytest.fixture
def cluster(tmp_path, etcd3):
    made = []

    def factory(**kw):
        c = Cluster(tmp_path / f"cl{len(made)}", etcd3, lease_ttl=TTL, **kw)
        made.append(c)
        return c.start()

    yield factory
    for c in made:
        c.close()


def received(client, n, timeout=10.0):
    """The payloads `client` receives until it has `n` (or `timeout` seconds pass)."""
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += [m.payload for m in drain(client, 0.05)]
    return got


# --- etcd -----------------------------------------------------------------------------------------


def test_three_member_etcd_keeps_a_quorum_with_one_member_killed(etcd3):
    key = f"/harness/{uid('k')}"
    etcd3.kill(1)
    try:
        assert wait_for(lambda: etcd3.health() == {"e1": True, "e2": False, "e3": True}, 15, 0.1), etcd3.health()
        etcd3.put(key, "written with e2 down")
        assert etcd3.get_prefix(key) == {key: "written with e2 down"}
    finally:
        etcd3.restart(1)
    assert etcd3.health() == {"e1": True, "e2": True, "e3": True}
    # The member that was down has the write (read from it alone, not through the leader).
    assert wait_for(lambda: etcd3.members[1].local_get(key) == "written with e2 down", 10, 0.1)


# --- the network ----------------------------------------------------------------------------------


def _echo_server():
    """A loopback server echoing what it gets: its port."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve(conn):
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return srv


def _recv(sock, n, timeout):
    sock.settimeout(timeout)
    got = b""
    try:
        while len(got) < n:
            data = sock.recv(n - len(got))
            if not data:
                break
            got += data
    except socket.timeout:
        pass
    return got


def _closed(sock, timeout=2.0):
    """True if the other end closes or resets `sock` within `timeout`."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_relays_stall_and_reset_what_a_cut_separates():
    srv = _echo_server()
    net = Network()
    try:
        port = net.relay(srv.getsockname()[1], dst="b", src="a")  # a's way to b
        link = net.relay(srv.getsockname()[1], dst="b")  # b's link port: the HELLO names who connects
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"one")
        assert _recv(s, 3, 2) == b"one"
        net.cut("a", "b")  # stall: nothing passes, the connection stays open
        s.sendall(b"two")
        assert _recv(s, 3, 0.5) == b""
        hello = F.encode_hello("cl", "c", "secret")
        other = socket.create_connection(("127.0.0.1", link))  # node c is not cut from b
        other.sendall(hello)
        assert _recv(other, len(hello), 2) == hello
        held = socket.create_connection(("127.0.0.1", link))
        held.sendall(F.encode_hello("cl", "a", "secret"))  # node a is: its new link is held
        assert _recv(held, 1, 0.5) == b""
        net.heal()
        assert _recv(s, 3, 2) == b"two"  # what waited goes on, in order
        assert _recv(held, len(hello), 2) == F.encode_hello("cl", "a", "secret")  # the held link reaches b now
        net.cut("b", "a", mode="reset")  # reset: connections reset, new ones refused
        assert _closed(s) and _closed(held)
        assert _closed(socket.create_connection(("127.0.0.1", port)))
        assert not _closed(other, 0.2)  # (c's link to b was not touched)
        other.sendall(b"still")
        assert _recv(other, 5, 2) == b"still"
    finally:
        net.close()
        srv.close()


def test_a_partition_cuts_the_links_and_leaves_etcd(cluster, clients):
    cl = cluster()
    s_a = clients(cl["a"].port)
    s_c = clients(cl["c"].port)
    sub(s_a, "part/#", 1)
    sub(s_c, "part/#", 1)
    pub = clients(cl["b"].port)
    publish(pub, "part/0", b"before", 1)
    assert received(s_a, 1) == [b"before"]
    cl.partition("a")  # a <-/-> b, c; each of them still reaches etcd
    cut_at = time.monotonic()
    publish(pub, "part/1", b"during", 1)
    assert received(s_c, 2) == [b"before", b"during"]
    assert drain(s_a, 1.0) == []
    # Past the lease: a kept it (etcd answers it), and each side sees its links to the other silent.
    assert wait_for(lambda: cl.link_view("b").get("a") == "silent" == cl.link_view("c").get("a")
                      and set(cl.link_view("a").values()) == {"silent"}, 20, 0.25), \
        (cl.link_view("a"), cl.link_view("b"))
    assert time.monotonic() - cut_at > TTL and cl.registered() == {"a", "b", "c"}
    assert cl["a"].metrics()["wrenmq_cluster_etcd_connected"] == 1
    cl.heal()
    assert received(s_a, 1) == [b"during"]
    assert wait_for(lambda: set(cl.link_view("a").values()) == {"up"} == set(cl.link_view("b").values()), 20, 0.25)
    cl.wait_stable()


def test_a_node_cut_from_etcd_keeps_its_links(cluster, clients):
    cl = cluster()
    s_b = clients(cl["b"].port)
    sub(s_b, "ec/#", 1)
    pub = clients(cl["a"].port)
    publish(pub, "ec/0", b"before", 1)
    assert received(s_b, 1) == [b"before"]
    cl.cut_from_etcd("a", mode="reset")
    assert wait_for(lambda: cl["a"].metrics().get("wrenmq_cluster_etcd_connected") == 0, 10, 0.1)
    assert cl["b"].metrics()["wrenmq_cluster_etcd_connected"] == 1
    publish(pub, "ec/1", b"over the link", 1)  # no etcd for a: its link to b carries it
    assert received(s_b, 1) == [b"over the link"]
    # etcd, which the others still reach, lets a's lease run out.
    assert wait_for(lambda: "a" not in cl.registered(), TTL + 10, 0.1)
    cl.heal()
    cl.wait_stable()
    assert cl.registered() == {"a", "b", "c"}


def test_ownership_shows_a_client_id_held_by_two_nodes_until_the_first_is_back(cluster, clients):
    # A node cut from etcd keeps the sessions it holds while its lease, and with it the
    # client's registration, runs out: the client, connecting to another node with clean
    # start 0, gets a new session there. Two nodes hold its id until the first is back,
    # which then finds the client registered elsewhere and ends its own session, leaving
    # the client's connection alone. A client that connected to the cut node meanwhile
    # (after it had registered on another one) is that node's: its registration is the
    # newest.
    cl = cluster()
    props = {"SessionExpiryInterval": 300}
    ids = uid("owned")
    cid, back = f"{ids}-moved", f"{ids}-back"
    for c in (cid, back):
        clients(cl["a"].port, client_id=c, clean=False, properties=props).disconnect()
    assert wait_for(lambda: cl.client_owners().get(cid) == "a" == cl.client_owners().get(back), 5, 0.1)
    assert cl.ownership({}, cid) == {"bad": 0, "problems": []}
    cl.cut_from_etcd("a", mode="reset")
    assert wait_for(lambda: "a" not in cl.registered(), TTL + 10, 0.1)
    moved = clients(cl["b"].port, client_id=cid, clean=False, properties=props)
    moved._reconnect_on_failure = False
    clients(cl["b"].port, client_id=back, clean=False, properties=props).disconnect()
    assert wait_for(lambda: cl.client_owners().get(cid) == "b" == cl.client_owners().get(back), 5, 0.1)
    own = cl.ownership({cid: "b"}, cid)
    assert own["bad"] == 1 and own["problems"] == [f"{cid}: held by [('a', False), ('b', True)]"], own
    returned = clients(cl["a"].port, client_id=back, clean=False, properties=props)  # (a still cut)
    returned._reconnect_on_failure = False
    assert returned.connack[1].session_present  # (a's session: a cannot ask etcd for b's)
    cl.heal()
    cl.wait_stable()
    expected = {cid: "b", back: "a"}
    assert wait_for(lambda: cl.ownership(expected, ids)["bad"] == 0, 10, 0.25), cl.ownership(expected, ids)
    assert not moved.disconnected_event.is_set() and not returned.disconnected_event.is_set()


# --- workload and checker on real faults ----------------------------------------------------------


def _run(cl, fault, failover="home"):
    """The standard workload over `cl` through `fault()` (under_load): the checker's Report."""
    report = under_load(cl, fault, rate=8.0, failover=failover)
    print(f"\n{fault.__doc__}: {report.summary()}")
    assert report.pending == 0 and report.protocol_errors == 0, report.summary()
    return report


def test_kill9_and_restart_on_its_data_dir_loses_nothing_acknowledged(cluster):
    cl = cluster()

    def kill_and_restart():
        """kill -9 of node b under load, restarted on its data dir"""
        cl["b"].kill()
        time.sleep(1.0)
        cl["b"].restart()

    r = _run(cl, kill_and_restart)
    assert r.ok, r.summary()
    assert r.acknowledged > 100 and r.expected > 6 * 100  # (a real load, to every subscriber)
    assert r.sessions_lost == 0 and r.failovers == 0 and r.recovery is not None
    assert r.reconnects >= 4 and r.unavailable > 1.0  # b's four clients came back after b did


def test_kill9_with_failover_the_restarted_node_takes_no_client_back(cluster):
    # The clients of a node killed with kill -9 reconnect to the other nodes (clean start
    # 0; session present 0: without replication their sessions are on the dead node's
    # disk, so what was published for them before they subscribed again is lost). The
    # node, restarted on its data dir, must not register them as its own again: that
    # would close their connections (0x8E) and bring their old sessions back, with
    # messages they had had (QoS 2 duplicates, out of order).
    cl = cluster()

    def kill_and_restart():
        """kill -9 of node b under load, its clients failing over, b restarted on its data dir"""
        cl["b"].kill()
        time.sleep(1.0)
        cl["b"].restart()

    r = _run(cl, kill_and_restart, failover="any")
    assert r.duplicates == r.out_of_order == r.unknown == r.owners_bad == r.retained_bad == 0, r.summary()
    assert r.failovers >= 4 and r.sessions_lost == 4  # b's four clients, once each


def test_without_replication_a_node_lost_for_good_loses_acknowledged_messages(cluster):
    # The limit of [cluster] replicas = 1: a node's sessions live on its disk alone. Its
    # data dir deleted and an empty node started under its name, its clients reconnect to
    # the other nodes (clean start 0), find no session there (session present 0: the node
    # that held it does not answer) and its subscribers miss what was acknowledged before
    # they subscribed again. The checker must say so. With replicas 3 / min_insync 2 the
    # same scenario loses nothing (test_ha_failover.py,
    # test_with_replication_a_node_lost_for_good_loses_nothing_acknowledged).
    cl = cluster()

    def lose_b():
        """node b lost for good (kill -9, data dir deleted, empty node started)"""
        cl["b"].wipe()

    r = _run(cl, lose_b, failover="any")
    assert r.lost > 0, r.summary()
    assert r.failovers >= 4 and r.sessions_lost >= 4  # b's two subscribers and two publishers
    assert r.retained_bad == 0 and r.owners_bad == 0, r.summary()


# --- the checker's rules on made-up logs ------------------------------------------------------------


def _pub(name, qos, acked, sent=None, retain=()):
    t0 = 1000.0
    sent = sent if sent is not None else acked
    log = PublisherLog(name, qos)
    for seq in sent:
        topic = f"t/r/{name}" if seq in retain else f"t/m/{name}"
        payload = b"" if seq in retain and seq % 2 else f"{name}:{seq}".encode()
        log.sent[seq] = (t0 + seq, topic, payload, seq in retain)
    for seq in acked:
        log.acked[seq] = t0 + seq + 0.5
    log.connects = [(t0, "a", False)]
    return log


def _sub(name, got, qos=2, subscribed_at=999.0, connects=None):
    log = SubscriberLog(name, qos, "t/m/#", subscribed_at)
    log.deliveries = [(1000.0 + i, f"t/m/{p}", f"{p}:{seq}".encode(), q, False, False, "a", i)
                      for i, (p, seq, q) in enumerate(got)]
    log.connects = connects or [(999.0, "a", False)]
    return log


def test_a_publisher_whose_pubrel_gets_pubcomp_0x92_has_it_acknowledged_and_never_sends_it_again(broker):
    """A QoS 2 message past PUBREC whose PUBCOMP was lost with its node: the session's new
    node completed the exchange already (its log had the release) and answers the PUBREL
    sent again with PUBCOMP 0x92, packet identifier not found. The workload's publisher
    counts the message acknowledged and never publishes it again: a new PUBLISH of it
    would be a second message no broker can tell from the first (a QoS 2 duplicate the
    checker would blame on the cluster)."""
    from chaos_workload import Publisher
    from wrenmq.mqtt import constants as C

    cid = uid("pubrel")
    keep = paho_client(broker.port, client_id=cid, clean=False, properties={"SessionExpiryInterval": 600})
    keep.disconnect()
    keep.loop_stop()
    p = Publisher("p", C.MQTT5, 2, {"x": broker.port}, "x", "t", rate=10.0, cid=cid)
    p.publishing = False
    p.log.sent[0] = (time.time(), "t/m/p", b"p:0", False)
    p.next_seq = 1
    p.inflight[7] = [0, "pubrel"]  # (its PUBREC came, its PUBREL went; PUBCOMP did not)
    p.start()
    try:
        assert wait_for(lambda: p.snapshot().acked, 10), p.snapshot()
        time.sleep(0.5)
    finally:
        p.stop()
    log = p.snapshot()
    assert list(log.acked) == [0] and log.refused == 0 and p.pending == 0
    assert log.connects and log.connects[0][2] is True  # (session present: the PUBREL was sent again)


def test_checker_counts_what_was_lost_duplicated_or_reordered():
    p = _pub("p", 2, acked=[0, 1, 2, 3, 4], sent=[0, 1, 2, 3, 4, 5])
    whole = _sub("whole", [("p", s, 2) for s in (0, 1, 2, 3, 4, 5)])
    assert check([p], [whole]).ok and check([p], [whole]).expected == 5  # 5 unacknowledged: not owed
    r = check([p], [_sub("bad", [("p", 0, 2), ("p", 2, 2), ("p", 1, 2), ("p", 2, 2), ("p", 9, 2)])])
    assert (r.lost, r.duplicates, r.out_of_order, r.unknown) == (2, 1, 1, 1)  # 3, 4 lost; 2 twice; 1 late; 9
    q1 = _pub("q", 1, acked=[0, 1])
    r = check([q1], [_sub("s", [("q", 0, 1), ("q", 1, 1), ("q", 0, 1)], qos=1)])
    assert r.ok and r.qos1_repeats == 1  # QoS 1 may come twice
    late = _sub("late", [("p", 4, 2)], subscribed_at=1003.5)  # subscribed after 0-3 were sent
    assert check([p], [late]).ok


def test_checker_holds_retained_state_to_the_last_acknowledged_change():
    p = _pub("p", 1, acked=[0, 1, 2, 3], sent=[0, 1, 2, 3, 4], retain=(2, 3, 4))  # 2 set, 3 clear, 4 set (unacked)
    assert check([p], [], retained={"a": {}}).retained_bad == 0  # cleared by 3
    assert check([p], [], retained={"a": {"t/r/p": b"p:4"}}).retained_bad == 0  # 4 may have landed
    r = check([p], [], retained={"a": {"t/r/p": b"p:2"}, "b": {"t/r/x": b"x:1"}})
    assert r.retained_bad == 2  # a took back a cleared value; b has a topic nobody set


def test_checker_reports_failovers_lost_sessions_and_the_longest_gap():
    p = _pub("p", 1, acked=[0, 1, 2, 6, 7], sent=[0, 1, 2, 3, 4, 5, 6, 7])
    p.connects = [(1000, "a", False), (1003, "b", False), (1004, "b", True)]
    assert check([p], []).ok
    r = check([p], [], ownership={"bad": 1})
    assert (r.failovers, r.sessions_lost, r.reconnects, r.owners_bad) == (1, 1, 2, 1) and not r.ok
    p.taken_over = [(1005.0, "b")]  # a node closed its only connection for "another" one
    assert check([p], []).owners_bad == 1
    assert unavailability(p) == pytest.approx(4.0)  # acknowledgements at 1002.5, then 1006.5
