"""[auth.http]: logins asked of a real HTTP service with EMQX's contract (auth/http.py),
clients are paho over real sockets, the broker the in-process one."""

import threading
import time

import pytest

from auth_services import AuthService
from conftest import RawClient, paho_client, subscribe
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.packets import Connect

pytest.importorskip("aiohttp")

ACL = [  # the first rule that matches decides
    {"permission": "deny", "action": "publish", "topic": "devices/+/locked"},
    {"permission": "allow", "action": "all", "topic": "devices/${clientid}/#"},
    {"permission": "allow", "action": "subscribe", "topic": "eq shared/#", "qos": [0, 1]},
    {"permission": "deny", "action": "all", "topic": "#"},  # without it, no rule = allowed
]


@pytest.fixture
def service():
    svc = AuthService({
        "alice": {"result": "allow", "is_superuser": False, "acl": ACL},
        "bob": {"result": "deny"},
        "carol": {"result": "ignore"},
        "dave": 204,
        "slow": "slow",
        "broken": 500,
        "weird": "not json",
        "root": {"result": "allow", "is_superuser": True, "acl": [
            {"permission": "deny", "action": "all", "topic": "#"}]},
        "brief": lambda body: {"result": "allow", "expire_at": int(time.time()) + 2},
    }, slow_seconds=3.0)
    yield svc
    svc.stop()


def http_broker(make_broker, url, extra=""):
    return make_broker(f"""
[auth]
allow_anonymous = false
failed_login_delay = 0
[auth.http]
url = "{url}"
timeout = 1.0
headers = {{ Authorization = "Bearer service-token" }}
{extra}
[sys]
interval = 0
""")


def connect(port, user, client_id=None, password="secret", version=5):
    c = paho_client(port, client_id=client_id or f"{user}-1", username=user, password=password,
                    version=version)
    return c


def rc(c):
    return int(c.connack[0].value if hasattr(c.connack[0], "value") else c.connack[0])


def done(*cs):
    for c in cs:
        c.disconnect()
        c.loop_stop()


def test_allow_deny_ignore_and_204(make_broker, service):
    b = http_broker(make_broker, service.url + "/mqtt/auth")
    alice, bob, carol, dave = (connect(b.port, u) for u in ("alice", "bob", "carol", "dave"))
    assert rc(alice) == 0
    assert rc(bob) == C.BAD_USER_NAME_OR_PASSWORD
    assert rc(carol) == C.NOT_AUTHORIZED  # ignore: the policy (no anonymous, no password file)
    assert rc(dave) == 0
    done(alice, dave)
    body = next(r for r in service.requests if r["username"] == "alice")
    assert body["clientid"] == body["client_id"] == "alice-1"
    assert body["password"] == "secret" and body["peerhost"] == "127.0.0.1"
    assert body["proto_ver"] == 5 and body["protocol"] == "mqtt" and body["listener"]
    assert isinstance(body["peerport"], int) and body["cert_common_name"] is None


def test_rules_from_the_answer(make_broker, service):
    b = http_broker(make_broker, service.url)
    alice = connect(b.port, "alice", client_id="dev7")
    assert rc(alice) == 0
    assert subscribe(alice, "devices/dev7/#", 1)[0] == 1
    assert subscribe(alice, "devices/other/#", 1)[0] == C.NOT_AUTHORIZED
    assert subscribe(alice, "shared/#", 1)[0] == 1  # "eq shared/#": that filter itself
    assert subscribe(alice, "shared/x", 1)[0] == C.NOT_AUTHORIZED
    assert subscribe(alice, "shared/#", 2)[0] == C.NOT_AUTHORIZED  # qos [0, 1] only
    ok = alice.publish("devices/dev7/temp", b"1", qos=1)
    ok.wait_for_publish(5)
    got = alice.messages.get(timeout=5)
    assert got.topic == "devices/dev7/temp"
    alice.publish("devices/dev7/locked", b"x", qos=1).wait_for_publish(5)
    alice.publish("elsewhere", b"x", qos=1).wait_for_publish(5)
    time.sleep(0.3)
    assert alice.messages.empty()
    assert b.call(lambda: b.broker.router.stats.denied_publish) == 2
    root = connect(b.port, "root")
    assert rc(root) == 0
    assert subscribe(root, "anything/#", 1)[0] == 1  # superuser: its rules do not apply
    done(alice, root)


