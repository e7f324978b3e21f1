"""Transports: TLS (server and client certificates), WebSocket (ws/wss), Unix sockets.

Certificates come from trustme; the clients are real: mosquitto_pub/sub (TLS, client
certificates, --unix), paho-mqtt (TLS, websockets transport), MQTT.js under Node
(tests/js/mqttjs_roundtrip.js; `make test` installs it under .venv/npm), the
`websockets` client and raw sockets for what clients never send.
"""

import asyncio
import json
import logging
import os
import queue
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
import trustme

from conftest import ROOT, RunningBroker, free_port, wait_port
from mqtt_helpers import scrape, wait_for
from wrenmq.broker import Hook
from wrenmq.net.tls import cert_common_name
from wrenmq.config import ConfigError, load
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.codec import Decoder, encode
from wrenmq.mqtt.packets import Connect, Publish, Subscribe, SubscribeTopic

NODE_MODULES = ROOT / ".venv" / "npm" / "node_modules"
JS_ROUNDTRIP = Path(__file__).resolve().parent / "js" / "mqttjs_roundtrip.js"


# --- certificates ------------------------------------------------------------------


class Pki:
    """A CA, two server certificates (for the reload test), a client certificate and
    one signed by a CA the broker does not trust - all as files."""

    def __init__(self, d):
        self.dir = d
        self.ca = trustme.CA()
        self.other_ca = trustme.CA()
        self.ca_file = self._write("ca.pem", self.ca.cert_pem)
        self.server = self.ca.issue_cert("127.0.0.1", "localhost")
        self.server2 = self.ca.issue_cert("127.0.0.1", "localhost", common_name="second server cert")
        self.server_cert = self._write("server.crt", *self.server.cert_chain_pems)
        self.server_key = self._write("server.key", self.server.private_key_pem)
        self.server_bundle = self._write("server.pem", self.server.private_key_and_cert_chain_pem)
        self.client = self.ca.issue_cert("alice@example.com", common_name="alice")
        self.client_cert = self._write("alice.crt", *self.client.cert_chain_pems)
        self.client_key = self._write("alice.key", self.client.private_key_pem)
        rogue = self.other_ca.issue_cert("mallory@example.com", common_name="mallory")
        self.rogue_cert = self._write("mallory.crt", *rogue.cert_chain_pems)
        self.rogue_key = self._write("mallory.key", rogue.private_key_pem)

    def _write(self, name, *blobs):
        path = self.dir / name
        path.write_bytes(b"".join(b.bytes() for b in blobs))
        return str(path)

    def client_context(self, **kw):
        ctx = ssl.create_default_context(cafile=self.ca_file)
        for k, v in kw.items():
            setattr(ctx, k, v)
        return ctx


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return Pki(tmp_path_factory.mktemp("pki"))


def der(pem_blob):
    return ssl.PEM_cert_to_DER_cert(pem_blob.bytes().decode())


# --- helpers ---------------------------------------------------------------------------


def tls_listener(pki, port, **extra):
    lines = ["[[listener]]", f"port = {port}", "tls = true",
             f'certfile = "{pki.server_cert}"', f'keyfile = "{pki.server_key}"']
    for k, v in extra.items():
        lines.append(f"{k} = {json.dumps(v)}")
    return "\n".join(lines) + "\n"


