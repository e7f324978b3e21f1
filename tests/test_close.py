"""How a connection ends: the client can read the broker's last packet.

After a DISCONNECT with its reason (0x93 Receive Maximum exceeded, here) or a refusing
CONNACK, the broker half-closes and reads and drops what the client still sends until
the client closes its side: a socket closed with unread input, or one that input reaches
after its close, answers with a reset, and a client still sending (PUBRELs, PINGREQs)
then gets ECONNRESET instead of the reason. The clients here are raw: they send without
reading, as a busy client does, then read to the end. Over TCP, a Unix socket, TLS and
WebSocket. A client that goes on sending is cut off at the linger's bounds
(Connection._shut: 2 s, and max_packet_size + 64 KiB of input).
"""

import logging
import shutil
import socket
import ssl
import time
import uuid
from pathlib import Path

import pytest
import trustme

from conftest import free_port
from mqtt_helpers import wait_for
from wrenmq.auth.passwords import hash_password
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.codec import Decoder, encode
from wrenmq.mqtt.packets import PINGREQ, Connack, Connect, Disconnect, Publish, Pubrec, Pubrel

V311 = C.MQTT311
V5 = C.MQTT5


# --- clients that send without reading ---------------------------------------------


class SocketLink:
    """A client over a socket (TCP, Unix, TLS): bytes both ways."""

    def __init__(self, sock):
        self.sock = sock

    def send(self, data):
        self.sock.sendall(data)

    def read_to_end(self, timeout=10.0):
        """What the broker sends until it closes: (bytes, None) after a clean end of the
        stream, (bytes, the error) after a reset."""
        out = bytearray()
        self.sock.settimeout(timeout)
        while True:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                raise AssertionError(f"the broker did not close the connection (got {bytes(out)!r})") from None
            except OSError as e:
                return bytes(out), e
            if not data:
                return bytes(out), None
            out += data

    def close(self):
        self.sock.close()


class WsLink:
    """A WebSocket client made of websockets' sans-IO protocol over a socket: it reads
    nothing until read_to_end, so it goes on sending after the broker's close frame."""

    def __init__(self, port):
        from websockets.client import ClientProtocol
        from websockets.protocol import State
        from websockets.uri import parse_uri

        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.ws = ClientProtocol(parse_uri(f"ws://127.0.0.1:{port}/mqtt"), subprotocols=["mqtt"])
        self.ws.send_request(self.ws.connect())
        self._flush()
        while self.ws.state is State.CONNECTING:
            data = self.sock.recv(65536)
            assert data, "closed during the WebSocket handshake"
            self.ws.receive_data(data)
        assert self.ws.state is State.OPEN, self.ws.handshake_exc
        self.ws.events_received()  # the handshake response

    def _flush(self):
        for data in self.ws.data_to_send():
            if data:
                self.sock.sendall(data)

    def send(self, data):
        self.ws.send_binary(data)
        self._flush()

    def read_to_end(self, timeout=10.0):
        """What the broker sends in binary frames until the connection ends: (bytes, None)
        after a close frame and the end of the TCP stream, (bytes, the error) otherwise."""
        from websockets.frames import Opcode

        out = bytearray()
        close_frame = None
        self.sock.settimeout(timeout)
        while True:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                raise AssertionError(f"the broker did not close the connection (got {bytes(out)!r})") from None
            except OSError as e:
                return bytes(out), e
            if data:
                self.ws.receive_data(data)
            else:
                self.ws.receive_eof()
            for event in self.ws.events_received():
                if event.opcode in (Opcode.BINARY, Opcode.CONT):
                    out += event.data
                elif event.opcode is Opcode.CLOSE:
                    close_frame = event
            try:
                self._flush()  # the answer to the close frame
            except OSError:
                pass
            if not data:
                return bytes(out), None if close_frame is not None else ConnectionError("no close frame")

    def close(self):
        self.sock.close()


