"""[[webhook]]: events POSTed to a real receiver the test starts (tests/auth_services.py),
from `wrenmq serve` in a subprocess with paho clients; the receiver fails on purpose."""

import base64
import time
import urllib.request

import pytest

from auth_services import WebhookReceiver
from conftest import free_port, get_messages, paho_client, subscribe

pytest.importorskip("aiohttp")

ALL = '["client.connected", "client.disconnected", "session.subscribed", "session.unsubscribed", ' \
      '"message.publish", "message.dropped"]'


@pytest.fixture
def receiver():
    r = WebhookReceiver()
    yield r
    r.stop()


def served(serve_broker, receiver, extra="", metrics_port=None):
    metrics = f'[[listener]]\ntype = "metrics"\nport = {metrics_port}\n' if metrics_port else ""
    return serve_broker(f"""
[[listener]]
port = 0
{metrics}
[storage]
mode = "memory"
[sys]
interval = 0.5
[[webhook]]
name = "audit"
url = "{receiver.url}/events"
events = {ALL}
topics = ["sensors/#"]
batch_delay = 0.05
retry_delay = 0.1
retries = 2
{extra}
""")


def sys_value(port, topic, timeout=5.0):
    c = paho_client(port, client_id=f"sys-{time.monotonic_ns()}")
    try:
        subscribe(c, topic)
        msgs = get_messages(c, 1, timeout)
        return int(msgs[0].payload) if msgs else None
    finally:
        c.disconnect()
        c.loop_stop()


def wait_sys(port, topic, pred, timeout=15.0):
    """$SYS values are published every [sys] interval: read until `pred` holds."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = sys_value(port, topic)
        if value is not None and pred(value):
            return value
        time.sleep(0.3)
    raise AssertionError(f"{topic} = {value}")


def test_client_and_message_events(serve_broker, receiver):
    b = served(serve_broker, receiver)
    sub = paho_client(b.port, client_id="watcher", username="ops")
    subscribe(sub, "sensors/#", 1)
    subscribe(sub, "tmp/#")
    sub.unsubscribe("tmp/#")
    pub = paho_client(b.port, client_id="sensor-1")
    pub.publish("sensors/t1", b"21.5", qos=1).wait_for_publish(5)
    pub.publish("other/x", b"not sent", qos=1).wait_for_publish(5)
    assert len(get_messages(sub, 1)) == 1
    # A 5.0 client whose maximum packet size the message does not fit: dropped for it.
    small = paho_client(b.port, client_id="small", properties={"MaximumPacketSize": 64})
    subscribe(small, "sensors/#")
    pub.publish("sensors/big", b"x" * 200, qos=0)
    for c in (pub, sub, small):
        c.disconnect()
        c.loop_stop()
    assert receiver.wait(lambda r: len(r.of("client_disconnected")) >= 3)
    connected = {e["clientid"]: e for e in receiver.of("client_connected")}
    assert connected["watcher"]["username"] == "ops"
    assert connected["watcher"]["ipaddress"] == "127.0.0.1" and connected["watcher"]["proto_ver"] == 5
    subs = [(e["clientid"], e["topic"], e["opts"]["qos"]) for e in receiver.of("session_subscribed")]
    assert ("watcher", "sensors/#", 1) in subs and ("watcher", "tmp/#", 0) in subs
    assert [(e["clientid"], e["topic"]) for e in receiver.of("session_unsubscribed")] == [("watcher", "tmp/#")]
    published = receiver.of("message_publish")
    assert [e["topic"] for e in published] == ["sensors/t1", "sensors/big"]  # topics = sensors/#
    assert base64.b64decode(published[0]["payload"]) == b"21.5"
    assert published[0]["from_client_id"] == "sensor-1" and published[0]["qos"] == 1
    dropped = receiver.of("message_dropped")
    assert [(e["to_client_id"], e["topic"], e["reason"]) for e in dropped] == [("small", "sensors/big", "too_large")]
    gone = {e["clientid"]: e["reason"] for e in receiver.of("client_disconnected")}
    assert gone["watcher"] == "client disconnected"
    assert receiver.posts < len(receiver.events)  # batched


def test_a_failing_receiver_retries_drops_and_is_counted(serve_broker, receiver):
    metrics_port = free_port()
    b = served(serve_broker, receiver, "max_queued = 40\nbatch_size = 10", metrics_port)
    receiver.failing = True
    sub = paho_client(b.port, client_id="reader")
    subscribe(sub, "sensors/#")
    pub = paho_client(b.port, client_id="writer")
    for i in range(300):
        pub.publish(f"sensors/{i}", b"v", qos=0)
    # The message path does not wait for the webhook: every message arrives.
    assert len(get_messages(sub, 300, timeout=15)) == 300
    assert receiver.wait(lambda r: r.failed_posts >= 3)  # the first batch and its 2 retries
    wait_sys(b.port, "$SYS/broker/webhooks/audit/dropped", lambda v: v > 0)
    assert sys_value(b.port, "$SYS/broker/webhooks/queued") <= 40  # bounded
    receiver.failing = False
    assert receiver.wait(lambda r: len(r.of("message_publish")) > 0, timeout=15)
    # At least one batch given up after its retries.
    wait_sys(b.port, "$SYS/broker/webhooks/audit/failed", lambda v: v >= 1)
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert int(values["wrenmq_webhook_events_dropped_total"]) > 0
    assert int(values["wrenmq_webhook_events_failed_total"]) >= 1
    assert int(values["wrenmq_webhook_requests_failed_total"]) >= 3
    assert int(values["wrenmq_webhook_events_sent_total"]) > 0
    for c in (sub, pub):
        c.disconnect()
        c.loop_stop()
