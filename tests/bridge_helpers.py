"""Real remotes for the bridge tests: Debian's Mosquitto on a port of its own, and a
pipelined QoS 1 publisher that says which messages the broker acknowledged."""

import os
import queue
import shutil
import socket
import subprocess
import time

from conftest import free_port, wait_port
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.codec import Decoder, encode, encode_publish
from wrenmq.mqtt.packets import Connect

MOSQUITTO = shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin:/sbin")


class Mosquitto:
    """A Mosquitto broker with persistence on, its config written here; `stop` is a
    clean stop (it saves its database), `start` brings it back on the same port."""

    def __init__(self, tmp, extra="", port=None, listener_extra=""):
        assert MOSQUITTO, "mosquitto is not installed (make test-deps installs Debian's)"
        self.port = port or free_port()
        self.dir = tmp / f"mosquitto-{self.port}"
        self.dir.mkdir(exist_ok=True)
        self.conf = self.dir / "mosquitto.conf"
        self.conf.write_text(
            f"listener {self.port} 127.0.0.1\n{listener_extra}"
            "allow_anonymous true\n"
            f"persistence true\npersistence_location {self.dir}/\n"
            "max_queued_messages 1000000\n"
            # As root Mosquitto would switch to the mosquitto user, who may not read pytest's
            # private tmp dir.
            + ("user root\n" if os.geteuid() == 0 else "") + extra)
        self.log = open(self.dir / "mosquitto.log", "ab")
        self.proc = None
        self.start()

    def start(self):
        self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.conf), "-v"], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        wait_port(self.port, proc=self.proc, what="mosquitto")

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def close(self):
        self.stop()
        self.log.close()

    @property
    def log_text(self):
        return (self.dir / "mosquitto.log").read_text(errors="replace")


def publish_acked(port, topic, payloads, client_id="pub", window=50, version=C.MQTT311, timeout=30.0):
    """Publish `payloads` at QoS 1 over one connection, `window` unacknowledged at a time;
    the payloads the broker acknowledged, in order (it stops where the connection drops)."""
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    except OSError:
        return []
    dec = Decoder(version)
    acked, pending = [], {}
    try:
        sock.sendall(encode(Connect(client_id, version, True, 60), version))
        packets = []
        while not packets:
            data = sock.recv(65536)
            if not data:
                return acked
            packets = dec.feed(data)
        assert packets[0].TYPE == C.CONNACK and packets[0].reason_code == 0, packets[0]
        i = 0
        deadline = time.monotonic() + timeout
        while (i < len(payloads) or pending) and time.monotonic() < deadline:
            out = []
            while i < len(payloads) and len(pending) < window:
                pid = i % 65535 + 1
                pending[pid] = payloads[i]
                out.append(encode_publish(topic, payloads[i], 1, False, False, pid,
                                          b"\x00" if version == C.MQTT5 else b""))
                i += 1
            if out:
                sock.sendall(b"".join(out))
            data = sock.recv(65536)
            if not data:
                break
            for pkt in dec.feed(data):
                if pkt.TYPE == C.PUBACK and pkt.packet_id in pending:
                    acked.append(pending.pop(pkt.packet_id))
    except OSError:
        pass
    finally:
        sock.close()
    return acked


def collect(client, until, timeout=30.0):
    """Messages a paho client receives until `until(list of them)` is true or the timeout."""
    got = []
    deadline = time.monotonic() + timeout
    while not until(got) and time.monotonic() < deadline:
        try:
            got.append(client.messages.get(timeout=0.1))
        except queue.Empty:
            pass
    return got


def first_seen_in_order(payloads):
    """The payloads (ints as bytes) as first seen: duplicates from resends dropped."""
    seen, order = set(), []
    for p in payloads:
        if p not in seen:
            seen.add(p)
            order.append(p)
    return order