def keep_sending(link, data, seconds, interval=0.02):
    """Send `data` every `interval` for `seconds` without reading: None, or the error that
    stopped it."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            link.send(data)
        except OSError as e:
            return e
        time.sleep(interval)
    return None


def kinds(packets):
    return [type(p).__name__ for p in packets]


# --- a broker with a listener of each kind -------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    (d / "server.crt").write_bytes(b"".join(b.bytes() for b in server.cert_chain_pems))
    (d / "server.key").write_bytes(server.private_key_pem.bytes())
    client = ssl.create_default_context()
    ca.configure_trust(client)
    return d, client


@pytest.fixture
def served(make_broker, certs):
    """served(kind, config) -> (broker, a link to it over `kind`: tcp, unix, tls or ws)."""
    links = []
    dirs = []

    def start(kind, config=""):
        if kind == "tcp":
            b = make_broker(config)
            link = SocketLink(socket.create_connection(("127.0.0.1", b.port), timeout=5))
        elif kind == "unix":
            d = Path("/tmp") / f"wrenmq-close-{uuid.uuid4().hex[:8]}"  # socket paths are short
            d.mkdir()
            dirs.append(d)
            b = make_broker(f'[[listener]]\ntype = "unix"\npath = "{d / "s"}"\n' + config)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5)
            sock.connect(str(d / "s"))
            link = SocketLink(sock)
        elif kind == "tls":
            d, client = certs
            port = free_port()
            b = make_broker(f'[[listener]]\nport = {port}\ntls = true\ncertfile = "{d / "server.crt"}"\n'
                            f'keyfile = "{d / "server.key"}"\n' + config)
            raw = socket.create_connection(("127.0.0.1", port), timeout=5)
            link = SocketLink(client.wrap_socket(raw, server_hostname="127.0.0.1"))
        else:
            port = free_port()
            b = make_broker(f'[[listener]]\ntype = "ws"\nport = {port}\n' + config)
            link = WsLink(port)
        links.append(link)
        return b, link

    yield start
    for link in links:
        link.close()
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def over_receive_maximum(link, n):
    """CONNECT (5.0) and n + 1 QoS 2 PUBLISHes, their PUBRELs held back: one too many."""
    link.send(encode(Connect("eager", V5), V5) + b"".join(
        encode(Publish("q2/t", b"x", qos=2, packet_id=pid), V5) for pid in range(1, n + 2)))


# --- the last packet is read ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tcp", "unix", "tls", "ws"])
def test_disconnect_reason_read_while_the_client_keeps_sending(served, kind):
    """DISCONNECT 0x93 to a client over its receive maximum that goes on sending PUBRELs:
    its sends go through, it reads the reason, then a clean end of the stream."""
    b, link = served(kind, "[limits]\nreceive_maximum = 2\n")
    over_receive_maximum(link, 2)
    error = keep_sending(link, encode(Pubrel(1), V5) + encode(Pubrel(2), V5), 0.6)
    assert error is None, f"sending after the broker's DISCONNECT failed: {error!r}"
    data, error = link.read_to_end()
    packets = Decoder(V5).feed(data)
    assert error is None, f"{error!r} after {kinds(packets)}"
    assert packets[1:] == [Pubrec(1), Pubrec(2), Disconnect(C.RECEIVE_MAXIMUM_EXCEEDED)], kinds(packets)
    assert isinstance(packets[0], Connack) and packets[0].reason_code == 0


@pytest.fixture
def password_file(tmp_path):
    path = tmp_path / "passwd"
    path.write_text(f"alice:{hash_password('alice-pw')}\n")
    return path


@pytest.mark.parametrize("kind,version", [("tcp", V5), ("tcp", V311), ("unix", V311), ("tls", V5),
                                          ("ws", V311)])
def test_refusing_connack_read_while_the_client_keeps_sending(served, password_file, kind, version):
    """A wrong password, and PINGREQs pipelined behind the CONNECT while the refusal waits
    out failed_login_delay and after it: the client reads the CONNACK's code."""
    b, link = served(kind, f'[auth]\npassword_file = "{password_file}"\nfailed_login_delay = 0.3\n')
    link.send(encode(Connect("guess", version, username="alice", password=b"wrong"), version))
    error = keep_sending(link, encode(PINGREQ, version), 0.8)
    assert error is None, f"sending after the broker's CONNACK failed: {error!r}"
    data, error = link.read_to_end()
    packets = Decoder(version).feed(data)
    assert error is None, f"{error!r} after {kinds(packets)}"
    assert len(packets) == 1 and isinstance(packets[0], Connack), kinds(packets)
    assert packets[0].reason_code == (C.BAD_USER_NAME_OR_PASSWORD if version == V5 else 4)


