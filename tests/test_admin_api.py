"""The admin HTTP API against a real `wrenmq serve` and real MQTT clients (paho, raw sockets).

One broker serves the module (its clients use their own ids, so tests do not meet);
tests that restart a broker start their own.
"""

import json
import socket
import time
import urllib.parse

import pytest

from admin_helpers import PASSWORDS, AdminBroker, call, make_token
from conftest import RawClient, get_messages, paho_client, subscribe
from mqtt_helpers import uid, wait_for
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.packets import Connect

OPS = ("ops", PASSWORDS["ops"])
VIEWER = ("viewer", PASSWORDS["viewer"])


@pytest.fixture(scope="module")
def admin(tmp_path_factory):
    b = AdminBroker(tmp_path_factory.mktemp("admin"))
    b.write_token = make_token(b.token_file, "ci")
    b.read_token = make_token(b.token_file, "grafana", read_only=True)
    yield b
    b.stop()


@pytest.fixture
def pahos(clients):
    """(conftest's `clients`, by the name these tests use)"""
    return clients


def q(text):
    return urllib.parse.quote(text, safe="")


# --- who may do what ---------------------------------------------------------------------


def test_requests_without_or_with_wrong_credentials_are_refused(admin):
    status, headers, body = admin.call("GET", "/api/v1/clients", auth=None)
    assert status == 401 and headers["WWW-Authenticate"].startswith("Basic realm=")
    assert "credentials" in body["error"]
    for auth in (("ops", "wrong"), ("nobody", "x"), ("device", PASSWORDS["device"])):
        started = time.monotonic()
        status, _, _ = admin.call("GET", "/api/v1/clients", auth=auth)
        assert status == 401, auth
        # (a user of the password file the listener does not name is refused as a wrong password is)
        assert time.monotonic() - started >= 0.25, "a refused login is answered after failed_login_delay"
    assert admin.call("GET", "/api/v1/clients", token="ci.not-the-secret")[0] == 401
    assert admin.call("GET", "/api/v1/clients", headers={"Authorization": "Negotiate abc"})[0] == 401
    assert admin.call("GET", "/api/v1/clients", headers={"Authorization": "Basic !!!"})[0] == 401
    # The right ones, and the probe that needs none.
    assert admin.call("GET", "/api/v1/clients")[0] == 200
    assert admin.call("GET", "/api/v1/clients", token=admin.write_token)[0] == 200
    assert admin.call("GET", "/api/v1/clients", token=admin.read_token)[0] == 200
    status, _, body = admin.call("GET", "/health", auth=None)
    assert status == 200 and body["status"] == "ok"
    assert "refused a request" in admin.served.log


def test_read_only_callers_may_read_but_not_change(admin, pahos):
    cid = uid("ro")
    c = pahos(admin.port, client_id=cid)
    for who in ({"auth": VIEWER}, {"token": admin.read_token}):
        assert admin.call("GET", "/api/v1/clients", **who)[0] == 200
        assert admin.call("GET", "/api/v1/whoami", **who)[2]["write"] is False
        status, _, body = admin.call("DELETE", f"/api/v1/clients/{cid}", **who)
        assert status == 403 and "read only" in body["error"]
        assert admin.call("POST", "/api/v1/publish", body={"topic": "x", "payload": "y"}, **who)[0] == 403
        assert admin.call("POST", "/api/v1/banned", body={"kind": "client_id", "value": "x"}, **who)[0] == 403
    assert not c.disconnected_event.is_set()
    me = admin.call("GET", "/api/v1/whoami", token=admin.write_token)[2]
    assert me == {"name": "ci", "how": "token", "write": True, "node": me["node"], "version": me["version"]}


def test_a_revoked_token_is_refused_without_a_reload(admin):
    token = make_token(admin.token_file, "temporary")
    assert admin.call("GET", "/api/v1/stats", token=token)[0] == 200
    from conftest import WRENMQ
    import subprocess
    subprocess.run([WRENMQ, "admin", "token", "revoke", "temporary", "--file", str(admin.token_file)],
                   check=True, capture_output=True, timeout=30)
    listed = subprocess.run([WRENMQ, "admin", "token", "list", "--file", str(admin.token_file)],
                            check=True, capture_output=True, text=True, timeout=30).stdout
    assert "ci\twrite" in listed and "grafana\tread" in listed and "temporary" not in listed
    assert admin.call("GET", "/api/v1/stats", token=token)[0] == 401
    assert token.split(".")[1] not in admin.token_file.read_text(), "the file keeps hashes only"