def mosq(cmd, *args, timeout=15):
    return subprocess.run([cmd, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def wait_log(caplog, text, timeout=5.0):
    return wait_for(lambda: text in caplog.text, timeout)


def paho(port, version=5, transport="tcp", cafile=None, cert=None, key=None, path=None,
         username=None, client_id=None):
    """A connected paho client (loop running) with a `messages` queue."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    proto = {5: mqtt.MQTTv5, 4: mqtt.MQTTv311}[version]
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id or f"t-{uuid.uuid4().hex[:8]}",
                    protocol=proto, transport=transport)
    c.messages = queue.Queue()
    c.connack = queue.Queue()
    c.subacks = queue.Queue()
    c.disconnected = threading.Event()
    c.on_connect = lambda cl, ud, flags, rc, props: cl.connack.put(rc)
    c.on_message = lambda cl, ud, msg: cl.messages.put(msg)
    c.on_subscribe = lambda cl, ud, mid, rcs, props: cl.subacks.put(rcs)
    c.on_disconnect = lambda cl, ud, flags, rc, props: cl.disconnected.set()
    if cafile:
        c.tls_set(ca_certs=cafile, certfile=cert, keyfile=key)
    if path:
        c.ws_set_options(path=path)
    if username:
        c.username_pw_set(username, "secret")
    c.connect("127.0.0.1", port, keepalive=30)
    c.loop_start()
    rc = c.connack.get(timeout=10)
    assert not rc.is_failure, rc
    return c


def subscribe(c, topic, qos=1):
    c.subscribe(topic, qos)
    return c.subacks.get(timeout=5)


def roundtrip(sub_client, pub_client, topic=None, payload=None):
    topic = topic or f"t/{uuid.uuid4().hex[:8]}"
    payload = payload or uuid.uuid4().bytes
    subscribe(sub_client, topic)
    pub_client.publish(topic, payload, qos=1)
    msg = sub_client.messages.get(timeout=5)
    assert (msg.topic, msg.payload) == (topic, payload)


@pytest.fixture
def pahos():
    made = []

    def factory(*a, **kw):
        c = paho(*a, **kw)
        made.append(c)
        return c

    yield factory
    for c in made:
        try:
            c.disconnect()
        except Exception:
            pass
        c.loop_stop()


def connect_bytes(client_id="raw", version=C.MQTT311, **kw):
    return encode(Connect(client_id=client_id, version=version, **kw), version)


def read_packets(sock_recv, decoder, n=1, timeout=5.0):
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"got {out}")
        data = sock_recv()
        if not data:
            break
        out.extend(decoder.feed(data))
    return out


# --- configuration -------------------------------------------------------------------


@pytest.mark.parametrize("text, key", [
    ("tls = true", "listener[0].certfile: required when tls = true"),
    ('certfile = "x.pem"', "listener[0].certfile: only used with tls = true"),
    ("require_certificate = true", "listener[0].require_certificate: only used with tls = true"),
    ('tls = true\ncertfile = "{crt}"\nrequire_certificate = true', "listener[0].cafile: required when require_certificate"),
    ('tls = true\ncertfile = "{crt}"\ncafile = "{ca}"\nuse_identity_as_username = true',
     "listener[0].use_identity_as_username: needs require_certificate = true"),
    ('tls = true\ncertfile = "/nonexistent/cert.pem"', "listener[0].certfile: file not found: /nonexistent/cert.pem"),
    ('tls = true\ncertfile = "{crt}"\ncafile = "/nope/ca.pem"', "listener[0].cafile: file not found"),
    ('type = "unix"', 'listener[0].path: required for type = "unix"'),
    ('type = "unix"\npath = "/tmp/x.sock"\ntls = true\ncertfile = "{crt}"', "listener[0].tls: not supported"),
    ('path = "/mqtt"', 'listener[0].path: only for type = "ws", "metrics" or "unix"'),
    ('type = "metrics"\npath = "metrics"', "listener[0].path: expected an HTTP path starting with '/'"),
    ('type = "metrics"\ntls = true\ncertfile = "{crt}"\ncafile = "{ca}"\nrequire_certificate = true\n'
     'use_identity_as_username = true', 'listener[0].use_identity_as_username: not for type = "metrics"'),
    ('type = "ws"\npath = "mqtt"', "listener[0].path: expected an HTTP path starting with '/'"),
    ('type = "unix"\npath = "/tmp/x.sock"\nmode = "999"', "listener[0].mode: expected an octal file mode"),
    ('type = "wss"', "listener[0].type: expected one of mqtt, ws, unix"),
    ('tls = true\ncertfile = "{crt}"\nmin_tls_version = "1.1"', "listener[0].min_tls_version: expected one of 1.2, 1.3"),
    ('tls = true\ncertfile = "{crt}"\ncrlfile = "{ca}"', "listener[0].crlfile: needs cafile"),
    ('origins = ["https://a.example"]', 'listener[0].origins: only for type = "ws"'),
    ('users = ["prom"]', 'listener[0].users: only for type = "metrics"'),
    ('type = "metrics"\nusers = ["prom"]', "listener[0].users: needs [auth] password_file"),
    ('type = "ws"\norigins = ["a.example"]', "listener[0].origins: expected origins like"),
])
def test_listener_config_errors_name_the_key(pki, text, key):
    text = text.format(crt=pki.server_cert, ca=pki.ca_file)
    with pytest.raises(ConfigError) as e:
        load(text="[[listener]]\n" + text + "\n")
    assert key in str(e.value)


def test_listener_config_accepts_every_type(pki):
    cfg = load(text=f"""
[[listener]]
port = 8883
tls = true
certfile = "{pki.server_bundle}"
cafile = "{pki.ca_file}"
require_certificate = true
use_identity_as_username = true
min_tls_version = "1.3"
[[listener]]
type = "ws"
port = 9001
[[listener]]
type = "ws"
port = 9443
tls = true
certfile = "{pki.server_cert}"
keyfile = "{pki.server_key}"
path = "/custom"
[[listener]]
type = "unix"
path = "/run/wrenmq.sock"
mode = "0660"
[[listener]]
type = "unix"
path = "/run/other.sock"
""")
    types = [(lst.type, lst.tls) for lst in cfg.listener]
    assert types == [("mqtt", True), ("ws", False), ("ws", True), ("unix", False), ("unix", False)]
    assert cfg.listener[3].name == "unix:/run/wrenmq.sock" and cfg.listener[3].loopback_only


def test_bad_certificate_stops_the_broker_with_the_key(tmp_path, pki):
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    with pytest.raises(OSError, match=r"listener\[1\]\.certfile: cannot load .*bad\.pem"):
        RunningBroker(f'[[listener]]\nport = 0\ntls = true\ncertfile = "{bad}"\n')
    with pytest.raises(OSError, match=r"listener\[1\]\.certfile/keyfile: cannot load"):
        RunningBroker(f'[[listener]]\nport = 0\ntls = true\ncertfile = "{pki.server_cert}"\n'
                      f'keyfile = "{pki.client_key}"\n')  # a key that does not match


# --- TLS ------------------------------------------------------------------------------


def test_tls_mosquitto_and_paho(make_broker, pki, pahos):
    port = free_port()
    b = make_broker(tls_listener(pki, port))
    topic = f"tls/{uuid.uuid4().hex[:8]}"
    sub = subprocess.Popen(["mosquitto_sub", "-p", str(port), "--cafile", pki.ca_file, "-h", "127.0.0.1",
                            "-t", topic, "-C", "1", "-W", "10", "-q", "1", "-V", "mqttv311"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # The subscriber is in once a retained-free publish reaches it: retry until it does.
        def published():
            r = mosq("mosquitto_pub", "-p", port, "--cafile", pki.ca_file, "-h", "localhost",
                     "-t", topic, "-m", "over TLS", "-q", "1", "-V", "mqttv5")
            assert r.returncode == 0, r.stderr
            try:
                sub.wait(0.3)
                return True
            except subprocess.TimeoutExpired:
                return False
        assert wait_for(published, 10, 0)
        out, err = sub.communicate(timeout=5)
        assert out.strip() == "over TLS", err
    finally:
        if sub.poll() is None:
            sub.kill()
    # paho over TLS, both versions, talking to a plain-TCP client.
    plain = pahos(b.port, 4)
    for version in (4, 5):
        c = pahos(port, version, cafile=pki.ca_file)
        roundtrip(c, plain)
        roundtrip(plain, c)
    # The plain listener is still plain.
    assert b.broker.addresses[0] == ("127.0.0.1", b.port)


def test_tls_client_certificate_identity_as_username(make_broker, pki, caplog):
    """The client certificate's CN is the user name: the CONNECT's user name and password
    are dropped, hooks see the CN (and the certificate), ACL-like checks apply to it."""
    caplog.set_level(logging.INFO)
    seen = []

    class Recorder(Hook):
        def on_connect(self, client):
            seen.append(("connect", client.username))

        def authorize_publish(self, client, topic, qos, retain):
            seen.append(("publish", client.username, topic))
            return None if topic.startswith(f"users/{client.username}/") else False

    port = free_port()
    b = make_broker(tls_listener(pki, port, cafile=pki.ca_file, require_certificate=True,
                                 use_identity_as_username=True), hooks=[Recorder()])
    common = ["-p", port, "-h", "127.0.0.1", "--cafile", pki.ca_file, "-m", "m", "-q", "1", "-V", "mqttv5"]
    r = mosq("mosquitto_pub", *common, "-t", "users/alice/x", "--cert", pki.client_cert,
             "--key", pki.client_key, "-u", "bob", "-P", "bobs-password")
    assert r.returncode == 0, r.stderr
    assert seen == [("connect", "alice"), ("publish", "alice", "users/alice/x")]
    # The identity is what the hooks judge: bob's topic is refused (5.0 PUBACK 0x87).
    r = mosq("mosquitto_pub", *common, "-t", "users/bob/x", "--cert", pki.client_cert,
             "--key", pki.client_key, "-u", "bob", "-d")
    assert ("publish", "alice", "users/bob/x") in seen
    assert "RC:135" in r.stdout, r.stdout

    # What CertConnection hands to authenticate() on such a listener.
    from wrenmq.broker.listeners.tls import CertConnection
    assert isinstance(b.broker._servers[1]._connection(), CertConnection)
    assert cert_common_name({"subject": ((("countryName", "FR"),), (("commonName", "alice"),))}) == "alice"
    assert cert_common_name({}) is None and cert_common_name(None) is None

    # No client certificate, or one from a CA the listener does not trust: refused in the handshake.
    n = len(seen)
    r = mosq("mosquitto_pub", *common, "-t", "users/x/y")
    assert r.returncode != 0
    assert wait_log(caplog, "client certificate missing or not trusted")
    caplog.clear()
    r = mosq("mosquitto_pub", *common, "-t", "users/x/y", "--cert", pki.rogue_cert, "--key", pki.rogue_key)
    assert r.returncode != 0
    assert wait_log(caplog, "client certificate missing or not trusted")
    assert len(seen) == n  # neither reached CONNECT
    assert wait_for(lambda: b.call(lambda: len(b.broker.connections)) == 0, 5)


def test_tls_optional_client_certificate_visible_to_hooks(make_broker, pki, pahos):
    """cafile without require_certificate: certificates are verified when offered."""
    seen = []

    class Peek(Hook):
        def authenticate(self, client, connect):
            seen.append((client.username, client.cert_identity, cert_common_name(client.peercert)))
            return None

    port = free_port()
    make_broker(tls_listener(pki, port, cafile=pki.ca_file), hooks=[Peek()])
    pahos(port, 5, cafile=pki.ca_file, username="carol")
    pahos(port, 4, cafile=pki.ca_file, cert=pki.client_cert, key=pki.client_key, username="carol")
    assert seen == [("carol", None, None), ("carol", None, "alice")]


def test_tls_1_1_refused(make_broker, pki, caplog):
    caplog.set_level(logging.INFO)
    port = free_port()
    make_broker(tls_listener(pki, port))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ctx = pki.client_context(minimum_version=ssl.TLSVersion.TLSv1, maximum_version=ssl.TLSVersion.TLSv1_1)
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        with pytest.raises(ssl.SSLError):
            ctx.wrap_socket(s, server_hostname="127.0.0.1")
    assert wait_log(caplog, "the client's TLS version is too old (the minimum is TLS 1.2)")
    # TLS 1.2 and 1.3 are fine.
    for version in (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3):
        ctx = pki.client_context(minimum_version=version, maximum_version=version)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            with ctx.wrap_socket(s, server_hostname="127.0.0.1") as t:
                assert t.version() == {ssl.TLSVersion.TLSv1_2: "TLSv1.2", ssl.TLSVersion.TLSv1_3: "TLSv1.3"}[version]
                t.sendall(connect_bytes())
                assert read_packets(t.recv, Decoder(C.MQTT311))[0].TYPE == C.CONNACK


def test_min_tls_version_1_3(make_broker, pki, caplog):
    caplog.set_level(logging.INFO)
    port = free_port()
    make_broker(tls_listener(pki, port, min_tls_version="1.3"))
    ctx = pki.client_context(maximum_version=ssl.TLSVersion.TLSv1_2)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        with pytest.raises(ssl.SSLError):
            ctx.wrap_socket(s, server_hostname="127.0.0.1")
    assert wait_log(caplog, "too old (the minimum is TLS 1.3)")


def test_plain_client_on_tls_port_and_tls_client_on_plain_port(make_broker, pki, pahos, caplog):
    caplog.set_level(logging.INFO)
    port = free_port()
    b = make_broker(tls_listener(pki, port))
    # Bystanders on both listeners, to show nobody else is disturbed.
    tls_client = pahos(port, 5, cafile=pki.ca_file)
    plain_client = pahos(b.port, 4)

    # A plain MQTT client (raw CONNECT) on the TLS port: closed at once, with a clear line.
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(connect_bytes())
        assert s.recv(100) == b""
    assert time.monotonic() - t0 < 3
    assert wait_log(caplog, "sent an MQTT CONNECT, not a TLS ClientHello, to TLS listener") or \
        wait_log(caplog, "did not start a TLS handshake on TLS listener")
    # The same with mosquitto_pub: it fails fast instead of hanging.
    t0 = time.monotonic()
    r = mosq("mosquitto_pub", "-p", port, "-h", "127.0.0.1", "-t", "x", "-m", "y", "-q", "1")
    assert r.returncode != 0 and time.monotonic() - t0 < 5

    # A TLS client on the plain port.
    caplog.clear()
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", b.port), timeout=5) as s:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            pki.client_context().wrap_socket(s, server_hostname="127.0.0.1")
    assert time.monotonic() - t0 < 3
    assert wait_log(caplog, "sent a TLS ClientHello to plain MQTT listener")
    r = mosq("mosquitto_pub", "-p", b.port, "-h", "127.0.0.1", "--cafile", pki.ca_file,
             "-t", "x", "-m", "y", "-q", "1")
    assert r.returncode != 0 and time.monotonic() - t0 < 8

    # A WebSocket client on the MQTT port gets its own hint.
    with socket.create_connection(("127.0.0.1", b.port), timeout=5) as s:
        s.sendall(b"GET /mqtt HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(100) == b""
    assert wait_log(caplog, "sent an HTTP request to MQTT listener")

    # A client that connects to the TLS port and says nothing is dropped after connect_timeout.
    # (covered with a short timeout in test_tls_handshake_timeout)

    # Both bystanders still work.
    assert not tls_client.disconnected.is_set() and not plain_client.disconnected.is_set()
    roundtrip(tls_client, plain_client)
    roundtrip(plain_client, tls_client)


def test_tls_handshake_timeout(make_broker, pki, caplog):
    caplog.set_level(logging.INFO)
    port = free_port()
    make_broker(tls_listener(pki, port) + "[limits]\nconnect_timeout = 0.5\n")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        t0 = time.monotonic()
        assert s.recv(10) == b""
        assert time.monotonic() - t0 < 3
    assert wait_log(caplog, "timed out after 0.5s")


def test_tls_handshakes_count_against_max_connections(make_broker, pki, pahos):
    """Connections still in their TLS handshake count as connections (as they do in a
    WebSocket handshake, or waiting for CONNECT): idle ones cannot hold more than the limit."""
    port = free_port()
    b = make_broker(tls_listener(pki, port) + "[limits]\nmax_connections = 3\nconnect_timeout = 30\n")
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(3)]
    deadline = time.monotonic() + 5
    while b.call(lambda: b.broker.handshakes) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _closed_at_once(port)
    assert _closed_at_once(b.port)  # the plain listener counts them too
    for s in idle:
        s.close()
    deadline = time.monotonic() + 5
    while b.call(lambda: b.broker.handshakes) and time.monotonic() < deadline:
        time.sleep(0.05)
    clients = [pahos(port, 5, cafile=pki.ca_file), pahos(port, 4, cafile=pki.ca_file), pahos(b.port, 5)]
    assert b.call(lambda: (b.broker.handshakes, len(b.broker.connections))) == (0, 3)
    assert _closed_at_once(port)
    roundtrip(clients[0], clients[2])


def _memory_bio_client(pki):
    ctx = pki.client_context()
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    return ctx.wrap_bio(inc, out, server_hostname="127.0.0.1"), inc, out


def test_tls_client_hello_and_connect_sent_at_once(make_broker, pki):
    """The ClientHello arrives with the TCP connection (uvloop reads it before start_tls),
    and the CONNECT arrives in the same segment as the client's Finished (TLS 1.3): both
    must reach their layer in order."""
    port = free_port()
    make_broker(tls_listener(pki, port))
    for _ in range(5):
        obj, inc, out = _memory_bio_client(pki)
        try:
            obj.do_handshake()
        except ssl.SSLWantReadError:
            pass
        hello = out.read()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(hello)
            while True:
                data = s.recv(65536)
                assert data, "server closed during the handshake"
                inc.write(data)
                try:
                    obj.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    pass
            obj.write(connect_bytes("early") + encode(Subscribe(1, [SubscribeTopic("e/#", 0)]), C.MQTT311))
            s.sendall(out.read())  # Finished + CONNECT + SUBSCRIBE in one write
            dec = Decoder(C.MQTT311)
            got = []
            deadline = time.monotonic() + 5
            while len(got) < 2 and time.monotonic() < deadline:
                data = s.recv(65536)
                assert data
                inc.write(data)
                while True:
                    try:
                        got.extend(dec.feed(obj.read(65536)))
                    except (ssl.SSLWantReadError, ssl.SSLZeroReturnError):
                        break
            assert [p.TYPE for p in got] == [C.CONNACK, C.SUBACK]


def test_tls_and_wss_on_the_default_asyncio_loop(monkeypatch, pki, pahos, caplog):
    """The same TLS front end without uvloop (asyncio's own SSL protocol)."""
    import sys
    caplog.set_level(logging.INFO)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # RunningBroker falls back to asyncio
    tls_port, wss_port = free_port(), free_port()
    b = RunningBroker(tls_listener(pki, tls_port) + ws_listener(wss_port, pki))
    try:
        assert "uvloop" not in type(b.loop).__module__
        c = pahos(tls_port, 5, cafile=pki.ca_file)
        w = pahos(wss_port, 4, transport="websockets", cafile=pki.ca_file)
        roundtrip(c, w)
        roundtrip(w, c)
        with socket.create_connection(("127.0.0.1", tls_port), timeout=5) as s:
            s.sendall(connect_bytes())
            assert s.recv(100) == b""
        assert wait_log(caplog, "on TLS listener 127.0.0.1:%d" % tls_port)
        for x in (c, w):
            x.disconnect()
            x.loop_stop()
    finally:
        b.stop()


def make_crl(pki, *revoked):
    """A PEM CRL signed by the test CA, revoking the given trustme leaf certificates."""
    import datetime
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    ca_key = serialization.load_pem_private_key(pki.ca.private_key_pem.bytes(), None)
    ca_cert = x509.load_pem_x509_certificate(pki.ca.cert_pem.bytes())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca_cert.subject)
               .last_update(now - datetime.timedelta(minutes=1))
               .next_update(now + datetime.timedelta(days=1)))
    for leaf in revoked:
        serial = x509.load_pem_x509_certificate(leaf.cert_chain_pems[0].bytes()).serial_number
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build())
    return builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def test_tls_revoked_client_certificate_refused_after_reload(make_broker, pki, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    crl = tmp_path / "crl.pem"
    crl.write_bytes(make_crl(pki))
    port = free_port()
    b = make_broker(tls_listener(pki, port, cafile=pki.ca_file, require_certificate=True, crlfile=str(crl)))
    args = ["-p", port, "-h", "127.0.0.1", "--cafile", pki.ca_file, "-t", "crl/x", "-m", "m", "-q", "1",
            "--cert", pki.client_cert, "--key", pki.client_key]
    r = mosq("mosquitto_pub", *args)
    assert r.returncode == 0, r.stderr
    crl.write_bytes(make_crl(pki, pki.client))
    b.call(b.broker.hooks.reload)  # what SIGHUP does
    assert "TLS certificate reloaded" in caplog.text
    r = mosq("mosquitto_pub", *args)
    assert r.returncode != 0
    assert wait_log(caplog, "certificate revoked")


# --- TLS reload on SIGHUP ----------------------------------------------------------------


def test_tls_certificate_reload_on_sighup(serve_broker, pki, tmp_path):
    cert = tmp_path / "live.crt"
    key = tmp_path / "live.key"
    cert.write_bytes(b"".join(b.bytes() for b in pki.server.cert_chain_pems))
    key.write_bytes(pki.server.private_key_pem.bytes())
    tls_port = free_port()
    b = serve_broker(f"""
[[listener]]
port = 0
[[listener]]
port = {tls_port}
tls = true
certfile = "{cert}"
keyfile = "{key}"
[storage]
mode = "memory"
""")
    wait_port(tls_port, proc=b.proc)

    def served_cert():
        ctx = pki.client_context()
        with socket.create_connection(("127.0.0.1", tls_port), timeout=5) as s:
            with ctx.wrap_socket(s, server_hostname="127.0.0.1") as t:
                return t.getpeercert(binary_form=True)

    first, second = der(pki.server.cert_chain_pems[0]), der(pki.server2.cert_chain_pems[0])
    assert served_cert() == first
    old = paho(tls_port, 5, cafile=pki.ca_file)
    try:
        cert.write_bytes(b"".join(x.bytes() for x in pki.server2.cert_chain_pems))
        key.write_bytes(pki.server2.private_key_pem.bytes())
        b.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: served_cert() == second, 5)
        assert "TLS certificate reloaded" in b.log
        # A reload that fails keeps the certificate in use.
        cert.write_text("garbage\n")
        b.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: "TLS reload failed" in b.log, 5)
        assert served_cert() == second
        # The connection made before the reloads is still up and working.
        assert not old.disconnected.is_set()
        new = paho(tls_port, 4, cafile=pki.ca_file)
        try:
            roundtrip(old, new)
            roundtrip(new, old)
        finally:
            new.disconnect()
            new.loop_stop()
    finally:
        old.disconnect()
        old.loop_stop()
    assert b.stop() == 0


