"""PROXY protocol v1/v2 (net/proxy.py, net/proxied.py, [[listener]] proxy_protocol).

The parser is fed bytes; the listener is tested through real sockets: raw clients that
write the header themselves (v1, v2, split, malformed, none), a real HAProxy in front of
the broker (send-proxy and send-proxy-v2) with paho clients bound to other loopback
addresses, TLS behind the header, and MQTT over WebSocket behind it.
"""

import logging
import shutil
import socket
import ssl
import subprocess
import time

import pytest
import trustme

from conftest import free_port, paho_client, wait_port
from wrenmq.broker.hooks import Hook
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.codec import Decoder, encode
from wrenmq.mqtt.packets import Connect
from wrenmq.net.proxy import ProxyError, ProxyHeaderReader, encode_v1, encode_v2


# --- the parser ----------------------------------------------------------------------


def parse(data):
    return ProxyHeaderReader().feed(data)


def test_v1_tcp4_tcp6_and_unknown():
    h, rest = parse(b"PROXY TCP4 203.0.113.7 192.0.2.1 40000 1883\r\n\x10rest")
    assert (h.version, h.source, h.destination, rest) == (1, ("203.0.113.7", 40000), ("192.0.2.1", 1883), b"\x10rest")
    h, rest = parse(b"PROXY TCP6 2001:db8::7 2001:db8::1 65535 8883\r\n")
    assert h.source == ("2001:db8::7", 65535) and rest == b""
    h, rest = parse(b"PROXY UNKNOWN ffff:f...f:ffff 1 2\r\nX")
    assert h.source is None and rest == b"X"


def test_v2_ipv4_ipv6_local_and_tlvs():
    tlv = b"\x04\x00\x03abc"  # PP2_TYPE_NOOP with 3 bytes: skipped
    h, rest = parse(encode_v2(("198.51.100.9", 5555), ("10.0.0.1", 1883), tlv) + b"\x10")
    assert (h.version, h.source, rest) == (2, ("198.51.100.9", 5555), b"\x10")
    h, _ = parse(encode_v2(("2001:db8::9", 1), ("2001:db8::1", 2)))
    assert h.source == ("2001:db8::9", 1)
    h, rest = parse(encode_v2() + b"M")
    assert h.source is None and rest == b"M"  # LOCAL: the proxy's own health check


@pytest.mark.parametrize("header", [
    b"PROXY TCP4 203.0.113.7 192.0.2.1 40000 1883\r\n",
    encode_v2(("198.51.100.9", 5555), ("10.0.0.1", 1883)),
])
def test_a_header_fed_one_byte_at_a_time(header):
    r = ProxyHeaderReader()
    for b in header[:-1]:
        assert r.feed(bytes([b])) is None
    h, rest = r.feed(header[-1:] + b"after")
    assert h.source is not None and rest == b"after"


@pytest.mark.parametrize("data, says", [
    (b"\x10\x0c\x00\x04MQTT", "no PROXY protocol header"),
    (b"GET / HTTP/1.1\r\n", "no PROXY protocol header"),
    (b"PROXY TCP4 203.0.113.7 192.0.2.1 40000\r\n", "malformed v1"),
    (b"PROXY TCP4 2001:db8::1 192.0.2.1 1 2\r\n", "not TCP4"),
    (b"PROXY TCP4 203.0.113.777 192.0.2.1 1 2\r\n", "invalid address"),
    (b"PROXY TCP4 203.0.113.7 192.0.2.1 65536 2\r\n", "invalid port"),
    (b"PROXY TCP4 203.0.113.7 192.0.2.1 01 2\r\n", "invalid port"),
    (b"PROXY " + b"1" * 200, "without CRLF"),
    (b"\r\n\r\n\x00\r\nQUIT\n\x31\x11\x00\x0c" + bytes(12), "version 3"),
    (b"\r\n\r\n\x00\r\nQUIT\n\x23\x11\x00\x0c" + bytes(12), "unknown command"),
    (b"\r\n\r\n\x00\r\nQUIT\n\x21\x51\x00\x0c" + bytes(12), "unknown address family"),
    (b"\r\n\r\n\x00\r\nQUIT\n\x21\x21\x00\x0c" + bytes(12), "36 needed"),
])
def test_malformed_headers_are_refused(data, says):
    with pytest.raises(ProxyError, match=says):
        parse(data)