def test_a_write_from_another_sites_page_is_refused(admin):
    status, _, body = admin.call("POST", "/api/v1/publish", body={"topic": "x/y", "payload": "z"},
                                 headers={"Origin": "https://evil.example"})
    assert status == 403 and "another site" in body["error"]
    status, _, _ = admin.call("POST", "/api/v1/publish", body={"topic": "x/y", "payload": "z"},
                              headers={"Origin": f"http://127.0.0.1:{admin.admin_port}"})
    assert status == 200


# --- clients -------------------------------------------------------------------------------


def test_clients_list_filters_pages_and_details(admin, pahos):
    prefix = uid("pg") + "-"
    made = [pahos(admin.port, client_id=f"{prefix}{i}", version=5 if i % 2 else 4) for i in range(5)]
    subscribe(made[1], "pg/+/temp", qos=1)
    subscribe(made[1], "$share/g/pg/#", qos=0)
    offline = paho_client(admin.port, client_id=f"{prefix}offline", version=5,
                          properties={"SessionExpiryInterval": 300})
    offline.disconnect()
    offline.loop_stop()
    wait_for(lambda: not admin.call("GET", f"/api/v1/clients/{prefix}offline")[2]["connected"])

    seen, cursor, pages = [], None, 0
    while True:
        path = f"/api/v1/clients?prefix={q(prefix)}&limit=2" + (f"&cursor={cursor}" if cursor else "")
        status, _, page = admin.call("GET", path)
        assert status == 200 and page["total"] == 6 and len(page["items"]) <= 2
        seen += [c["client_id"] for c in page["items"]]
        pages += 1
        cursor = page["next"]
        if cursor is None:
            break
    assert pages == 3 and seen == sorted(f"{prefix}{i}" for i in [*range(5), "offline"])

    connected = admin.call("GET", f"/api/v1/clients?prefix={q(prefix)}&connected=true")[2]
    assert connected["total"] == 5
    offline_page = admin.call("GET", f"/api/v1/clients?prefix={q(prefix)}&connected=false")[2]
    assert [c["client_id"] for c in offline_page["items"]] == [f"{prefix}offline"]
    assert admin.call("GET", f"/api/v1/clients?prefix={q(prefix)}&address=10.")[2]["total"] == 0
    assert admin.call("GET", f"/api/v1/clients?prefix={q(prefix)}&address=127.0.0.1:")[2]["total"] == 6

    status, _, one = admin.call("GET", f"/api/v1/clients/{prefix}1")
    assert status == 200
    assert one["connected"] and one["protocol"] == "5.0" and one["keepalive"] == 60
    assert one["address"].startswith("127.0.0.1:") and one["bytes_in"] > 0 and one["packets_in"] >= 2
    assert abs(one["connected_at"] - time.time()) < 60
    assert [(s["filter"], s["qos"], s["share"]) for s in one["subscriptions"]] == [
        ("$share/g/pg/#", 0, "g"), ("pg/+/temp", 1, None)]
    assert admin.call("GET", f"/api/v1/clients/{prefix}0")[2]["protocol"] == "3.1.1"
    assert admin.call("GET", "/api/v1/clients/no-such-client")[0] == 404
    assert admin.call("GET", "/api/v1/clients?limit=0")[0] == 400
    assert admin.call("GET", "/api/v1/clients?cursor=!!")[0] == 400


def test_clients_by_user_and_a_client_id_with_a_slash(admin, pahos):
    cid = uid("dev/ice")
    pahos(admin.port, client_id=cid, username="device", password=PASSWORDS["device"])
    page = admin.call("GET", "/api/v1/clients?user=device")[2]
    assert cid in [c["client_id"] for c in page["items"]]
    status, _, one = admin.call("GET", f"/api/v1/clients/{q(cid)}")
    assert status == 200 and one["client_id"] == cid and one["username"] == "device"