# --- WebSocket ---------------------------------------------------------------------------


def ws_listener(port, tls_pki=None, **extra):
    text = f'[[listener]]\ntype = "ws"\nport = {port}\n'
    if tls_pki is not None:
        text += f'tls = true\ncertfile = "{tls_pki.server_cert}"\nkeyfile = "{tls_pki.server_key}"\n'
    for k, v in extra.items():
        text += f"{k} = {json.dumps(v)}\n"
    return text


@pytest.mark.parametrize("secure", [False, True], ids=["ws", "wss"])
@pytest.mark.parametrize("version", [4, 5], ids=["3.1.1", "5.0"])
def test_paho_over_websocket(make_broker, pki, pahos, secure, version):
    port = free_port()
    b = make_broker(ws_listener(port, pki if secure else None))
    ws = pahos(port, version, transport="websockets", cafile=pki.ca_file if secure else None)
    tcp = pahos(b.port, version)
    roundtrip(ws, tcp)
    roundtrip(tcp, ws)
    # A bigger message than one frame buffer, both ways.
    big = os.urandom(300_000)
    roundtrip(ws, tcp, payload=big)
    roundtrip(tcp, ws, payload=big)


def test_websocket_path_and_subprotocol(make_broker, pahos, caplog):
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    caplog.set_level(logging.INFO)
    port = free_port()
    b = make_broker(ws_listener(port, path="/custom"))
    c = pahos(port, 5, transport="websockets", path="/custom")
    roundtrip(c, pahos(b.port, 5))
    with pytest.raises(InvalidStatus) as e:
        connect(f"ws://127.0.0.1:{port}/mqtt", subprotocols=["mqtt"], open_timeout=5)
    assert e.value.response.status_code == 404
    assert wait_log(caplog, "asked for /mqtt, not /custom: 404")
    # An unknown subprotocol is refused; "mqtt" is chosen; none at all is tolerated.
    with pytest.raises(InvalidStatus) as e:
        connect(f"ws://127.0.0.1:{port}/custom", subprotocols=["chat"], open_timeout=5)
    assert e.value.response.status_code == 400
    with connect(f"ws://127.0.0.1:{port}/custom?x=1", subprotocols=["mqttv3.1", "mqtt"]) as ws:
        assert ws.subprotocol == "mqtt"
        ws.send(connect_bytes())
        assert Decoder(C.MQTT311).feed(ws.recv(timeout=5))[0].TYPE == C.CONNACK
    with connect(f"ws://127.0.0.1:{port}/custom") as ws:
        assert ws.subprotocol is None
        ws.send(connect_bytes())
        assert Decoder(C.MQTT311).feed(ws.recv(timeout=5))[0].TYPE == C.CONNACK


