"""Shared fixtures: real brokers on ephemeral ports, real clients.

- `broker` / `make_broker(...)`: a wrenmq Broker running in-process on its own
  event loop thread (uvloop), listening on 127.0.0.1:<ephemeral>.
- `serve_broker(...)`: `wrenmq serve` as a subprocess (the CLI users run).
- `RawClient`: a plain socket speaking bytes, for malformed-packet tests.
- `paho_client(...)`: a connected paho-mqtt client with a message queue.
"""

import asyncio
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from wrenmq import Broker
from wrenmq.config import load
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.codec import Decoder, encode
from wrenmq.ports import free_port, wait_port  # noqa: F401 (the tests import them from here)

ROOT = Path(__file__).resolve().parent.parent
WRENMQ = str(Path(sys.executable).with_name("wrenmq"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under `make test` (WRENMQ_TEST_NO_SKIP=1), which installs every tool the suite uses
    (mosquitto clients, MQTT.js, Java and PySpark), a skip means an install went wrong and
    a feature went untested: it is reported as a failure, with the skip's reason."""
    outcome = yield
    _no_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same for a whole module skipped while collected (`pytest.importorskip`)."""
    outcome = yield
    _no_skip(outcome.get_result())


def _no_skip(report):
    if report.skipped and os.environ.get("WRENMQ_TEST_NO_SKIP") == "1" and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under make test, where nothing may be: {reason}"


class RunningBroker:
    """A Broker on a background thread; call `call(fn)` to run fn on its loop."""

    def __init__(self, config_text="", hooks=()):
        text = "[[listener]]\nbind = \"127.0.0.1\"\nport = 0\n" + config_text
        if "[storage]" not in config_text:
            text += "\n[storage]\nmode = \"memory\"\n"
        self.config = load(text=text)
        self.hooks = hooks
        self.loop = None
        self.broker = None
        self._ready = threading.Event()
        self._error = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("broker did not start")
        if self._error:
            raise self._error
        self.port = self.broker.port

    def _run(self):
        try:
            import uvloop
            loop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        self.loop = loop
        asyncio.set_event_loop(loop)

        async def main():
            self.broker = Broker(self.config, self.hooks)
            try:
                await self.broker.start()
            except Exception as e:  # pragma: no cover - reported to the test
                self._error = e
                self._ready.set()
                return
            self._ready.set()
            await self.broker.serve_forever()

        loop.run_until_complete(main())
        loop.close()

    def call(self, fn, *args, timeout=10):
        """Run fn(*args) on the broker's loop and return its result."""
        fut = asyncio.run_coroutine_threadsafe(self._acall(fn, *args), self.loop)
        return fut.result(timeout)

    @staticmethod
    async def _acall(fn, *args):
        r = fn(*args)
        if asyncio.iscoroutine(r):
            r = await r
        return r

    def stop(self):
        if self.loop is not None and self.loop.is_running():
            try:
                self.call(self.broker.stop)
            except Exception:
                pass
        self._thread.join(10)


@pytest.fixture
def make_broker():
    started = []

    def factory(config_text="", hooks=()):
        b = RunningBroker(config_text, hooks)
        started.append(b)
        return b

    yield factory
    for b in started:
        b.stop()


@pytest.fixture
def broker(make_broker):
    return make_broker()


class ServedBroker:
    """`wrenmq serve` in a subprocess; output collected in `.log_path`."""

    def __init__(self, tmp_path, config_text="", args=()):
        self.port = free_port()
        self.tmp_path = tmp_path
        cfg = tmp_path / f"wrenmq-{self.port}.toml"
        cfg.write_text(config_text)
        self.log_path = tmp_path / f"wrenmq-{self.port}.log"
        self.cmd = [WRENMQ, "serve", "--config", str(cfg), "--port", str(self.port), *args]
        self.proc = None
        self.start()

    def start(self):
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=self.tmp_path)
        wait_port(self.port, proc=self.proc)

    def stop(self, sig=None, timeout=10):
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        if sig is None:
            self.proc.terminate()
        else:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def kill(self):
        self.proc.kill()
        self.proc.wait(10)
        self._log.close()

    @property
    def log(self):
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def serve_broker(tmp_path):
    started = []

    def factory(config_text="", args=()):
        b = ServedBroker(tmp_path, config_text, args)
        started.append(b)
        return b

    yield factory
    for b in started:
        if b.proc is not None and b.proc.poll() is None:
            b.proc.kill()
            b.proc.wait(10)


@pytest.fixture
def mosquitto(tmp_path):
    """Factory of Mosquitto brokers for the bridge tests (bridge_helpers.Mosquitto: its own
    port, persistence on), stopped at the end."""
    from bridge_helpers import Mosquitto
    made = []

    def factory(**kw):
        m = Mosquitto(tmp_path, **kw)
        made.append(m)
        return m

    yield factory
    for m in made:
        m.close()


class RawClient:
    """Bytes over a socket: send anything, read back decoded packets."""

    def __init__(self, port, version=C.MQTT311, timeout=5.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.decoder = Decoder(version)
        self.version = version
        self.pending = []

    def send(self, data):
        if not isinstance(data, (bytes, bytearray)):
            data = encode(data, self.version)
        self.sock.sendall(data)

    def recv(self, timeout=5.0):
        """Next packet, or None if the broker closed the connection."""
        deadline = time.monotonic() + timeout
        while not self.pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no packet from broker")
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                return None
            if not data:
                return None
            self.pending.extend(self.decoder.feed(data))
        return self.pending.pop(0)

    def closed(self, timeout=5.0):
        """True once the broker closes the socket (packets before that are dropped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.recv(deadline - time.monotonic()) is None:
                    return True
            except TimeoutError:
                return False
        return False

    def close(self):
        self.sock.close()


@pytest.fixture
def raw_client():
    made = []

    def factory(port, version=C.MQTT311, timeout=5.0):
        c = RawClient(port, version, timeout)
        made.append(c)
        return c

    yield factory
    for c in made:
        c.close()


def paho_client(port, client_id=None, version=5, clean=True, keepalive=60, properties=None,
                will=None, username=None, password=None, connect=True, userdata=None):
    """A paho-mqtt client, connected (CONNACK awaited) unless connect=False.

    Received messages land in `client.messages` (a queue.Queue of MQTTMessage);
    `client.connack` holds (reason_code, flags, properties) of the last CONNACK.
    """
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    proto = {5: mqtt.MQTTv5, 4: mqtt.MQTTv311, 3: mqtt.MQTTv31}[version]
    cid = client_id if client_id is not None else f"t-{uuid.uuid4().hex[:10]}"
    kwargs = {"protocol": proto}
    if version != 5:
        kwargs["clean_session"] = clean
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cid, **kwargs)
    c.messages = queue.Queue()
    c.connack = None
    c.connected_event = threading.Event()
    c.disconnected_event = threading.Event()
    c.disconnect_reason = None
    c.acks = queue.Queue()

    def on_connect(client, ud, flags, rc, props):
        client.connack = (rc, flags, props)
        client.connected_event.set()

    def on_message(client, ud, msg):
        client.messages.put(msg)

    def on_disconnect(client, ud, flags, rc, props):
        client.disconnect_reason = rc
        client.disconnected_event.set()

    def on_subscribe(client, ud, mid, rcs, props):
        client.acks.put(("suback", mid, rcs, props))

    def on_unsubscribe(client, ud, mid, rcs, props):
        client.acks.put(("unsuback", mid, rcs, props))

    def on_publish(client, ud, mid, rc, props):
        client.acks.put(("puback", mid, rc, props))

    c.on_connect = on_connect
    c.on_message = on_message
    c.on_disconnect = on_disconnect
    c.on_subscribe = on_subscribe
    c.on_unsubscribe = on_unsubscribe
    c.on_publish = on_publish
    if will is not None:
        c.will_set(**will)
    if username is not None:
        c.username_pw_set(username, password)
    if connect:
        ckw = {"keepalive": keepalive}
        if version == 5:
            from paho.mqtt.properties import Properties
            from paho.mqtt.packettypes import PacketTypes
            ckw["clean_start"] = clean
            if properties:
                p = Properties(PacketTypes.CONNECT)
                for k, v in properties.items():
                    setattr(p, k, v)
                ckw["properties"] = p
        c.connect("127.0.0.1", port, **ckw)
        c.loop_start()
        if not c.connected_event.wait(10):
            c.loop_stop()
            raise TimeoutError("no CONNACK")
    return c


@pytest.fixture
def clients():
    """Factory for paho clients that are disconnected at the end of the test."""
    made = []

    def factory(port, **kw):
        c = paho_client(port, **kw)
        made.append(c)
        return c

    yield factory
    for c in made:
        try:
            c.disconnect()
        except Exception:
            pass
        c.loop_stop()


def subscribe(client, topic, qos=0, timeout=5.0, **kw):
    """Subscribe and wait for the SUBACK; return its reason codes."""
    client.subscribe(topic, qos, **kw) if kw else client.subscribe(topic, qos)
    kind, mid, rcs, props = client.acks.get(timeout=timeout)
    assert kind == "suback"
    return rcs


def get_messages(client, n, timeout=5.0):
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            out.append(client.messages.get(timeout=remaining))
        except queue.Empty:
            break
    return out


def no_message(client, wait=0.5):
    try:
        msg = client.messages.get(timeout=wait)
    except queue.Empty:
        return True
    raise AssertionError(f"unexpected message on {msg.topic}: {msg.payload!r}")


os.environ.setdefault("PYTHONUNBUFFERED", "1")


# With pytest-xdist (`make test` runs two workers): each test file stays on one worker, so
# that its module fixtures (a cluster, an etcd) are made once; the files that start a JVM
# (Spark) or a browser share one worker, so that no two of them run at once on the
# machine's cores.
_ONE_WORKER = {"spark": ("tests/pipeline/", "test_admin_logread.py"),
               "browser": ("test_admin_dashboard.py",)}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        group = next((name for name, parts in _ONE_WORKER.items()
                      if any(part in path for part in parts)), path)
        item.add_marker(pytest.mark.xdist_group(group))