def test_kick_disconnects_with_0x98_and_keeps_the_session(admin, pahos):
    cid = uid("kick")
    c = pahos(admin.port, client_id=cid, version=5, properties={"SessionExpiryInterval": 300})
    subscribe(c, "kick/me", qos=1)
    status, _, body = admin.call("DELETE", f"/api/v1/clients/{cid}")
    assert status == 200 and body == {"client_id": cid, "disconnected": True, "session_ended": False}
    assert c.disconnected_event.wait(5)
    assert c.disconnect_reason == C.ADMINISTRATIVE_ACTION
    c.loop_stop()
    one = wait_for(lambda: (lambda r: r[2] if r[0] == 200 and not r[2]["connected"] else None)(
        admin.call("GET", f"/api/v1/clients/{cid}")))
    assert one and [s["filter"] for s in one["subscriptions"]] == ["kick/me"], "the session stays"
    status, _, body = admin.call("DELETE", f"/api/v1/clients/{cid}")
    assert status == 409 and "session=true" in body["error"]
    # Ending the offline session removes it.
    status, _, body = admin.call("DELETE", f"/api/v1/clients/{cid}?session=true")
    assert status == 200 and body["session_ended"] is True
    assert admin.call("GET", f"/api/v1/clients/{cid}")[0] == 404


def test_kick_with_session_ends_a_connected_clients_session_and_publishes_its_will(admin, pahos):
    watcher = pahos(admin.port, client_id=uid("watch"))
    subscribe(watcher, "wills/+", qos=1)
    cid = uid("gone")
    raw = RawClient(admin.port, C.MQTT5)
    from wrenmq.mqtt.packets import Will
    raw.send(Connect(cid, C.MQTT5, True, 60, Will(f"wills/{cid}", b"bye", 1),
                     properties={"session_expiry_interval": 600}))
    assert raw.recv().TYPE == C.CONNACK
    status, _, _ = admin.call("DELETE", f"/api/v1/clients/{cid}?session=true")
    assert status == 200
    pkt = raw.recv()
    assert pkt.TYPE == C.DISCONNECT and pkt.reason_code == 0x98  # the client reads 0x98
    assert raw.recv() is None
    raw.close()
    got = get_messages(watcher, 1)
    assert [(m.topic, m.payload) for m in got] == [(f"wills/{cid}", b"bye")]
    assert wait_for(lambda: admin.call("GET", f"/api/v1/clients/{cid}")[0] == 404)


# --- subscriptions, retained, publish --------------------------------------------------------


def test_subscriptions_list_by_client_and_filter(admin, pahos):
    a, b = uid("sa"), uid("sb")
    ca, cb = pahos(admin.port, client_id=a), pahos(admin.port, client_id=b, version=5)
    subscribe(ca, "subs/x/#", qos=1)
    subscribe(cb, "subs/y", qos=2)
    subscribe(cb, "$share/workers/subs/jobs", qos=1)
    page = admin.call("GET", f"/api/v1/subscriptions?client_id={b}")[2]
    assert [(s["filter"], s["qos"], s["share"]) for s in page["items"]] == [
        ("$share/workers/subs/jobs", 1, "workers"), ("subs/y", 2, None)]
    page = admin.call("GET", "/api/v1/subscriptions?filter=subs/")[2]
    mine = [(s["client_id"], s["filter"]) for s in page["items"] if s["client_id"] in (a, b)]
    assert mine == [(a, "subs/x/#"), (b, "subs/y")]
    first = admin.call("GET", f"/api/v1/subscriptions?client_id={b}&limit=1")[2]
    rest = admin.call("GET", f"/api/v1/subscriptions?client_id={b}&limit=1&cursor={first['next']}")[2]
    assert [s["filter"] for s in first["items"] + rest["items"]] == ["$share/workers/subs/jobs", "subs/y"]
    assert rest["next"] is None