def test_websocket_allowed_origins(make_broker, caplog):
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    caplog.set_level(logging.INFO)
    port = free_port()
    make_broker(ws_listener(port, origins=["https://app.example.com"]))
    url = f"ws://127.0.0.1:{port}/mqtt"
    with pytest.raises(InvalidStatus) as e:
        connect(url, subprotocols=["mqtt"], origin="https://evil.example.net", open_timeout=5)
    assert e.value.response.status_code == 403
    assert wait_log(caplog, "came from origin https://evil.example.net, not an allowed one: 403")
    for origin in ("https://app.example.com", None):  # an allowed page; a client that is no browser
        with connect(url, subprotocols=["mqtt"], origin=origin, open_timeout=5) as ws:
            ws.send(connect_bytes())
            assert Decoder(C.MQTT311).feed(ws.recv(timeout=5))[0].TYPE == C.CONNACK


def test_websocket_frames_split_and_joined(make_broker):
    """MQTT packets may be split over frames and several may share one; text frames close."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    port = free_port()
    make_broker(ws_listener(port))
    with connect(f"ws://127.0.0.1:{port}/mqtt", subprotocols=["mqtt"]) as ws:
        data = connect_bytes("split") + encode(Subscribe(1, [SubscribeTopic("s/#", 1)]), C.MQTT311)
        for i in range(0, len(data), 3):
            ws.send(data[i:i + 3])
        dec = Decoder(C.MQTT311)
        got = []
        while len(got) < 2:
            got.extend(dec.feed(ws.recv(timeout=5)))
        assert [p.TYPE for p in got] == [C.CONNACK, C.SUBACK]
        ws.send(encode(Publish("s/1", b"a"), C.MQTT311) + encode(Publish("s/2", b"b"), C.MQTT311))
        got = []
        while len(got) < 2:
            got.extend(dec.feed(ws.recv(timeout=5)))
        assert [(p.topic, p.payload) for p in got] == [("s/1", b"a"), ("s/2", b"b")]
        ws.send("a text frame")
        with pytest.raises(ConnectionClosed) as e:
            ws.recv(timeout=5)
        assert e.value.rcvd.code == 1003


def test_websocket_tls_client_on_plain_ws_port(make_broker, pki, caplog):
    caplog.set_level(logging.INFO)
    port = free_port()
    make_broker(ws_listener(port))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            pki.client_context().wrap_socket(s, server_hostname="127.0.0.1")
    assert wait_log(caplog, "sent a TLS ClientHello to plain WebSocket listener")


def test_websocket_reading_paused_during_authentication(make_broker):
    """An async auth hook pauses reading: frames sent meanwhile wait, in order."""
    from websockets.sync.client import connect

    class SlowAuth(Hook):
        async def authenticate(self, client, connect):
            await asyncio.sleep(0.3)
            return True

    port = free_port()
    make_broker(ws_listener(port), hooks=[SlowAuth()])
    with connect(f"ws://127.0.0.1:{port}/mqtt", subprotocols=["mqtt"]) as ws:
        ws.send(connect_bytes("slow"))
        ws.send(encode(Subscribe(1, [SubscribeTopic("p/#", 0)]), C.MQTT311))
        ws.send(encode(Publish("p/1", b"x"), C.MQTT311))
        dec = Decoder(C.MQTT311)
        got = []
        while len(got) < 3:
            got.extend(dec.feed(ws.recv(timeout=5)))
        assert [p.TYPE for p in got] == [C.CONNACK, C.SUBACK, C.PUBLISH]


def _closed_at_once(port):
    """True if a new connection to `port` is closed before it sends anything."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.settimeout(2)
        try:
            return s.recv(10) == b""
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False


