"""ACL files in Mosquitto's syntax: parsing, Mosquitto 2.0's evaluation, and the checks on a
live broker (PUBLISH, SUBSCRIBE, the will when it is published, retained and queued delivery),
including reload (in-process and SIGHUP on `wrenmq serve`) without dropping connections.
"""

import re
import shutil
import subprocess
import time

import pytest

from conftest import RawClient, get_messages, no_message, paho_client, subscribe
from mqtt_helpers import rc_int
from wrenmq.auth.acl import READ, WRITE, Acl, AclError
from wrenmq.auth.passwords import hash_password
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.packets import (
    PINGREQ, PINGRESP, Connect, Puback, Publish, Suback, Subscribe, SubscribeTopic, Will,
)

V311 = C.MQTT311
V5 = C.MQTT5

ACL = """\
# anonymous clients
topic read public/#
topic anon/+

user alice
topic readwrite alice/#
topic deny alice/secret/#
topic read shared/#
topic read $SYS/#
topic read a b/c d

user bob
topic shared/#
topic write drop/#

user carol
topic #

pattern readwrite clients/%c/#
pattern read users/%u/#
pattern deny clients/%c/private
"""


@pytest.fixture
def acl():
    return Acl.parse(ACL, "acl")


@pytest.mark.parametrize("cid,user,topic,access,allowed", [
    # anonymous rules (before any user line); no access word = readwrite
    ("a", None, "public/x", READ, True),
    ("a", None, "public/x", WRITE, False),
    ("a", None, "anon/x", WRITE, True),
    ("a", None, "anon/x/y", READ, False),
    ("a", None, "alice/x", READ, False),
    # a user's block; deny wins wherever it is written
    ("a", "alice", "alice/x", WRITE, True),
    ("a", "alice", "alice/x", READ, True),
    ("a", "alice", "alice/secret", READ, False),
    ("a", "alice", "alice/secret/x", WRITE, False),
    ("a", "alice", "shared/x", READ, True),
    ("a", "alice", "shared/x", WRITE, False),
    ("a", "alice", "public/x", READ, False),      # anonymous rules are not the users'
    ("a", "alice", "$SYS/broker/uptime", READ, True),
    ("a", "alice", "a b/c d", READ, True),         # spaces in a topic
    ("a", "bob", "shared/x", WRITE, True),
    ("a", "bob", "drop/x", READ, False),
    # '#' does not reach $ topics
    ("a", "carol", "any/thing", WRITE, True),
    ("a", "carol", "$SYS/broker/uptime", READ, False),
    # patterns apply to everybody, %c / %u substituted
    ("c1", "alice", "clients/c1/x", WRITE, True),
    ("c1", "alice", "clients/c2/x", WRITE, False),
    ("c1", "alice", "clients/c1/private", READ, False),
    ("c1", "zed", "clients/c1/x", READ, True),     # a user without a block: patterns only
    ("c1", "zed", "users/zed/x", READ, True),
    ("c1", "zed", "users/zed/x", WRITE, False),
    ("c1", "zed", "users/alice/x", READ, False),
    ("c1", None, "clients/c1/x", READ, True),
    ("c1", None, "users//x", READ, False),         # %u patterns skip anonymous clients
    # a + or # in a client id or user name would widen a pattern: no pattern access at all
    ("c+", "zed", "clients/c+/x", READ, False),
    ("c#", "alice", "clients/c#", READ, False),
    ("c#", "alice", "alice/x", READ, True),        # the user's own rules still apply
    ("c1", "z+", "users/z+/x", READ, False),
])
def test_evaluation(acl, cid, user, topic, access, allowed):
    assert acl.check(cid, user, topic, access) is allowed