def test_publish_reaches_subscribers_with_its_properties(admin, pahos):
    sub = pahos(admin.port, client_id=uid("psub"), version=5)
    subscribe(sub, "api/pub/#", qos=2)
    status, _, body = admin.call("POST", "/api/v1/publish", body={
        "topic": "api/pub/text", "payload": "héllo", "qos": 1,
        "properties": {"content_type": "text/plain", "user_properties": [["source", "admin"]],
                       "response_topic": "api/reply", "correlation_data_base64": "AAEC",
                       "message_expiry_interval": 60}})
    assert status == 200 and body["matched"] is True
    status, _, body = admin.call("POST", "/api/v1/publish", token=admin.write_token, body={
        "topic": "api/pub/bin", "payload_base64": "AP8=", "qos": 2})
    assert status == 200
    got = get_messages(sub, 2)
    assert [(m.topic, m.payload, m.qos) for m in got] == [("api/pub/text", "héllo".encode(), 1),
                                                          ("api/pub/bin", b"\x00\xff", 2)]
    p = got[0].properties
    assert p.ContentType == "text/plain" and p.UserProperty == [("source", "admin")]
    assert p.ResponseTopic == "api/reply" and p.CorrelationData == b"\x00\x01\x02"
    assert 0 < p.MessageExpiryInterval <= 60
    # No subscriber: published all the same, and said so.
    assert admin.call("POST", "/api/v1/publish", body={"topic": "api/nobody", "payload": "x"})[2]["matched"] is False


@pytest.mark.parametrize("body,status,words", [
    ({"topic": "a/+", "payload": "x"}, 400, "wildcards"),
    ({"topic": "", "payload": "x"}, 400, "non-empty"),
    ({"topic": "$SYS/x", "payload": "x"}, 400, "$SYS"),
    ({"topic": "a", "payload": "x", "qos": 3}, 400, "qos"),
    ({"topic": "a", "payload": 5}, 400, "payload"),
    ({"topic": "a", "payload_base64": "%%"}, 400, "base64"),
    ({"topic": "a", "payload": "x", "color": "red"}, 400, "unknown field"),
    ({"topic": "a", "payload": "x", "properties": {"topic_alias": 1}}, 400, "topic_alias"),
    ({"topic": "a", "payload": "x" * 1_100_000}, 413, "max_packet_size"),
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
])
def test_publish_refuses_what_it_cannot_send(admin, body, status, words):
    got, _, answer = admin.call("POST", "/api/v1/publish", body=body)
    assert got == status and words in answer["error"], answer


def test_publish_needs_a_json_body(admin):
    status, _, body = admin.call("POST", "/api/v1/publish", body=b'{"topic": "a"}',
                                 headers={"Content-Type": "text/plain"})
    assert status == 415 and "application/json" in body["error"]


def test_retained_messages_browse_read_and_clear(admin, pahos):
    base = uid("ret")
    pub = pahos(admin.port, client_id=uid("rpub"))
    for i in range(3):
        pub.publish(f"{base}/dev{i}/state", f"state-{i}" * 1000, qos=1, retain=True).wait_for_publish(5)
    pub.publish(f"{base}/raw", b"\xff\x00", qos=1, retain=True).wait_for_publish(5)
    page = admin.call("GET", f"/api/v1/retained?filter={q(base + '/+/state')}&limit=2")[2]
    assert page["total"] == 3 and [m["topic"] for m in page["items"]] == [f"{base}/dev0/state", f"{base}/dev1/state"]
    assert page["items"][0]["size"] == 7000 and page["items"][0]["truncated"] is True
    assert len(page["items"][0]["payload"]) == 4096 and page["items"][0]["client_id"].startswith("rpub")
    rest = admin.call("GET", f"/api/v1/retained?filter={q(base + '/+/state')}&limit=2&cursor={page['next']}")[2]
    assert [m["topic"] for m in rest["items"]] == [f"{base}/dev2/state"] and rest["next"] is None
    one = admin.call("GET", f"/api/v1/retained/{base}/dev1/state")[2]
    assert one["payload"] == "state-1" * 1000 and "truncated" not in one
    assert admin.call("GET", f"/api/v1/retained/{base}/raw")[2]["payload_base64"] == "/wA="
    assert admin.call("GET", "/api/v1/retained?filter=" + q("a/#/b"))[0] == 400

    status, _, _ = admin.call("DELETE", f"/api/v1/retained/{base}/dev1/state")
    assert status == 204
    assert admin.call("DELETE", f"/api/v1/retained/{base}/dev1/state")[0] == 404
    late = pahos(admin.port, client_id=uid("late"))
    subscribe(late, f"{base}/+/state")
    got = get_messages(late, 3, timeout=2)
    assert sorted(m.topic for m in got) == [f"{base}/dev0/state", f"{base}/dev2/state"]
    sys_page = admin.call("GET", "/api/v1/retained?filter=" + q("$SYS/broker/version"))[2]
    assert sys_page["items"][0]["payload"].startswith("wrenmq version")