def test_websocket_handshakes_count_against_max_connections(make_broker, pahos):
    """Connections still in their WebSocket handshake count as connections, as MQTT
    connections do before their CONNECT: idle ones cannot hold more than max_connections."""
    port = free_port()
    b = make_broker(ws_listener(port) + "[limits]\nmax_connections = 3\nconnect_timeout = 30\n")
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(3)]
    assert _closed_at_once(port)
    assert b.call(b.broker.sys_topics.snapshot)["$SYS/broker/connections/refused"] >= 1
    for s in idle:
        s.close()
    deadline = time.monotonic() + 5
    while b.call(lambda: b.broker.handshakes) and time.monotonic() < deadline:
        time.sleep(0.05)
    # Handshakes that end (closed, or done) uncount themselves: three real clients fit,
    # and while they are connected a fourth is refused at once.
    clients = [pahos(port, 5, transport="websockets") for _ in range(3)]
    assert b.call(lambda: b.broker.handshakes) == 0
    assert _closed_at_once(port)
    clients[0].disconnect()
    clients[0].disconnected.wait(5)
    deadline = time.monotonic() + 5
    while b.call(lambda: len(b.broker.connections)) > 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    roundtrip(clients[1], pahos(port, 4, transport="websockets"))


def test_websocket_slow_subscriber_is_paused_not_buffered(make_broker, pahos):
    """A WebSocket subscriber that stops reading: the broker pauses it (its QoS 0 messages
    are dropped, its output stays bounded) while a TCP subscriber gets everything."""
    from websockets.sync.client import connect

    high = 65536
    port = free_port()
    b = make_broker(ws_listener(port) + f"[limits]\nwrite_buffer_high = {high}\n")
    fast = pahos(b.port, 4)
    subscribe(fast, "flood/#", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    with connect(f"ws://127.0.0.1:{port}/mqtt", sock=sock, subprotocols=["mqtt"], max_size=None) as ws:
        ws.send(connect_bytes("slow-ws"))
        dec = Decoder(C.MQTT311)
        assert dec.feed(ws.recv(timeout=5))[0].TYPE == C.CONNACK
        ws.send(encode(Subscribe(1, [SubscribeTopic("flood/#", 0)]), C.MQTT311))
        assert dec.feed(ws.recv(timeout=5))[0].TYPE == C.SUBACK
        # From here the WebSocket client reads nothing.
        pub = pahos(b.port, 4)
        n, payload = 1000, b"x" * 8192
        for i in range(n):
            pub.publish(f"flood/{i}", payload, qos=1)
        got = [fast.messages.get(timeout=10).topic for _ in range(n)]
        assert got == [f"flood/{i}" for i in range(n)]

        def ws_state():
            c = next(c for c in b.broker.connections
                     if c.session is not None and c.session.client_id == "slow-ws")
            return c.congested, c.transport.get_write_buffer_size()

        congested, buffered = b.call(ws_state)
        assert congested
        # Bounded: the limit, plus what one loop turn routed (one read of publishes) and
        # what websockets holds - far below the 8 MB that were published.
        assert buffered < 1024 * 1024
        # Reading again drains it, and the connection still works both ways.
        received = 0
        while True:
            try:
                frame = ws.recv(timeout=1)
            except TimeoutError:
                break
            received += len(dec.feed(frame))
        assert 0 < received < n
        assert b.call(ws_state)[0] is False
        ws.send(encode(Publish("flood/last", b"end"), C.MQTT311))
        assert fast.messages.get(timeout=5).topic == "flood/last"
        assert dec.feed(ws.recv(timeout=5))[0].topic == "flood/last"


# --- MQTT.js under Node ------------------------------------------------------------------


def node_roundtrip(sub_url, pub_url, version, cafile=None):
    node = shutil.which("node")
    if node is None or not (NODE_MODULES / "mqtt").is_dir():
        pytest.skip("MQTT.js is not installed (make test installs it into .venv/npm)")
    env = dict(os.environ, NODE_PATH=str(NODE_MODULES))
    args = [node, str(JS_ROUNDTRIP), sub_url, pub_url, str(version)] + ([cafile] if cafile else [])
    r = subprocess.run(args, capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode == 0, (r.stdout, r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("version", [4, 5], ids=["3.1.1", "5.0"])
def test_mqttjs_over_websocket_and_tcp(make_broker, pki, version):
    ws_port, wss_port = free_port(), free_port()
    b = make_broker(ws_listener(ws_port) + ws_listener(wss_port, pki))
    ws, wss, tcp = f"ws://127.0.0.1:{ws_port}/mqtt", f"wss://localhost:{wss_port}/mqtt", f"mqtt://127.0.0.1:{b.port}"
    r = node_roundtrip(ws, tcp, version)
    assert r["ok"] and r["qos"] == 1 and r["payload"] == f"hello from MQTT.js (MQTT {version})"
    assert node_roundtrip(tcp, ws, version)["ok"]
    assert node_roundtrip(wss, ws, version, pki.ca_file)["ok"]


def test_stop_is_quick_with_silent_connections_on_every_listener(pki, unix_path):
    """Connections that never finish their TLS, WebSocket or MQTT handshake do not hold
    up a shutdown."""
    ports = [free_port() for _ in range(3)]
    path = unix_path
    b = RunningBroker(tls_listener(pki, ports[0]) + ws_listener(ports[1]) + ws_listener(ports[2], pki)
                      + f'[[listener]]\ntype = "unix"\npath = "{path}"\n')
    socks = [socket.create_connection(("127.0.0.1", p)) for p in [b.port, *ports]]
    u = socket.socket(socket.AF_UNIX)
    u.connect(str(path))
    socks.append(u)
    w = socket.create_connection(("127.0.0.1", ports[1]))
    w.sendall(b"GET /mqtt HTTP/1.1\r\nHost: x\r\n")  # half a request
    socks.append(w)
    time.sleep(0.2)
    t0 = time.monotonic()
    b.stop()
    assert time.monotonic() - t0 < 3
    for s in socks:
        s.settimeout(2)
        try:
            assert s.recv(100) == b""
        except ConnectionResetError:
            pass
        s.close()


# --- Unix domain socket --------------------------------------------------------------------


@pytest.fixture
def unix_path():
    """A socket path in a fresh directory under /tmp (socket paths are limited to ~107
    bytes; pytest's tmp_path can be longer), removed afterwards."""
    short = Path("/tmp") / f"wrenmq-test-{uuid.uuid4().hex[:8]}"
    short.mkdir()
    yield short / "mqtt.sock"
    shutil.rmtree(short, ignore_errors=True)


def test_unix_socket_listener(make_broker, pahos, unix_path):
    path = unix_path
    b = make_broker(f'[[listener]]\ntype = "unix"\npath = "{path}"\nmode = "0660"\n')
    assert stat.S_ISSOCK(path.stat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o660
    assert b.broker.addresses[1] == (str(path), None)
    tcp = pahos(b.port, 5)
    subscribe(tcp, "unix/#")
    # A raw client on the socket.
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(path))
        s.sendall(connect_bytes("local-tool"))
        dec = Decoder(C.MQTT311)
        assert read_packets(lambda: s.recv(4096), dec)[0].TYPE == C.CONNACK
        s.sendall(encode(Subscribe(1, [SubscribeTopic("back/#", 0)]), C.MQTT311))
        assert read_packets(lambda: s.recv(4096), dec)[0].TYPE == C.SUBACK
        s.sendall(encode(Publish("unix/hello", b"from the socket"), C.MQTT311))
        msg = tcp.messages.get(timeout=5)
        assert (msg.topic, msg.payload) == ("unix/hello", b"from the socket")
        tcp.publish("back/1", b"to the socket")
        p = read_packets(lambda: s.recv(4096), dec)[0]
        assert (p.topic, p.payload) == ("back/1", b"to the socket")
    # mosquitto's clients speak it too.
    r = mosq("mosquitto_pub", "--unix", path, "-t", "unix/mosq", "-m", "hi", "-q", "1")
    assert r.returncode == 0, r.stderr
    assert tcp.messages.get(timeout=5).topic == "unix/mosq"
    tcp.disconnect()
    tcp.loop_stop()
    b.stop()
    assert not path.exists()  # removed on stop


def test_unix_socket_stale_file_and_in_use(make_broker, unix_path):
    path = unix_path
    # A socket file left behind by a crashed broker is replaced.
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()
    assert path.exists()
    b = make_broker(f'[[listener]]\ntype = "unix"\npath = "{path}"\n')
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # A second broker on the same path refuses to start, naming the key.
    with pytest.raises(OSError, match=r"listener\[1\]\.path: .* is in use"):
        RunningBroker(f'[[listener]]\ntype = "unix"\npath = "{path}"\n')
    with socket.socket(socket.AF_UNIX) as s:  # the first one is unharmed
        s.settimeout(5)
        s.connect(str(path))
        s.sendall(connect_bytes())
        assert read_packets(lambda: s.recv(100), Decoder(C.MQTT311))[0].TYPE == C.CONNACK
    # A path that is not a socket is never removed.
    regular = path.with_name("file")
    regular.write_text("keep me")
    with pytest.raises(OSError, match="exists and is not a socket"):
        RunningBroker(f'[[listener]]\ntype = "unix"\npath = "{regular}"\n')
    assert regular.read_text() == "keep me"
    b.stop()


# --- the metrics listener ------------------------------------------------------------------


def families(text):
    """The text parsed by Prometheus's own client library: name -> value of its one sample."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name.endswith("_created"):
                continue
            out[sample.name] = (fam.type, sample.value, sample.labels)
    return out


def test_metrics_listener_serves_the_sys_figures_to_prometheus(make_broker, pahos, tmp_path):
    b = make_broker(f"""
[[listener]]
type = "metrics"
port = 0
[storage]
data_dir = "{tmp_path}"
fsync = "never"
""")
    metrics_port = b.broker.addresses[1][1]
    status, ctype, text = scrape(metrics_port)
    assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
    before = families(text)
    assert before["wrenmq_clients_connected"] == ("gauge", 0, {})
    assert before["wrenmq_build_info"][2]["version"]

    sub = pahos(b.port, version=5)
    pub = pahos(b.port, version=4)
    subscribe(sub, "m/#")
    for i in range(20):
        pub.publish(f"m/{i}", b"x" * 100, qos=1).wait_for_publish(5)
    for _ in range(20):
        sub.messages.get(timeout=5)
    after = families(scrape(metrics_port)[2])
    assert after["wrenmq_clients_connected"][1] == 2
    mqtt_listener = b.broker.config.listener[0].label
    assert before["wrenmq_listener_connections"] == ("gauge", 0, {"listener": mqtt_listener})
    assert after["wrenmq_listener_connections"] == ("gauge", 2, {"listener": mqtt_listener})
    assert after["wrenmq_connections_total"] == ("counter", 2, {})
    assert after["wrenmq_publish_received_total"][1] == 20
    assert after["wrenmq_publish_sent_total"][1] >= 20
    assert after["wrenmq_subscriptions"][1] == 1
    assert after["wrenmq_received_bytes_total"][1] > before["wrenmq_received_bytes_total"][1] + 2000
    # The commit log's figures, as $SYS has them.
    assert after["wrenmq_log_appended_records_total"][1] >= 20
    assert after["wrenmq_log_end_offset"][1] >= 20
    assert 1 <= after["wrenmq_log_writer_wakes_total"][1] and 1 <= after["wrenmq_log_batches_total"][1] <= 20
    sys_values = b.call(b.broker.sys_topics.snapshot)
    assert after["wrenmq_log_segments"][1] == sys_values["$SYS/broker/log/segments"]
    # Reading them does not move $SYS's load averages (SysTopics.values does).
    assert not any("/load/" in k for k in sys_values)


def test_metrics_listener_path_and_bad_requests(make_broker):
    b = make_broker("""
[[listener]]
type = "metrics"
port = 0
path = "/probe/metrics"
""")
    port = b.broker.addresses[1][1]
    assert scrape(port, "/probe/metrics")[0] == 200
    assert scrape(port, "/probe/metrics?x=1")[0] == 200
    assert scrape(port, "/metrics")[0] == 404
    # HEAD: the GET's headers, no body. Other methods: 405, with what is allowed.
    import http.client

    for method, status in (("HEAD", 200), ("DELETE", 405), ("POST", 405), ("PUT", 405)):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request(method, "/probe/metrics", headers={"Content-Length": "0"})
        r = conn.getresponse()
        body = r.read()
        conn.close()
        assert r.status == status, method
        if method == "HEAD":
            assert int(r.headers["Content-Length"]) > 1000
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        else:
            assert r.headers["Allow"] == "GET, HEAD" and body == b"Method Not Allowed\n"
    # (http.client reads no body after HEAD: on the wire, nothing follows the headers.)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"HEAD /probe/metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"\r\n\r\n")
    # Not HTTP at all: closed at once. An MQTT CONNECT (no request line): closed when the
    # 5 s allowed for a request run out. The broker serves on.
    for junk, within in ((b"\x00\xff" * 100 + b"\r\n\r\n", 2), (connect_bytes(), 9)):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(junk)
            s.settimeout(within)
            reply = s.recv(200)
            assert reply == b"" or reply.startswith(b"HTTP/1.1 400")
    assert scrape(port, "/probe/metrics")[0] == 200
    # MQTT clients are not served on it, and its scrapes are not MQTT connections.
    assert families(scrape(port, "/probe/metrics")[2])["wrenmq_connections_total"][1] == 0


def test_metrics_listener_asks_its_users_for_passwords(make_broker, tmp_path):
    """`users`: HTTP Basic authentication against the broker's password file, which a
    reload (SIGHUP) re-reads; MQTT logins are not affected."""
    import base64

    from wrenmq.auth.passwords import hash_password

    pw = tmp_path / "passwords"
    pw.write_text(f"prom:{hash_password('scrape')}\ndevice:{hash_password('dev')}\n")
    b = make_broker(f"""
[[listener]]
type = "metrics"
port = 0
users = ["prom"]
[auth]
password_file = "{pw}"
failed_login_delay = 0.2
""")
    port = b.broker.addresses[1][1]

    def get(user=None, password=None):
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        headers = {}
        if user is not None:
            headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        started = time.monotonic()
        conn.request("GET", "/metrics", headers=headers)
        r = conn.getresponse()
        body = r.read().decode()
        conn.close()
        return r.status, r.headers.get("WWW-Authenticate"), body, time.monotonic() - started

    status, challenge, _, _ = get()
    assert status == 401 and challenge == 'Basic realm="wrenmq metrics", charset="UTF-8"'
    # The health probe needs no credentials, and says no more than that.
    assert scrape(port, "/health")[:3:2] == (200, '{"status": "ok"}\n')
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("HEAD", "/health")
    head = conn.getresponse()
    assert head.status == 200 and head.read() == b"" and int(head.headers["Content-Length"]) == 17
    conn.close()
    status, _, body, _ = get("prom", "scrape")
    assert status == 200 and "wrenmq_clients_connected" in families(body)
    assert get("prom", "scrape")[0] == 200  # (remembered: not hashed again)
    for user, password in (("prom", "wrong"), ("device", "dev"), ("nobody", "scrape")):
        status, _, body, took = get(user, password)
        assert status == 401 and "wrenmq" not in body and took >= 0.15, (user, password)
    assert get("prom", "scrape")[0] == 200
    # The password file changes and is reloaded: the remembered password goes with it.
    pw.write_text(f"prom:{hash_password('new')}\n")
    b.call(b.broker.hooks.reload)
    assert get("prom", "scrape")[0] == 401
    assert get("prom", "new")[0] == 200


def test_metrics_listener_bounds_its_open_connections(make_broker):
    """A flood of idle connections to the metrics port holds at most METRICS_MAX_OPEN of
    them (each until the 5 s request timeout); the next are closed at once."""
    from wrenmq.broker.listeners.metrics import METRICS_MAX_OPEN

    b = make_broker('[[listener]]\ntype = "metrics"\nport = 0\n')
    port = b.broker.addresses[1][1]
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(METRICS_MAX_OPEN)]
    deadline = time.monotonic() + 5
    while b.call(lambda: b.broker._servers[1].open_requests) < METRICS_MAX_OPEN and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _closed_at_once(port)
    for s in idle:
        s.close()
    deadline = time.monotonic() + 5
    while b.call(lambda: b.broker._servers[1].open_requests) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert b.call(lambda: b.broker._servers[1].open_requests) == 0
    assert scrape(port)[0] == 200


def test_failed_tls_handshakes_leave_no_count_behind(make_broker, pki):
    """wss and metrics-over-HTTPS connections whose TLS handshake fails are uncounted (they
    never reach the WebSocket side), so they cannot use up max_connections or the metrics
    listener's bound."""
    from wrenmq.broker.listeners.metrics import METRICS_MAX_OPEN

    wss = free_port()
    b = make_broker(ws_listener(wss, pki) + tls_listener(pki, 0, type="metrics")
                    + "[limits]\nmax_connections = 5\n")
    metrics = b.broker.addresses[2][1]
    for port, n in ((wss, 8), (metrics, METRICS_MAX_OPEN + 8)):
        for _ in range(n):  # plain HTTP to a TLS port: no ClientHello, closed
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                s.settimeout(5)
                try:
                    assert s.recv(100) == b""
                except ConnectionResetError:
                    pass
    deadline = time.monotonic() + 5
    while b.call(lambda: (b.broker.handshakes, b.broker._servers[2].open_requests)) != (0, 0) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert b.call(lambda: (b.broker.handshakes, b.broker._servers[2].open_requests)) == (0, 0)
    assert scrape(metrics, context=pki.client_context())[0] == 200


def test_metrics_over_https_with_client_certificates(make_broker, pki):
    b = make_broker(tls_listener(pki, 0, type="metrics", cafile=pki.ca_file, require_certificate=True))
    port = b.broker.addresses[1][1]
    ctx = pki.client_context()
    ctx.load_cert_chain(pki.client_cert, pki.client_key)
    status, _, text = scrape(port, context=ctx)
    assert status == 200 and "wrenmq_clients_connected 0" in text
    with pytest.raises(OSError):  # no client certificate: the handshake is refused
        scrape(port, context=pki.client_context())