@pytest.mark.parametrize("user,flt,allowed", [
    ("alice", "alice/#", True),
    ("alice", "alice/x", True),
    ("alice", "alice/secret/#", False),            # a deny covering the whole filter
    ("alice", "alice/secret/x/+", False),
    ("alice", "#", True),                          # overlaps alice/#: deliveries are filtered
    ("alice", "+/x", True),
    ("alice", "bob/#", False),
    ("alice", "public/#", False),
    ("alice", "$SYS/#", True),
    ("alice", "$share/g/shared/+", True),
    ("alice", "$share/g/bob/#", False),
    ("carol", "#", True),
    ("carol", "$SYS/#", False),                    # '#' does not grant $ topics
    ("carol", "+/broker", True),
    (None, "public/+", True),
    (None, "private/#", False),
    ("bob", "drop/#", False),                      # write only
    ("zed", "users/zed/#", True),
    ("zed", "users/+/x", True),
    ("zed", "clients/c1/private", False),
])
def test_subscribe_filters(acl, user, flt, allowed):
    assert acl.check_subscribe("c1", user, flt) is allowed


@pytest.mark.parametrize("text,error", [
    ("topic\n", ":1: topic without a topic"),
    ("# c\ntopic read\n", ":2: topic read without a topic"),
    ("topic rw a/b\n", ":1: invalid access 'rw'"),
    ("user x\n\ntopic read a/#/b\n", ":3: invalid topic 'a/#/b'"),
    ("pattern read a+/%c\n", ":1: invalid topic 'a+/%c'"),
    ("user\n", ":1: user without a name"),
    ("usr alice\n", ":1: unknown keyword 'usr'"),
])
def test_parse_errors_name_file_and_line(tmp_path, text, error):
    path = tmp_path / "acl"
    path.write_text(text)
    with pytest.raises(AclError) as e:
        Acl.load(path)
    assert str(e.value).startswith(f"{path}{error}"), str(e.value)


def test_pattern_without_substitution_warns(caplog):
    Acl.parse("pattern read fixed/topic\n", "f")
    assert "neither %c nor %u" in caplog.text


# --- a live broker -------------------------------------------------------------------------

PASSWORDS = {"alice": "alice-pw", "bob": "bob-pw", "carol": "carol-pw"}


@pytest.fixture
def files(tmp_path):
    pw = tmp_path / "passwd"
    pw.write_text("".join(f"{u}:{hash_password(p)}\n" for u, p in PASSWORDS.items()))
    acl = tmp_path / "acl"
    acl.write_text(ACL)
    return pw, acl


def config(files, extra=""):
    pw, acl = files
    return (f'[auth]\npassword_file = "{pw}"\nacl_file = "{acl}"\nfailed_login_delay = 0.1\n'
            + extra)


def login(port, user, version=V5, client_id=None, **kw):
    c = RawClient(port, version)
    c.send(Connect(client_id or f"{user}-{version}", version, username=user,
                   password=PASSWORDS[user].encode() if user else None, **kw))
    ack = c.recv()
    assert ack.reason_code == 0, ack
    return c


def paho(port, user, **kw):
    return paho_client(port, username=user, password=PASSWORDS[user], **kw)


def reload(b, acl_path, text):
    acl_path.write_text(text)
    b.call(b.broker.hooks.reload)
    assert b.broker.auth.last_reload_error is None


@pytest.mark.parametrize("version", [V311, V5])
def test_publish_checked(make_broker, files, version):
    b = make_broker(config(files))
    stats = b.broker.router.stats
    watcher = login(b.port, "carol", V5, "watcher")  # carol reads everything
    watcher.send(Subscribe(1, [SubscribeTopic("#", 1)]))
    assert watcher.recv() == Suback(1, [1])

    c = login(b.port, "alice", version)
    c.send(Publish("bob/x", b"no", qos=1, packet_id=1))
    ack = c.recv()
    # 5.0: Not authorized; 3.1.1 has no way to say it: acknowledged and dropped (as Mosquitto).
    assert ack == Puback(1, C.NOT_AUTHORIZED if version == V5 else 0), ack
    c.send(Publish("alice/secret/x", b"no"))
    c.send(Publish("alice/x", b"yes", qos=1, packet_id=2))
    assert c.recv().packet_id == 2
    got = watcher.recv()
    assert (got.topic, got.payload) == ("alice/x", b"yes")
    assert stats.denied_publish == 2
    assert b.call(b.broker.sys_topics.values)["$SYS/broker/publish/messages/denied"] == 2
    watcher.send(PINGREQ)
    assert watcher.recv() == PINGRESP  # nothing else arrived before
    c.close()
    watcher.close()


