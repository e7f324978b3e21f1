"""Interoperability with Debian's mosquitto_pub / mosquitto_sub (2.0.11), MQTT 3.1.1 and 5.0.

Every subprocess has a timeout (mosquitto_sub also gets -W), and a subscriber is
only published to once the broker shows its subscription, so nothing here
depends on sleeping long enough.
"""

import os
import shutil
import signal
import subprocess
import time
import uuid

import pytest

MOSQUITTO_PUB = shutil.which("mosquitto_pub")
MOSQUITTO_SUB = shutil.which("mosquitto_sub")
pytestmark = pytest.mark.skipif(not (MOSQUITTO_PUB and MOSQUITTO_SUB),
                                reason="mosquitto-clients is not installed")

VERSIONS = ["mqttv311", "mqttv5"]
TIMED_OUT = 27  # mosquitto_sub's exit status when -W expires


def uid(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def pub(port, version, *args, input=None, check=True):
    cmd = [MOSQUITTO_PUB, "-h", "127.0.0.1", "-p", str(port), "-V", version, *args]
    r = subprocess.run(cmd, input=input, capture_output=True, timeout=15)
    if check:
        assert r.returncode == 0, f"{cmd} exited {r.returncode}: {r.stderr.decode(errors='replace')}"
    return r


class Sub:
    """A running mosquitto_sub; `wait_subscribed()` polls the broker for its subscriptions."""

    def __init__(self, broker, version, *args, client_id=None, filters=(), wait=5):
        self.broker = broker
        self.client_id = client_id or uid("msub")
        self.filters = list(filters)
        self.cmd = [MOSQUITTO_SUB, "-h", "127.0.0.1", "-p", str(broker.port), "-V", version,
                    "-i", self.client_id, "-W", str(wait), *args]
        for f in self.filters:
            self.cmd += ["-t", f]
        self.started = time.monotonic()  # the router's clock: connected_at is comparable
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def wait_subscribed(self, timeout=5.0):
        router = self.broker.broker.router
        cid, filters, started = self.client_id, self.filters, self.started

        def ready():
            s = router.sessions.get(cid)
            return (s is not None and s.conn is not None and s.connected_at >= started
                    and all(f in s.subscriptions for f in filters))

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.broker.call(ready):
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.01)
        out, err = self.finish()
        pytest.fail(f"{self.cmd} did not subscribe (exit {self.proc.returncode}): {err!r}, output {out!r}")

    def finish(self, timeout=15):
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            pytest.fail(f"{self.cmd} still running after {timeout}s")
        return out, err

    def output(self, expect_rc=0):
        out, err = self.finish()
        assert self.proc.returncode == expect_rc, \
            f"{self.cmd} exited {self.proc.returncode} (expected {expect_rc}): {err!r}, output {out!r}"
        return out

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=10)


@pytest.fixture
def subs():
    made = []

    def factory(*args, **kw):
        s = Sub(*args, **kw)
        made.append(s)
        return s

    yield factory
    for s in made:
        s.kill()


@pytest.mark.parametrize("qos", [0, 1, 2])
@pytest.mark.parametrize("pub_version,sub_version", [
    ("mqttv311", "mqttv311"), ("mqttv5", "mqttv5"), ("mqttv311", "mqttv5"), ("mqttv5", "mqttv311"),
])
def test_qos_roundtrip(broker, subs, pub_version, sub_version, qos):
    topic = f"it/qos{qos}/{uuid.uuid4().hex[:6]}"
    s = subs(broker, sub_version, "-q", str(qos), "-C", "1", "-F", "%t|%q|%p",
             filters=["it/+/#"]).wait_subscribed()
    pub(broker.port, pub_version, "-q", str(qos), "-t", topic, "-m", f"hello qos {qos}")
    assert s.output() == f"{topic}|{qos}|hello qos {qos}\n".encode()


@pytest.mark.parametrize("version", VERSIONS)
def test_qos_downgraded_to_subscription(broker, subs, version):
    s = subs(broker, version, "-q", "1", "-C", "1", "-F", "%q %p", filters=["it/down"]).wait_subscribed()
    pub(broker.port, version, "-q", "2", "-t", "it/down", "-m", "x")
    assert s.output() == b"1 x\n"