# --- bans --------------------------------------------------------------------------------------


def connack_of(port, cid, version=C.MQTT5, username=None, password=None):
    raw = RawClient(port, version)
    try:
        raw.send(Connect(cid, version, True, 30, None, username, password.encode() if password else None))
        pkt = raw.recv()
        return pkt.reason_code if pkt is not None else None
    finally:
        raw.close()


def test_bans_refuse_at_connect_with_0x8a_until_lifted(admin, pahos):
    cid = uid("banned")
    victim = pahos(admin.port, client_id=cid, version=5)
    status, _, ban = admin.call("POST", "/api/v1/banned", body={"kind": "client_id", "value": cid,
                                                                 "reason": "flooding"})
    assert status == 201 and ban["disconnected"] == [cid] and ban["until"] is None
    assert victim.disconnected_event.wait(5) and victim.disconnect_reason == C.ADMINISTRATIVE_ACTION
    victim.loop_stop()
    assert connack_of(admin.port, cid) == C.BANNED
    assert connack_of(admin.port, cid, C.MQTT311) == 5  # 3.1.1: not authorized
    assert connack_of(admin.port, uid("other")) == 0
    listed = admin.call("GET", "/api/v1/banned")[2]
    assert {"kind": "client_id", "value": cid, "reason": "flooding"}.items() <= \
        [b for b in listed["items"] if b["value"] == cid][0].items()
    assert "banned by client_id" in admin.served.log

    status, _, _ = admin.call("DELETE", f"/api/v1/banned/client_id/{cid}")
    assert status == 204
    assert connack_of(admin.port, cid) == 0
    assert admin.call("DELETE", f"/api/v1/banned/client_id/{cid}")[0] == 404


def test_bans_by_user_by_network_and_for_a_while(admin):
    assert admin.call("POST", "/api/v1/banned", body={"kind": "username", "value": "device"})[0] == 201
    assert connack_of(admin.port, uid("u"), username="device", password=PASSWORDS["device"]) == C.BANNED
    assert admin.call("DELETE", "/api/v1/banned/username/device")[0] == 204
    assert connack_of(admin.port, uid("u"), username="device", password=PASSWORDS["device"]) == 0

    assert admin.call("POST", "/api/v1/banned", body={"kind": "address", "value": "127.0.0.0/8",
                                                      "duration": 1.5})[0] == 201
    assert connack_of(admin.port, uid("n")) == C.BANNED
    time.sleep(1.7)
    assert connack_of(admin.port, uid("n")) == 0, "the ban ended"
    assert all(b["value"] != "127.0.0.0/8" for b in admin.call("GET", "/api/v1/banned")[2]["items"])
    for body in ({"kind": "ip", "value": "x"}, {"kind": "address", "value": "not-an-ip"},
                 {"kind": "client_id", "value": ""}, {"kind": "client_id", "value": "a", "duration": -1}):
        assert admin.call("POST", "/api/v1/banned", body=body)[0] == 400, body