# --- the listener --------------------------------------------------------------------


class Addresses(Hook):
    """Records the address every CONNECT came from, as hooks (and the ACL) see it."""

    def __init__(self):
        self.seen = {}

    def authenticate(self, client, connect):
        self.seen[client.client_id] = client.address
        return None


def connect_bytes(client_id):
    return encode(Connect(client_id=client_id, version=C.MQTT311), C.MQTT311)


def read_connack(sock, timeout=5.0):
    sock.settimeout(timeout)
    dec = Decoder(C.MQTT311)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        data = sock.recv(4096)
        if not data:
            return None
        pkts = dec.feed(data)
        if pkts:
            return pkts[0]
    return None


def closed(sock, timeout=5.0):
    sock.settimeout(timeout)
    try:
        while True:
            if not sock.recv(4096):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.fixture
def proxied(make_broker):
    hook = Addresses()
    b = make_broker("proxy_protocol = true\n[limits]\nconnect_timeout = 2\n", hooks=[hook])
    b.seen = hook.seen
    return b


def test_v1_and_v2_headers_give_the_clients_address(proxied, caplog):
    caplog.set_level(logging.INFO, logger="wrenmq")
    for i, header in enumerate([encode_v1(("203.0.113.7", 40001), ("127.0.0.1", proxied.port)),
                                encode_v2(("2001:db8::7", 40002), ("::1", proxied.port), b"\x04\x00\x01x")]):
        with socket.create_connection(("127.0.0.1", proxied.port)) as s:
            s.sendall(header + connect_bytes(f"p{i}"))  # header and CONNECT in one segment
            assert read_connack(s).reason_code == 0
    assert proxied.seen == {"p0": "203.0.113.7:40001", "p1": "2001:db8::7:40002"}
    assert "client p0 connected from 203.0.113.7:40001" in caplog.text