@pytest.mark.parametrize("version", VERSIONS)
def test_many_messages_in_order(broker, subs, version):
    lines = [f"line {i}" for i in range(50)]
    s = subs(broker, version, "-q", "2", "-C", str(len(lines)), filters=["it/lines"]).wait_subscribed()
    pub(broker.port, version, "-q", "2", "-t", "it/lines", "-l",
        input=("\n".join(lines) + "\n").encode())
    assert s.output().decode().splitlines() == lines


@pytest.mark.parametrize("version", VERSIONS)
def test_retained(broker, subs, version):
    topic = f"it/ret/{version}"
    pub(broker.port, version, "-r", "-q", "1", "-t", topic, "-m", "kept")
    # A later subscriber gets it at once, retain flag set.
    s = subs(broker, version, "-C", "1", "-F", "%r|%t|%p", filters=["it/ret/#"])
    assert s.output() == f"1|{topic}|kept\n".encode()
    # Replaced, then cleared with an empty retained message.
    pub(broker.port, version, "-r", "-t", topic, "-m", "newer")
    s = subs(broker, version, "-C", "1", "-v", filters=[topic])
    assert s.output() == f"{topic} newer\n".encode()
    pub(broker.port, version, "-r", "-t", topic, "-n")
    # --retained-only prints retained messages and exits at the first live one:
    # nothing retained is left, so only the exit is seen.
    s = subs(broker, version, "--retained-only", filters=[topic]).wait_subscribed()
    pub(broker.port, version, "-t", topic, "-m", "live")
    assert s.output() == b""


@pytest.mark.parametrize("version", VERSIONS)
def test_retained_not_sent_with_R_and_live_retain_flag(broker, subs, version):
    topic = f"it/ret2/{version}"
    pub(broker.port, version, "-r", "-t", topic, "-m", "stale")
    s = subs(broker, version, "-R", "-C", "1", "-F", "%r %p", filters=[topic]).wait_subscribed()
    pub(broker.port, version, "-t", topic, "-m", "fresh")
    # A live message on an existing subscription has retain 0 (3.1.1 and 5.0 without RAP).
    assert s.output() == b"0 fresh\n"


@pytest.mark.parametrize("version", VERSIONS)
def test_output_flags_N_and_v(broker, subs, version):
    topic = f"it/fmt/{version}"
    n = subs(broker, version, "-N", "-C", "3", filters=[topic]).wait_subscribed()
    v = subs(broker, version, "-v", "-C", "3", filters=[topic]).wait_subscribed()
    for payload in ("ab", "cd"):
        pub(broker.port, version, "-t", topic, "-m", payload)
    pub(broker.port, version, "-t", topic, "-n")
    assert n.output() == b"abcd"
    assert v.output() == f"{topic} ab\n{topic} cd\n{topic} (null)\n".encode()


@pytest.mark.parametrize("version", VERSIONS)
def test_will_on_sigkill(broker, subs, version):
    topic = f"it/will/{version}"
    watcher = subs(broker, "mqttv311", "-q", "1", "-C", "1", "-F", "%t|%q|%r|%p",
                   filters=["it/will/#"]).wait_subscribed()
    dying = subs(broker, version, "-t", "it/nothing", "--will-topic", topic, "--will-payload", "gone",
                 "--will-qos", "1", "--will-retain", wait=30, filters=["it/nothing"]).wait_subscribed()
    dying.proc.send_signal(signal.SIGKILL)
    dying.proc.wait(10)
    assert watcher.output() == f"{topic}|1|0|gone\n".encode()
    # --will-retain: a later subscriber sees it retained.
    late = subs(broker, version, "-C", "1", "-F", "%r|%p", filters=[topic])
    assert late.output() == b"1|gone\n"