# --- and a client that does not stop is cut off -----------------------------------------


@pytest.mark.parametrize("kind", ["tcp", "tls", "ws"])
def test_a_client_that_keeps_sending_is_cut_off_after_the_linger(served, kind):
    """A client that never reads nor closes, sending a little forever after the DISCONNECT:
    the broker drops its input for the linger's 2 s (its sends go through meanwhile), then
    aborts it and holds nothing for it."""
    b, link = served(kind, "[limits]\nreceive_maximum = 1\n")
    t0 = time.monotonic()
    over_receive_maximum(link, 1)
    error = keep_sending(link, encode(PINGREQ, V5), 15, interval=0.05)
    took = time.monotonic() - t0
    assert error is not None, "the broker held the connection open for 15 s"
    assert took >= 1.5, f"cut off after {took:.2f}s, before the client could read the reason ({error!r})"
    assert took < 10, f"cut off only after {took:.2f}s"
    assert wait_for(lambda: b.call(lambda: len(b.broker.connections)) == 0)


@pytest.mark.parametrize("kind", ["tcp", "unix", "ws"])
def test_a_client_that_floods_after_the_close_is_cut_off_at_the_byte_bound(served, caplog, kind):
    """Past max_packet_size + 64 KiB of input after the DISCONNECT the broker aborts the
    connection at once (over TLS the TLS layer drops that input: the time bound applies)."""
    caplog.set_level(logging.INFO, "wrenmq.connection")
    b, link = served(kind, "[limits]\nreceive_maximum = 1\nmax_packet_size = 4096\n")
    over_receive_maximum(link, 1)
    chunk = encode(PINGREQ, V5) * 8192  # 16 KiB
    error = None
    for _ in range(1024):
        try:
            link.send(chunk)
        except OSError as e:
            error = e
            break
    assert error is not None, "16 MiB sent after the DISCONNECT, and still open"
    assert wait_for(lambda: "bytes after its connection was closed" in caplog.text)
    assert wait_for(lambda: b.call(lambda: len(b.broker.connections)) == 0)


def test_a_stop_that_drops_what_it_held_sends_nothing_it_produces_while_stopping(make_broker, raw_client, tmp_path):
    """A replicated partition's leader that lost its leadership stops its broker with
    discard_held: what it held was never committed, and neither is what it produces while
    it stops, with its clients' connections still open and read (their acknowledgements,
    the QoS 2 releases a subscriber's PUBREC asks for): none of that may go out (a PUBREL
    sent so, for a release no other node knows of, had the subscriber take the message's
    redelivery there as a new one). The closing DISCONNECT goes."""
    import asyncio
    import threading

    from mqtt_helpers import raw_connect
    from wrenmq.broker.hooks import Extension

    class SlowToStop(Extension):  # (the cluster's stop, that leaves etcd, takes a while too)
        def __init__(self):
            self.stopping = threading.Event()

        async def stop(self):
            self.stopping.set()
            await asyncio.sleep(1.5)

    b = make_broker(f"[storage]\ndata_dir = \"{tmp_path / 'data'}\"\n")
    ext = SlowToStop()
    b.call(b.broker.add_extension, ext)
    c, ack = raw_connect(raw_client, b.port, C.MQTT5)
    assert ack.reason_code == 0
    stopped = asyncio.run_coroutine_threadsafe(b.broker.stop(C.USE_ANOTHER_SERVER, discard_held=True), b.loop)
    assert ext.stopping.wait(5)
    c.send(Publish("t", b"during the stop", qos=2, packet_id=7))
    c.send(Publish("t", b"during the stop", qos=1, packet_id=8))
    got = []
    while True:
        pkt = c.recv(5)
        if pkt is None:
            break
        got.append(pkt)
    stopped.result(10)
    assert [(p.TYPE, p.reason_code) for p in got] == [(C.DISCONNECT, C.USE_ANOTHER_SERVER)], got