def test_a_header_split_over_segments(proxied):
    header = encode_v2(("198.51.100.3", 7), ("127.0.0.1", proxied.port))
    with socket.create_connection(("127.0.0.1", proxied.port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for part in (header[:5], header[5:14], header[14:]):
            s.sendall(part)
            time.sleep(0.05)
        s.sendall(connect_bytes("split"))
        assert read_connack(s).reason_code == 0
    assert proxied.seen["split"] == "198.51.100.3:7"


def test_local_command_keeps_the_proxys_address(proxied):
    with socket.create_connection(("127.0.0.1", proxied.port)) as s:
        s.sendall(encode_v2() + connect_bytes("health"))
        assert read_connack(s).reason_code == 0
        local = s.getsockname()
    assert proxied.seen["health"] == f"{local[0]}:{local[1]}"


@pytest.mark.parametrize("first, why", [
    (connect_bytes("sneaky"), "no PROXY protocol header"),
    (b"PROXY TCP4 1.2.3.4 5.6.7.8 1 99999\r\n", "invalid port"),
    (b"", "no PROXY protocol header within 2 s"),
])
def test_no_header_or_a_malformed_one_is_refused(proxied, caplog, first, why):
    caplog.set_level(logging.INFO, logger="wrenmq")
    before = proxied.call(lambda: proxied.broker.router.stats.refused_connections)
    with socket.create_connection(("127.0.0.1", proxied.port)) as s:
        if first:
            s.sendall(first)
        assert closed(s, timeout=6)
    assert "sneaky" not in proxied.seen
    assert proxied.call(lambda: proxied.broker.router.stats.refused_connections) == before + 1
    assert why in caplog.text
    # What waited for its header is not counted any more.
    assert proxied.call(lambda: proxied.broker.handshakes) == 0


def test_connection_rate_refusals_name_the_real_address(make_broker, caplog):
    caplog.set_level(logging.INFO, logger="wrenmq")
    b = make_broker("proxy_protocol = true\n[limits]\nconnection_rate = 1\n")
    refused = 0
    for i in range(4):
        with socket.create_connection(("127.0.0.1", b.port)) as s:
            s.sendall(encode_v1(("192.0.2.55", 41000 + i), ("127.0.0.1", b.port)) + connect_bytes(f"r{i}"))
            if read_connack(s) is None:
                refused += 1
    assert refused >= 2
    assert "connection_rate exceeded" in caplog.text and "latest from 192.0.2.55:4100" in caplog.text


def test_tls_behind_the_header(make_broker, tmp_path):
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    hook = Addresses()
    b = make_broker(f'proxy_protocol = true\ntls = true\ncertfile = "{tmp_path / "server.pem"}"\n',
                    hooks=[hook])
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    with socket.create_connection(("127.0.0.1", b.port)) as raw:
        raw.sendall(encode_v1(("203.0.113.200", 50000), ("127.0.0.1", b.port)))
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            s.sendall(connect_bytes("tls-client"))
            assert read_connack(s).reason_code == 0
    assert hook.seen["tls-client"] == "203.0.113.200:50000"


def test_websocket_behind_the_header(make_broker):
    from websockets.sync.client import connect
    hook = Addresses()
    b = make_broker(f'proxy_protocol = true\ntype = "ws"\n', hooks=[hook])
    raw = socket.create_connection(("127.0.0.1", b.port))
    raw.sendall(encode_v2(("198.51.100.77", 61000), ("127.0.0.1", b.port)))
    with connect(f"ws://127.0.0.1:{b.port}/mqtt", sock=raw, subprotocols=["mqtt"]) as ws:
        ws.send(connect_bytes("ws-client"))
        connack = Decoder(C.MQTT311).feed(ws.recv(timeout=5))[0]
        assert connack.reason_code == 0
    assert hook.seen["ws-client"] == "198.51.100.77:61000"


# --- through a real HAProxy ----------------------------------------------------------


@pytest.fixture
def haproxy(tmp_path):
    exe = shutil.which("haproxy")
    if exe is None:
        pytest.skip("haproxy not installed (make test-deps installs it)")
    procs = []

    def start(backend_port, send):
        port = free_port()
        cfg = tmp_path / f"haproxy-{port}.cfg"
        cfg.write_text(f"""
defaults
    mode tcp
    timeout connect 5s
    timeout client 30s
    timeout server 30s
frontend mqtt
    bind 127.0.0.1:{port}
    default_backend wrenmq
backend wrenmq
    server broker 127.0.0.1:{backend_port} {send}
""")
        p = subprocess.Popen([exe, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
        procs.append(p)
        wait_port(port, proc=p, what="haproxy")
        return port

    yield start
    for p in procs:
        p.terminate()
        p.wait(10)


@pytest.mark.parametrize("send", ["send-proxy", "send-proxy-v2"])
def test_clients_through_haproxy_are_seen_by_their_own_address(make_broker, haproxy, send):
    hook = Addresses()
    b = make_broker("proxy_protocol = true\n", hooks=[hook])
    front = haproxy(b.port, send)
    # Each client connects from its own loopback address; HAProxy connects to the broker
    # from 127.0.0.1, so only the header can tell the broker who the client is.
    pub = paho_client(front, client_id="through-haproxy", connect=False)
    pub.connect("127.0.0.1", front, bind_address="127.0.0.42")
    pub.loop_start()
    try:
        assert pub.connected_event.wait(10)
        assert pub.connack[0] == 0
    finally:
        pub.disconnect()
        pub.loop_stop()
    assert hook.seen["through-haproxy"].startswith("127.0.0.42:")


def test_address_bans_see_the_clients_address(proxied):
    proxied.call(lambda: proxied.broker.bans.add("address", "203.0.113.0/24", reason="test"))
    for source, expected in ((("203.0.113.9", 50001), C.BANNED), (("198.51.100.1", 50002), 0)):
        with socket.create_connection(("127.0.0.1", proxied.port)) as s:
            s.sendall(encode_v1(source, ("127.0.0.1", proxied.port)) +
                      encode(Connect(client_id=f"b{source[1]}", version=C.MQTT5), C.MQTT5))
            sock_dec = Decoder(C.MQTT5)
            s.settimeout(5)
            connack = sock_dec.feed(s.recv(4096))[0]
            assert connack.reason_code == expected, source