@pytest.mark.parametrize("version", VERSIONS)
def test_will_on_sigint(broker, subs, version):
    """On SIGINT mosquitto_sub disconnects: plainly in 3.1.1 (the will is dropped), with
    reason 0x04 "Disconnect with Will Message" in 5.0 (the will is published)."""
    topic = f"it/will2/{version}"
    watcher = subs(broker, "mqttv311", "-C", "1", "-v", filters=["it/will2/#"]).wait_subscribed()
    leaving = subs(broker, version, "--will-topic", topic, "--will-payload", "gone", wait=30,
                   filters=["it/nothing"]).wait_subscribed()
    leaving.proc.send_signal(signal.SIGINT)
    leaving.finish()
    pub(broker.port, version, "-t", topic, "-m", "marker")
    expected = "gone" if version == "mqttv5" else "marker"
    assert watcher.output() == f"{topic} {expected}\n".encode()


@pytest.mark.parametrize("version", VERSIONS)
def test_persistent_session_queues_qos1(broker, subs, version):
    cid = uid("pers")
    topic = f"it/pers/{version}"
    # -E: subscribe, wait for the SUBACK, disconnect; -c keeps the session.
    subs(broker, version, "-c", "-q", "1", "-E", client_id=cid, filters=[topic]).output()
    pub(broker.port, version, "-q", "1", "-t", topic, "-l", input=b"m1\nm2\nm3\n")
    pub(broker.port, version, "-q", "0", "-t", topic, "-m", "qos0-not-queued")
    pub(broker.port, version, "-q", "1", "-t", topic, "-m", "m4")
    # --nodelay: mosquitto_sub -C exits right after the last message, with the SUBACK still
    # unread, so its socket closes with a RST; under Nagle its last PUBACKs would still be
    # in its send buffer and die with it (the broker would then rightly redeliver them).
    s = subs(broker, version, "-c", "-q", "1", "-C", "4", "-v", "--nodelay", client_id=cid, filters=[topic])
    assert s.output().decode().splitlines() == [f"{topic} m{i}" for i in range(1, 5)]
    # Acknowledged: a third connection gets nothing more (the PUBLISH below comes first).
    s = subs(broker, version, "-c", "-q", "1", "-C", "1", "-v", "--nodelay", client_id=cid,
             filters=[topic])
    s.wait_subscribed()
    pub(broker.port, version, "-q", "1", "-t", topic, "-m", "after")
    assert s.output() == f"{topic} after\n".encode()


def test_clean_session_discards_queue(broker, subs):
    cid = uid("pers")
    subs(broker, "mqttv311", "-c", "-q", "1", "-E", client_id=cid, filters=["it/clean"]).output()
    pub(broker.port, "mqttv311", "-q", "1", "-t", "it/clean", "-m", "old")
    # Without -c the session is clean: the queued message is gone.
    s = subs(broker, "mqttv311", "-q", "1", "-C", "1", "-v", client_id=cid,
             filters=["it/clean"]).wait_subscribed()
    pub(broker.port, "mqttv311", "-q", "1", "-t", "it/clean", "-m", "new")
    assert s.output() == b"it/clean new\n"


def test_user_properties_and_other_publish_properties(broker, subs):
    topic = "it/props"
    fmt = "%P|%C|%R|%D|%F|%S|%p"
    v5 = subs(broker, "mqttv5", "-C", "1", "-F", fmt, "-D", "subscribe", "subscription-identifier", "7",
              filters=[topic]).wait_subscribed()
    v311 = subs(broker, "mqttv311", "-C", "1", "-F", "%t|%p", filters=[topic]).wait_subscribed()
    pub(broker.port, "mqttv5", "-t", topic, "-m", "with props",
        "-D", "publish", "user-property", "a", "b",
        "-D", "publish", "user-property", "a", "c",
        "-D", "publish", "user-property", "key 2", "value 2",
        "-D", "publish", "content-type", "text/plain",
        "-D", "publish", "response-topic", "it/reply",
        "-D", "publish", "correlation-data", "corr-1",
        "-D", "publish", "payload-format-indicator", "1")
    # User properties keep their order and their duplicates.
    assert v5.output() == b"a:b a:c key 2:value 2|text/plain|it/reply|corr-1|1|7|with props\n"
    assert v311.output() == b"it/props|with props\n"