def test_bans_survive_a_restart(tmp_path):
    b = AdminBroker(tmp_path)
    try:
        assert b.call("POST", "/api/v1/banned", body={"kind": "client_id", "value": "evil"})[0] == 201
        assert b.call("POST", "/api/v1/banned", body={"kind": "address", "value": "10.0.0.7"})[0] == 201
        b.restart()
        assert connack_of(b.port, "evil") == C.BANNED
        assert sorted(x["value"] for x in b.call("GET", "/api/v1/banned")[2]["items"]) == ["10.0.0.7", "evil"]
        saved = json.loads((tmp_path / "data" / "bans.json").read_text())
        assert len(saved["bans"]) == 2
        assert b.call("DELETE", "/api/v1/banned/client_id/evil")[0] == 204
        b.restart()
        assert connack_of(b.port, "evil") == 0
    finally:
        b.stop()


def test_a_broken_bans_file_stops_the_broker_at_start(tmp_path):
    from conftest import ServedBroker
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "bans.json").write_text("{broken")
    with pytest.raises(RuntimeError):
        ServedBroker(tmp_path, f'[storage]\ndata_dir = "{tmp_path / "data"}"\n')
    assert "bans.json: cannot read the bans" in (tmp_path / next(
        p.name for p in tmp_path.iterdir() if p.suffix == ".log")).read_text()


# --- figures, documents, HTTP -----------------------------------------------------------------


def test_stats_log_nodes_and_the_openapi_document(admin, pahos):
    pub = pahos(admin.port, client_id=uid("stat"))
    before = admin.call("GET", "/api/v1/log")[2]["partitions"][0]["end_offset"]
    for i in range(5):
        pub.publish("stats/x", b"x", qos=1).wait_for_publish(5)
    stats = admin.call("GET", "/api/v1/stats")[2]
    assert stats["sys"]["$SYS/broker/clients/connected"] >= 1 and stats["uptime"] > 0
    assert stats["sys"]["$SYS/broker/publish/messages/received"] >= 5
    log = admin.call("GET", "/api/v1/log")[2]
    part = log["partitions"][0]
    assert log["enabled"] and part["end_offset"] >= before + 5 and part["bytes"] > 0 and part["segments"] >= 1
    assert log["retention"]["hours"] == 168.0
    nodes = admin.call("GET", "/api/v1/nodes")[2]
    assert nodes["cluster"] is None and [n["self"] for n in nodes["nodes"]] == [True]
    assert nodes["nodes"][0]["admin"] == f"http://127.0.0.1:{admin.admin_port}"
    status, _, doc = admin.call("GET", "/api/v1/openapi.json")
    assert status == 200 and doc["openapi"] == "3.1.0"
    for path in ("/api/v1/clients", "/api/v1/clients/{client_id}", "/api/v1/retained/{topic}",
                 "/api/v1/banned/{kind}/{value}", "/api/v1/publish", "/api/v1/events"):
        assert path in doc["paths"], path
    assert "delete" in doc["paths"]["/api/v1/clients/{client_id}"]
    assert doc["paths"]["/health"]["get"]["security"] == []


def test_http_edges_head_405_404_413_and_garbage(admin):
    status, headers, body = admin.call("HEAD", "/api/v1/stats")
    assert status == 200 and body == "" and int(headers["Content-Length"]) > 0
    status, headers, _ = admin.call("PUT", "/api/v1/clients")
    assert status == 405 and headers["Allow"] == "GET, HEAD"
    assert admin.call("GET", "/api/v2/nothing")[0] == 404
    assert admin.call("GET", "/api/v1/clients/%ff")[0] == 400
    status, _, body = admin.call("POST", "/api/v1/publish", body=b"x" * (5 << 20))
    assert status == 413
    with socket.create_connection(("127.0.0.1", admin.admin_port), timeout=5) as s:
        s.sendall(b"\x16\x03\x01 this is not HTTP\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 400")
    # Keep-alive: several requests on one connection, answered in order.
    import http.client
    from admin_helpers import basic
    conn = http.client.HTTPConnection("127.0.0.1", admin.admin_port, timeout=10)
    for path in ("/api/v1/whoami", "/api/v1/stats", "/api/v1/whoami"):
        conn.request("GET", path, headers={"Authorization": basic(*OPS)})
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())
    conn.close()
    assert admin.call("GET", "/health", auth=None)[0] == 200


