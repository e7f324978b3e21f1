"""The admin API of a cluster: every node answers for the whole cluster (it asks the others).

Two `wrenmq serve` nodes with an admin listener each, joined through a real etcd."""

import pytest

from admin_helpers import PASSWORDS, call, make_password_file
from conftest import free_port, wait_port
from mqtt_helpers import uid, wait_for
from test_cluster import Cluster, Etcd  # noqa: F401 (the etcd fixture's class)
from wrenmq.mqtt import constants as C

OPS = ("ops", PASSWORDS["ops"])


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    e = Etcd(tmp_path_factory.mktemp("etcd"))
    yield e
    e.stop()
    e.log.close()


def start_node(cl, name, pwfile, tmp):
    admin = free_port()
    cl.extra_listeners = (f'[[listener]]\nport = 0\n[[listener]]\ntype = "admin"\nport = {admin}\nusers = ["ops"]\n'
                          f'[auth]\npassword_file = "{pwfile}"\nallow_anonymous = true\n')
    node = cl.start(name, storage=f'data_dir = "{tmp / name}"\nfsync = "never"')
    node.admin_port = admin
    wait_port(admin, proc=node.proc)
    return node


def test_every_node_answers_for_the_cluster(tmp_path, etcd):
    pwfile = make_password_file(tmp_path / "passwords")
    cl = Cluster(tmp_path, etcd)
    try:
        a = start_node(cl, "a", pwfile, tmp_path)
        b = start_node(cl, "b", pwfile, tmp_path)
        assert wait_for(lambda: len(call(a.admin_port, "GET", "/api/v1/nodes", OPS)[2]["nodes"]) == 2
                        and all(n["up"] for n in call(a.admin_port, "GET", "/api/v1/nodes", OPS)[2]["nodes"]),
                        timeout=15)
        nodes = call(a.admin_port, "GET", "/api/v1/nodes", OPS)[2]
        assert nodes["cluster"] == cl.name
        assert {n["name"]: n["admin"] for n in nodes["nodes"]} == {
            "a": f"http://127.0.0.1:{a.admin_port}", "b": f"http://127.0.0.1:{b.admin_port}"}

        ids_a, ids_b = [uid("ca") for _ in range(2)], [uid("cb") for _ in range(3)]
        on_a = [cl.client("a", client_id=cid) for cid in ids_a]
        on_b = [cl.client("b", client_id=cid, version=5) for cid in ids_b]
        on_b[0].subscribe("cluster/x", 1)
        ids = sorted(ids_a + ids_b)
        assert all(c.is_connected() for c in on_a + on_b)
        # Any node lists every node's clients, in one order, paged across nodes.
        seen, cursor = [], None
        while True:
            path = "/api/v1/clients?connected=true&limit=2" + (f"&cursor={cursor}" if cursor else "")
            page = call(b.admin_port, "GET", path, OPS)[2]
            assert page["total"] == 5 and "unreachable" not in page
            seen += [(c["client_id"], c["node"]) for c in page["items"]]
            cursor = page["next"]
            if cursor is None:
                break
        assert [cid for cid, _ in seen] == ids
        assert dict(seen) == {**{cid: "a" for cid in ids_a}, **{cid: "b" for cid in ids_b}}
        local = call(a.admin_port, "GET", "/api/v1/clients?connected=true&local=true", OPS)[2]
        assert local["total"] == 2
        # One client, and its kick, through the node it is not on.
        target = ids_b[0]
        one = call(a.admin_port, "GET", f"/api/v1/clients/{target}", OPS)[2]
        assert one["node"] == "b" and [s["filter"] for s in one["subscriptions"]] == ["cluster/x"]
        subs = call(a.admin_port, "GET", "/api/v1/subscriptions?filter=cluster/", OPS)[2]
        assert [(s["client_id"], s["filter"]) for s in subs["items"]] == [(target, "cluster/x")]
        status, _, _ = call(a.admin_port, "DELETE", f"/api/v1/clients/{target}", OPS)
        assert status == 200
        assert on_b[0].disconnected_event.wait(5) and on_b[0].disconnect_reason == C.ADMINISTRATIVE_ACTION
        assert call(a.admin_port, "DELETE", "/api/v1/clients/nobody-anywhere", OPS)[0] == 404
        # A ban made on one node holds on all of them, and is lifted on all.
        banned = uid("ban")
        status, _, ban = call(a.admin_port, "POST", "/api/v1/banned", OPS, {"kind": "client_id", "value": banned})
        assert status == 201 and ban["nodes"] == {"b": 201}
        from test_admin_api import connack_of
        assert connack_of(b.port, banned) == C.BANNED and connack_of(a.port, banned) == C.BANNED
        assert call(b.admin_port, "DELETE", f"/api/v1/banned/client_id/{banned}", OPS)[0] == 204
        assert connack_of(a.port, banned) == 0 and connack_of(b.port, banned) == 0
        # Each node's log partition.
        parts = call(b.admin_port, "GET", "/api/v1/log", OPS)[2]["partitions"]
        assert sorted(p["node"] for p in parts) == ["a", "b"]
        # A node that is gone is named, and the rest answered.
        b.proc.kill()
        b.proc.wait(10)
        page = wait_for(lambda: (lambda p: p if "unreachable" in p or p["total"] == 2 else None)(
            call(a.admin_port, "GET", "/api/v1/clients?connected=true", OPS)[2]), timeout=15)
        assert page and [c["node"] for c in page["items"]] == ["a", "a"]
    finally:
        cl.close()