def test_message_expiry_forwarded(broker, subs):
    s = subs(broker, "mqttv5", "-C", "1", "-F", "%E|%p", filters=["it/exp"]).wait_subscribed()
    pub(broker.port, "mqttv5", "-t", "it/exp", "-m", "x", "-D", "publish", "message-expiry-interval", "60")
    expiry, payload = s.output().decode().strip().split("|")
    assert payload == "x" and 58 <= int(expiry) <= 60


@pytest.mark.parametrize("version", VERSIONS)
def test_large_payload_from_file(broker, subs, tmp_path, version):
    data = os.urandom(500 * 1024)
    f = tmp_path / "big.bin"
    f.write_bytes(data)
    s = subs(broker, version, "-q", "1", "-N", "-C", "1", wait=15, filters=["it/big"]).wait_subscribed()
    pub(broker.port, version, "-q", "1", "-t", "it/big", "-f", str(f))
    out = s.output()
    assert len(out) == len(data)
    assert out == data


@pytest.mark.parametrize("version", VERSIONS)
def test_wildcards_and_sys_topics(broker, subs, version):
    s = subs(broker, version, "-C", "2", "-v", filters=["it/wc/+/x", "it/wc/deep/#"]).wait_subscribed()
    pub(broker.port, version, "-t", "it/wc/a/y", "-m", "no")
    pub(broker.port, version, "-t", "it/wc/a/x", "-m", "plus")
    pub(broker.port, version, "-t", "it/wc/deep/1/2", "-m", "hash")
    assert s.output() == b"it/wc/a/x plus\nit/wc/deep/1/2 hash\n"


@pytest.mark.parametrize("version", VERSIONS)
def test_authenticated_user(make_broker, subs, version):
    from wrenmq.broker.hooks import Hook

    class Users(Hook):
        def authenticate(self, client, connect):
            return connect.username == "alice" and connect.password == b"s3cret"

    b = make_broker("[auth]\nallow_anonymous = false\n", hooks=[Users()])
    s = subs(b, version, "-u", "alice", "-P", "s3cret", "-C", "1", "-v", filters=["it/auth"]).wait_subscribed()
    bad = pub(b.port, version, "-u", "alice", "-P", "wrong", "-t", "it/auth", "-m", "x", check=False)
    assert bad.returncode != 0
    anon = pub(b.port, version, "-t", "it/auth", "-m", "x", check=False)
    assert anon.returncode != 0
    pub(b.port, version, "-u", "alice", "-P", "s3cret", "-t", "it/auth", "-m", "ok")
    assert s.output() == b"it/auth ok\n"


def test_mqttv31_roundtrip(broker, subs):
    s = subs(broker, "mqttv31", "-q", "1", "-C", "1", "-v", filters=["it/v31"]).wait_subscribed()
    pub(broker.port, "mqttv31", "-q", "2", "-i", uid("p31"), "-t", "it/v31", "-m", "old protocol")
    assert s.output() == b"it/v31 old protocol\n"


def test_client_maximum_packet_size_respected(broker, subs):
    """Messages larger than the subscriber's maximum packet size are not sent to it."""
    s = subs(broker, "mqttv5", "-C", "2", "-v", "-D", "connect", "maximum-packet-size", "200",
             filters=["it/mps"]).wait_subscribed()
    pub(broker.port, "mqttv5", "-t", "it/mps", "-m", "small")
    pub(broker.port, "mqttv5", "-t", "it/mps", "-m", "x" * 500)
    pub(broker.port, "mqttv5", "-t", "it/mps", "-m", "small again")
    assert s.output() == b"it/mps small\nit/mps small again\n"


def test_client_receive_maximum_1(broker, subs):
    n = 30
    s = subs(broker, "mqttv5", "-q", "2", "-C", str(n), "-D", "connect", "receive-maximum", "1",
             filters=["it/rm"]).wait_subscribed()
    pub(broker.port, "mqttv5", "-q", "2", "-t", "it/rm", "-l",
        input="".join(f"{i}\n" for i in range(n)).encode())
    assert s.output().decode().splitlines() == [str(i) for i in range(n)]