@pytest.mark.parametrize("version,refused", [(V311, 0x80), (V5, 0x87)])
def test_subscribe_checked_and_delivery_filtered(make_broker, files, version, refused):
    b = make_broker(config(files))
    c = login(b.port, "alice", version)
    c.send(Subscribe(1, [SubscribeTopic("bob/#", 1), SubscribeTopic("#", 1),
                         SubscribeTopic("alice/secret/#", 0), SubscribeTopic("$SYS/broker/x", 0)]))
    assert c.recv() == Suback(1, [refused, 1, refused, 0])
    assert b.broker.router.stats.denied_subscribe == 2
    for topic in ("bob/x", "alice/secret/x", "public/x", "shared/x", "alice/x"):
        b.call(b.broker.publish, topic, topic, 1)
    got = [c.recv() for _ in range(2)]
    assert sorted(p.topic for p in got) == ["alice/x", "shared/x"]
    c.send(PINGREQ)
    assert c.recv() == PINGRESP
    c.close()


MOSQUITTO_PUB = shutil.which("mosquitto_pub")
MOSQUITTO_SUB = shutil.which("mosquitto_sub")


@pytest.mark.skipif(not (MOSQUITTO_PUB and MOSQUITTO_SUB), reason="mosquitto-clients not installed")
def test_mosquitto_clients_with_acl(make_broker, files):
    b = make_broker(config(files))
    sub = subprocess.Popen([MOSQUITTO_SUB, "-h", "127.0.0.1", "-p", str(b.port), "-V", "mqttv5",
                            "-u", "alice", "-P", "alice-pw", "-i", "msub", "-t", "alice/#",
                            "-C", "1", "-W", "10", "-v"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    router = b.broker.router
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not b.call(
            lambda: "msub" in router.sessions and "alice/#" in router.sessions["msub"].subscriptions):
        time.sleep(0.02)
    base = [MOSQUITTO_PUB, "-h", "127.0.0.1", "-p", str(b.port), "-q", "1"]
    # bob may not write alice/x: 5.0 tells him, 3.1.1 drops it silently.
    r = subprocess.run(base + ["-V", "mqttv5", "-u", "bob", "-P", "bob-pw", "-t", "alice/x", "-m", "bob"],
                       capture_output=True, text=True, timeout=15)
    assert "not authori" in (r.stdout + r.stderr).lower(), (r.returncode, r.stdout, r.stderr)
    r = subprocess.run(base + ["-V", "mqttv311", "-u", "bob", "-P", "bob-pw", "-t", "alice/x", "-m", "bob"],
                       capture_output=True, text=True, timeout=15)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(base + ["-V", "mqttv311", "-u", "alice", "-P", "alice-pw", "-t", "alice/x",
                               "-m", "alice"], capture_output=True, text=True, timeout=15)
    assert r.returncode == 0, r.stderr
    out, err = sub.communicate(timeout=15)
    assert out.strip() == "alice/x alice", (out, err)


def test_will_checked_when_published(make_broker, files):
    pw, acl = files
    b = make_broker(config(files))
    watcher = login(b.port, "carol", V5, "watcher")
    watcher.send(Subscribe(1, [SubscribeTopic("#", 0)]))
    assert watcher.recv() == Suback(1, [0])
    stats = b.broker.router.stats

    # A will on a topic the client may not write: never published.
    c = login(b.port, "alice", V5, "w1", will=Will("bob/will", b"x"))
    c.close()  # no DISCONNECT: the will is due
    deadline = time.monotonic() + 3
    while stats.denied_publish < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stats.denied_publish == 1

    # Allowed when it connected, revoked before it is published: not published.
    c = login(b.port, "alice", V311, "w2", will=Will("alice/will", b"x"))
    reload(b, acl, ACL + "user alice\ntopic deny alice/will\n")
    c.close()
    deadline = time.monotonic() + 3
    while stats.denied_publish < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stats.denied_publish == 2

    # Refused when it connected, granted before it is published: published.
    c = login(b.port, "alice", V5, "w3", will=Will("bob/will", b"late"))
    reload(b, acl, ACL + "user alice\ntopic write bob/will\n")
    c.close()
    got = watcher.recv()
    assert (got.topic, got.payload) == ("bob/will", b"late")
    watcher.send(PINGREQ)
    assert watcher.recv() == PINGRESP  # and it was the only will
    watcher.close()


def test_retained_delivery_checked(make_broker, files, clients):
    pw, acl = files
    b = make_broker(config(files))
    for topic in ("alice/r", "shared/r", "bob/r"):
        b.call(b.broker.publish, topic, topic, 1, True)
    bob = clients(b.port, username="bob", password="bob-pw")
    assert [rc_int(x) for x in subscribe(bob, "#", 1)] == [1]
    got = get_messages(bob, 1)
    assert [m.topic for m in got] == ["shared/r"]
    assert no_message(bob, 0.3)

    reload(b, acl, ACL + "user bob\ntopic read alice/#\n")
    bob2 = clients(b.port, username="bob", password="bob-pw")
    subscribe(bob2, "#", 1)
    got = get_messages(bob2, 2)
    assert sorted(m.topic for m in got) == ["alice/r", "shared/r"]
    assert no_message(bob2, 0.3)

    reload(b, acl, ACL + "user bob\ntopic deny shared/r\n")
    bob3 = clients(b.port, username="bob", password="bob-pw")
    subscribe(bob3, "#", 1)
    assert no_message(bob3, 0.3)


def test_queued_delivery_checked_after_reload(make_broker, files):
    pw, acl = files
    b = make_broker(config(files))
    props = {"session_expiry_interval": 300}
    c = login(b.port, "bob", V5, "queued", clean_start=False, properties=props)
    c.send(Subscribe(1, [SubscribeTopic("shared/#", 1)]))
    assert c.recv() == Suback(1, [1])
    c.close()
    router = b.broker.router
    deadline = time.monotonic() + 3
    while b.call(lambda: router.sessions["queued"].conn is not None) and time.monotonic() < deadline:
        time.sleep(0.02)
    for topic in ("shared/a", "shared/b", "shared/c"):
        b.call(b.broker.publish, topic, topic, 1)
    assert b.call(lambda: len(router.sessions["queued"].queue)) == 3

    # Bob loses shared/b while he is away: it is not delivered when he comes back.
    reload(b, acl, ACL + "user bob\ntopic deny shared/b\n")
    c = login(b.port, "bob", V5, "queued", clean_start=False, properties=props)
    got = [c.recv() for _ in range(2)]
    assert [p.topic for p in got] == ["shared/a", "shared/c"]
    for p in got:
        c.send(Puback(p.packet_id))
    c.send(PINGREQ)
    assert c.recv() == PINGRESP
    c.close()


def test_reload_keeps_connections_and_caches_follow(make_broker, files):
    pw, acl = files
    b = make_broker(config(files))
    c = login(b.port, "bob", V5)
    c.send(Publish("news/x", b"1", qos=1, packet_id=1))
    assert c.recv() == Puback(1, C.NOT_AUTHORIZED)
    reload(b, acl, ACL + "user bob\ntopic write news/#\n")
    c.send(Publish("news/x", b"2", qos=1, packet_id=2))
    assert c.recv() == Puback(2, C.NO_MATCHING_SUBSCRIBERS)
    reload(b, acl, ACL)
    c.send(Publish("news/x", b"3", qos=1, packet_id=3))
    assert c.recv() == Puback(3, C.NOT_AUTHORIZED)
    # A broken file changes nothing.
    acl.write_text(ACL + "user bob\ntopic write news/#\ntopic bogus news/#\n")
    b.call(b.broker.hooks.reload)
    assert re.match(rf"{re.escape(str(acl))}:\d+: invalid access 'bogus'", b.broker.auth.last_reload_error)
    c.send(Publish("news/x", b"4", qos=1, packet_id=4))
    assert c.recv() == Puback(4, C.NOT_AUTHORIZED)
    c.close()


def test_acl_reload_with_sighup_on_serve(serve_broker, files):
    pw, acl = files
    b = serve_broker(config(files, '[storage]\nmode = "memory"\n'))
    alice = paho(b.port, "alice")
    alice.publish("bob/x", b"1", qos=1)
    kind, mid, rc, _ = alice.acks.get(timeout=5)
    assert rc_int(rc) == C.NOT_AUTHORIZED

    acl.write_text(ACL + "user alice\ntopic write bob/#\n")
    from conftest import WRENMQ
    r = subprocess.run([WRENMQ, "reload", "--pid", str(b.proc.pid)], capture_output=True, text=True,
                       timeout=15)
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 5
    while "reloaded auth files" not in b.log and time.monotonic() < deadline:
        time.sleep(0.02)
    alice.publish("bob/x", b"2", qos=1)
    kind, mid, rc, _ = alice.acks.get(timeout=5)
    assert rc_int(rc) == C.NO_MATCHING_SUBSCRIBERS  # allowed now, on the same connection

    acl.write_text("topic read a\nuser alice\ntopic nonsense here x\n")
    subprocess.run([WRENMQ, "reload", "--pid", str(b.proc.pid)], capture_output=True, timeout=15)
    deadline = time.monotonic() + 5
    while "reload failed" not in b.log and time.monotonic() < deadline:
        time.sleep(0.02)
    assert re.search(rf"reload failed, keeping the previous password and ACL files: "
                     rf"{re.escape(str(acl))}:3: invalid access 'nonsense'", b.log), b.log
    alice.publish("bob/x", b"3", qos=1)
    kind, mid, rc, _ = alice.acks.get(timeout=5)
    assert rc_int(rc) == C.NO_MATCHING_SUBSCRIBERS  # the previous rules are still in force
    assert not alice.disconnected_event.is_set()
    alice.disconnect()
    alice.loop_stop()


def test_catch_up_from_log_checks_read_access(make_broker, files, tmp_path):
    """A stored session whose queue overflowed reads the rest from the commit log: those
    messages must pass the same READ check as live ones."""
    b = make_broker(config(files, f'[limits]\nmax_queued_messages = 2\n[storage]\nmode = "disk"\n'
                                  f'data_dir = "{tmp_path / "data"}"\nfsync = "never"\n'))
    props = {"session_expiry_interval": 300}
    c = login(b.port, "bob", V5, "overflow", clean_start=False, properties=props)
    c.send(Subscribe(1, [SubscribeTopic("#", 1)]))  # accepted: it overlaps bob's shared/#
    assert c.recv() == Suback(1, [1])
    c.close()
    router = b.broker.router
    deadline = time.monotonic() + 3
    while b.call(lambda: router.sessions["overflow"].conn is not None) and time.monotonic() < deadline:
        time.sleep(0.02)
    for i in range(4):
        b.call(b.broker.publish, "shared/x", b"s%d" % i, 1)
        b.call(b.broker.publish, "bob/secret", b"S%d" % i, 1)
    c = login(b.port, "bob", V5, "overflow", clean_start=False, properties=props)
    got = []
    try:
        while True:
            p = c.recv(timeout=1)
            got.append(p.topic)
            c.send(Puback(p.packet_id))
    except TimeoutError:
        pass
    c.close()
    assert got == ["shared/x"] * 4