def test_metrics_on_the_admin_listener(admin):
    assert admin.call("GET", "/metrics", auth=None)[0] == 401
    status, headers, text = admin.call("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert "wrenmq_clients_connected" in text


def test_events_stream_history_then_live_samples(admin, pahos):
    import http.client
    from admin_helpers import basic
    pub = pahos(admin.port, client_id=uid("ev"))
    conn = http.client.HTTPConnection("127.0.0.1", admin.admin_port, timeout=10)
    conn.request("GET", "/api/v1/events", headers={"Authorization": basic(*OPS)})
    r = conn.getresponse()
    assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
    events = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pub.publish("events/x", b"x" * 100, qos=0)
        line = r.readline().decode().strip()
        if line.startswith("event:"):
            name = line[6:].strip()
            data = json.loads(r.readline().decode()[5:])
            events.append((name, data))
            if name == "sample" and data["rates"].get("msgs_in", 0) > 0:
                break
    conn.close()
    assert events[0][0] == "history" and isinstance(events[0][1], list)
    name, sample = events[-1]
    assert name == "sample" and sample["rates"]["msgs_in"] > 0 and sample["figures"]["connected"] >= 1


# --- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize("keys,error", [
    ("", "listener[1].users: an admin listener needs a way in"),
    ('anonymous = "write"\nbind = "0.0.0.0"', "listener[1].anonymous: 'write' only on a listener bound to a loopback"),
    ('readonly_users = ["x"]', "listener[1].readonly_users: needs [auth] password_file"),
    ('token_file = "/no/such/tokens"', "listener[1].token_file: file not found"),
    ('users = ["a"]\nreadonly_users = ["a"]', "listener[1].readonly_users: a also in users"),
    ('anonymous = "read"\npath = "/x"', "listener[1].path: only for type"),
])
def test_admin_listener_config_is_checked(keys, error):
    from wrenmq.config import ConfigError, load
    text = f'[[listener]]\nport = 0\n[[listener]]\ntype = "admin"\nport = 0\n{keys}\n'
    if 'users = ["a"]' in keys:
        text += '[auth]\npassword_file = "/dev/null"\n'
    with pytest.raises(ConfigError) as e:
        load(text=text)
    assert error in str(e.value)


def test_admin_keys_belong_to_admin_listeners():
    from wrenmq.config import ConfigError, load
    with pytest.raises(ConfigError, match="listener.0..token_file: only for type = \"admin\""):
        load(text='[[listener]]\nport = 0\ntoken_file = "x"\n')
    with pytest.raises(ConfigError, match="listener.0..anonymous: only for type = \"admin\""):
        load(text='[[listener]]\nport = 0\nanonymous = "read"\n')


def test_anonymous_read_on_loopback(tmp_path, pahos):
    b = AdminBroker(tmp_path, admin_keys='anonymous = "read"\n')
    try:
        assert call(b.admin_port, "GET", "/api/v1/clients")[0] == 200
        assert call(b.admin_port, "GET", "/api/v1/whoami")[2]["how"] == "anonymous"
        assert call(b.admin_port, "POST", "/api/v1/publish", body={"topic": "a", "payload": "b"})[0] == 403
    finally:
        b.stop()


# --- the listener itself ---------------------------------------------------------------------


def test_admin_listener_over_tls(tmp_path):
    import ssl
    import trustme
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    b = AdminBroker(tmp_path, admin_keys=f'users = ["ops"]\ntls = true\ncertfile = "{tmp_path / "server.pem"}"\n')
    try:
        import http.client
        from admin_helpers import basic
        ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        conn = http.client.HTTPSConnection("127.0.0.1", b.admin_port, context=ctx, timeout=10)
        conn.request("GET", "/api/v1/whoami", headers={"Authorization": basic(*OPS)})
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["name"] == "ops"
        conn.close()
        with pytest.raises(Exception):  # plain HTTP on the TLS port gets no answer
            call(b.admin_port, "GET", "/health", timeout=3)
        assert wait_for(lambda: "did not start a TLS handshake" in b.served.log or
                        "not a TLS ClientHello" in b.served.log)
    finally:
        b.stop()