def test_answers_are_cached(make_broker, service):
    b = http_broker(make_broker, service.url)
    for _ in range(3):
        done(connect(b.port, "alice"))
    done(connect(b.port, "alice", password="other"))  # another body: asked again
    assert service.count("alice") == 2
    values = b.call(b.broker.sys_topics.snapshot)
    assert values["$SYS/broker/auth/http/cache hits"] == 2
    assert values["$SYS/broker/auth/http/requests"] == 2


def test_identical_logins_at_once_ask_once(make_broker, service):
    service.answers["same"] = "slow"
    service.slow_seconds = 0.5
    b = http_broker(make_broker, service.url)
    results = []

    def login():
        c = connect(b.port, "same", client_id="same-client")
        results.append(rc(c))
        done(c)

    threads = [threading.Thread(target=login) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results.count(0) == 5
    assert service.count("same") == 1


def test_a_slow_service_refuses_late_and_holds_no_one_else(make_broker, service):
    b = http_broker(make_broker, service.url)
    done(connect(b.port, "alice"))  # cached from here on
    started = time.monotonic()
    out = {}

    def slow():
        out["slow"] = connect(b.port, "slow")

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    alice = connect(b.port, "alice")
    alice_took = time.monotonic() - t0
    t.join(10)
    assert rc(alice) == 0 and alice_took < 0.9  # answered while the slow login waited
    assert rc(out["slow"]) == C.SERVER_UNAVAILABLE  # timeout 1 s: down, on_error deny
    assert 0.9 < time.monotonic() - started < 3.0
    done(alice)


@pytest.mark.parametrize("user", ["broken", "weird"])
def test_error_statuses_and_bodies(make_broker, service, user):
    b = http_broker(make_broker, service.url)
    c = connect(b.port, user)
    # 500: the service is down (on_error deny: 0x88); 200 without the JSON: "ignore".
    assert rc(c) == (C.SERVER_UNAVAILABLE if user == "broken" else C.NOT_AUTHORIZED)


def test_service_down_deny_by_default_or_ignore(make_broker):
    down = AuthService()
    url = down.url
    down.stop()
    b = http_broker(make_broker, url)
    assert rc(connect(b.port, "alice")) == C.SERVER_UNAVAILABLE
    raw = RawClient(b.port)
    raw.send(Connect(client_id="old", username="alice", password=b"x"))
    assert raw.recv().reason_code == 3  # 3.1.1: server unavailable
    raw.close()
    b2 = make_broker(f'[auth]\nallow_anonymous = true\n[auth.http]\nurl = "{url}"\non_error = "ignore"\n')
    c = connect(b2.port, "alice")
    assert rc(c) == 0  # passed on: the anonymous policy accepts
    done(c)
    values = b.call(b.broker.sys_topics.snapshot)
    assert values["$SYS/broker/auth/http/errors"] >= 1


def test_expire_at_closes_the_connection(make_broker, service):
    b = http_broker(make_broker, service.url)
    c = connect(b.port, "brief")
    assert rc(c) == 0
    assert c.disconnected_event.wait(6)
    assert int(c.disconnect_reason.value) == C.NOT_AUTHORIZED
    values = b.call(b.broker.sys_topics.snapshot)
    assert values["$SYS/broker/auth/http/expired"] == 1


def test_password_file_users_are_not_asked(make_broker, service, tmp_path):
    from wrenmq.auth.passwords import hash_password
    pw = tmp_path / "passwd"
    pw.write_text(f"bob:{hash_password('pw')}\n")
    b = make_broker(f'[auth]\npassword_file = "{pw}"\nfailed_login_delay = 0\n[auth.http]\nurl = "{service.url}"\n')
    c = connect(b.port, "bob", password="pw")
    assert rc(c) == 0  # the service would deny bob: the file decided first
    assert service.count("bob") == 0
    done(c)