def test_a_stream_that_fails_after_its_status_cuts_the_connection():
    """A generator that raises after the 200 went out: the reader must see the answer cut
    short at once (no last chunk), not wait on an open connection for data that never comes."""
    import asyncio
    import concurrent.futures
    import http.client
    import threading

    from wrenmq.admin.http import HttpConnection, Response, stream_from_thread

    pool = concurrent.futures.ThreadPoolExecutor(1)

    def chunks():
        yield b"first chunk"
        raise OSError("the disk went away")

    async def app(request):
        return Response(200, content_type="application/octet-stream", stream=stream_from_thread(chunks(), pool))

    ready = threading.Event()
    box = {}

    def serve():
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)  # (gather() with no tasks left asks the thread for its loop)
        box["loop"] = loop
        server = loop.run_until_complete(loop.create_server(lambda: HttpConnection(app), "127.0.0.1", 0))
        box["port"] = server.sockets[0].getsockname()[1]
        ready.set()
        loop.run_forever()
        server.close()
        loop.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    assert ready.wait(5)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", box["port"], timeout=15)
        conn.request("GET", "/")
        r = conn.getresponse()
        assert r.status == 200
        with pytest.raises((http.client.IncompleteRead, ConnectionResetError)):
            r.read()
        conn.close()
    finally:
        box["loop"].call_soon_threadsafe(box["loop"].stop)
        t.join(5)
        pool.shutdown()


def test_the_broker_stops_cleanly_with_an_event_stream_open(tmp_path):
    import http.client
    from admin_helpers import basic
    b = AdminBroker(tmp_path)
    conn = http.client.HTTPConnection("127.0.0.1", b.admin_port, timeout=10)
    conn.request("GET", "/api/v1/events", headers={"Authorization": basic(*OPS)})
    r = conn.getresponse()
    assert r.readline().startswith(b"event: history")
    assert b.served.stop() == 0
    conn.close()
    assert "Traceback" not in b.served.log and "exception was never retrieved" not in b.served.log


def test_a_stream_from_a_thread_goes_chunk_by_chunk_and_stops_with_its_reader():
    """http.stream_from_thread, what a log read (Arrow IPC from a thread) answers with: the
    generator runs in the pool, never on the loop, and is closed when the reader leaves."""
    import asyncio
    import concurrent.futures
    import http.client
    import threading

    from wrenmq.admin.http import HttpConnection, Response, stream_from_thread

    pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="reader")
    seen = {"threads": set(), "closed": threading.Event(), "made": 0}

    def chunks(n):
        try:
            for i in range(n):
                seen["threads"].add(threading.current_thread().name)
                seen["made"] += 1
                yield b"%d:" % i + b"x" * 65536
        finally:
            seen["closed"].set()

    async def app(request):
        return Response(200, content_type="application/octet-stream",
                        stream=stream_from_thread(chunks(int(request.query["n"])), pool))

    ready = threading.Event()
    box = {}

    def serve():
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)  # (gather() with no tasks left asks the thread for its loop)
        box["loop"] = loop
        server = loop.run_until_complete(loop.create_server(lambda: HttpConnection(app), "127.0.0.1", 0))
        box["port"] = server.sockets[0].getsockname()[1]
        ready.set()
        loop.run_forever()
        server.close()
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    assert ready.wait(5)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", box["port"], timeout=10)
        conn.request("GET", "/?n=20")
        body = conn.getresponse().read()
        assert body.count(b"x" * 65536) == 20 and body.startswith(b"0:") and b"19:" in body
        assert seen["threads"] and all(name.startswith("reader") for name in seen["threads"])
        assert seen["closed"].wait(5)
        # A reader that leaves early: the generator is closed, not run to its end.
        seen["closed"].clear()
        seen["made"] = 0
        with socket.create_connection(("127.0.0.1", box["port"]), timeout=5) as s:
            s.sendall(b"GET /?n=100000 HTTP/1.1\r\nHost: x\r\n\r\n")
            s.recv(65536)
        assert seen["closed"].wait(10)
        assert seen["made"] < 1000
    finally:
        box["loop"].call_soon_threadsafe(box["loop"].stop)
        t.join(5)
        pool.shutdown()
