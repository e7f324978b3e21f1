"""[storage] min_free_bytes: a disk running low stops the broker taking new messages, not
the broker. Real brokers writing to a disk of their own (a tmpfs the test mounts, so that
no other process changes its free space meanwhile), real clients; the disk is made "low"
by setting the line just under its free space, and freed again by deleting a file that
was taking room.
"""

import os
import subprocess
import time

import pytest

from mqtt_helpers import raw_connect, raw_next, rc_int, scrape, wait_for
from conftest import subscribe, get_messages
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.packets import Publish, Will
from wrenmq.store.reader import LogReader

PAYLOAD = bytes(4096)


def _free(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _filler(directory, size=256 << 20):
    """A file holding `size` bytes of the disk (allocated, not written), to delete later."""
    path = directory / "filler"
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, size)
    return path


def _publish_acked(client, topic, payload, qos=1, timeout=5.0):
    """Publish and return the reason code of its PUBACK (QoS 1)."""
    info = client.publish(topic, payload, qos)
    deadline = time.monotonic() + timeout
    while True:
        kind, mid, rc, _ = client.acks.get(timeout=max(0.01, deadline - time.monotonic()))
        if kind == "puback" and mid == info.mid:
            return rc_int(rc)


@pytest.fixture
def disk(tmp_path):
    """A 512 MiB file system of the test's own (tmpfs; the tests run as root)."""
    path = tmp_path / "disk"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m", "wrenmq-test-disk", str(path)], check=True)
    yield path
    # (lazy: a broker the test did not stop may still hold files there; its memory goes with them)
    subprocess.run(["umount", "-l", str(path)], check=True)


def _low_disk_broker(make_broker, directory, margin, extra=""):
    """A broker whose data directory is `margin` bytes above [storage] min_free_bytes."""
    data = directory / "data"
    data.mkdir()
    line = _free(directory) - margin
    b = make_broker(f'{extra}[storage]\ndata_dir = "{data}"\nfsync = "interval"\nmin_free_bytes = {line}\n')
    return b, data


def _logged(data, private=False):
    (part,) = (data / "log").iterdir()
    return [(rec.topic, rec.payload[:4]) for rec in LogReader(part).records(private=private)]


def test_low_disk_refuses_qos12_records_nothing_and_takes_messages_again_once_freed(
        make_broker, clients, raw_client, disk):
    filler = _filler(disk)
    b, data = _low_disk_broker(make_broker, disk, 32 << 20)
    router = b.broker.router
    watcher = clients(b.port, version=5)
    subscribe(watcher, "d/#", 0)
    pub = clients(b.port, version=5)

    # QoS 1 at 4 KiB until the broker refuses one: after about 16 MiB of log (the log
    # allocates 16 MiB of its active segment ahead of its writes).
    acked = []
    refused = None
    for i in range(64 * 256):  # up to 64 MiB
        rc = _publish_acked(pub, "d/q1", i.to_bytes(4, "big") + PAYLOAD)
        if rc == C.QUOTA_EXCEEDED:
            refused = i
            break
        assert rc in (0, C.NO_MATCHING_SUBSCRIBERS), hex(rc)
        acked.append(i)
    assert refused is not None, "64 MiB of messages written and no refusal"
    assert len(acked) > 1000  # (the line was 32 MiB away)
    assert b.call(lambda: router.disk_low)
    store = b.broker.store
    end = store.next_offset

    # While low: QoS 2 refused at PUBREC (5.0), QoS 1 from a 3.1.1 client closes its
    # connection unacknowledged, QoS 0 is delivered but not recorded.
    c5, _ = raw_connect(raw_client, b.port, C.MQTT5)
    c5.send(Publish("d/q2", b"q2-low", qos=2, packet_id=7))
    rec = raw_next(c5, C.PUBREC)
    assert rec.packet_id == 7 and rec.reason_code == C.QUOTA_EXCEEDED
    c3, _ = raw_connect(raw_client, b.port, C.MQTT311)
    c3.send(Publish("d/q1", b"v3-low", qos=1, packet_id=9))
    assert raw_next(c3, C.PUBACK) is None  # closed, no PUBACK
    while watcher.messages.qsize():  # (what was delivered before the line)
        watcher.messages.get()
    pub.publish("d/q0", b"q0-low", 0)
    got = get_messages(watcher, 1)
    assert [m.payload for m in got] == [b"q0-low"]
    assert b.call(lambda: store.next_offset) == end
    sys_values = b.call(b.broker.sys_topics.snapshot)
    assert sys_values["$SYS/broker/store/disk_low"] == 1
    assert sys_values["$SYS/broker/publish/messages/refused"] == 3

    # Freed: taken again within the broker's next look (once a second).
    filler.unlink()
    assert wait_for(lambda: not b.call(lambda: router.disk_low), timeout=5)
    assert _publish_acked(pub, "d/q1", (10**6).to_bytes(4, "big") + b"after") in (0, C.NO_MATCHING_SUBSCRIBERS)
    assert wait_for(lambda: b.call(lambda: store.next_offset) == end + 1, timeout=5)

    b.stop()
    logged = _logged(data)
    # Everything acknowledged is in the log, in order, and nothing refused or live-only.
    assert [t for t, _ in logged] == ["d/q1"] * (len(acked) + 1)
    assert [int.from_bytes(p, "big") for _, p in logged] == acked + [10**6]


def test_broker_started_on_a_low_disk_refuses_from_the_first_publish(make_broker, clients, raw_client, disk):
    b, data = _low_disk_broker(make_broker, disk, -(64 << 20),  # already 64 MiB under the line
                               '[[listener]]\ntype = "metrics"\nport = 0\n')
    assert b.call(lambda: b.broker.router.disk_low)
    assert scrape(b.broker.addresses[1][1], "/health")[::2] == (200, '{"status": "disk_low"}\n')
    pub = clients(b.port, version=5)
    assert _publish_acked(pub, "d/q1", b"x") == C.QUOTA_EXCEEDED
    sub3 = clients(b.port, version=4)
    subscribe(sub3, "d/#", 1)  # subscribing, and its state, still work
    pub.publish("d/q0", b"live", 0)
    assert [m.payload for m in get_messages(sub3, 1)] == [b"live"]
    # What mosquitto_pub users see: 5.0 reports the refusal, 3.1.1 loses its connection
    # (and fails: the message was not acknowledged).
    cmd = ["mosquitto_pub", "-p", str(b.port), "-t", "d/q1", "-m", "m", "-q", "1"]
    r5 = subprocess.run(cmd + ["-V", "mqttv5"], capture_output=True, text=True, timeout=30)
    assert "Quota exceeded" in r5.stderr + r5.stdout, (r5.stdout, r5.stderr)
    r3 = subprocess.run(cmd + ["-V", "mqttv311"], capture_output=True, text=True, timeout=30)
    assert r3.returncode != 0 and "connection was lost" in r3.stderr.lower(), (r3.returncode, r3.stderr)
    assert get_messages(sub3, 1, timeout=0.5) == []
    # A persistent session is still owed what the broker publishes itself, here a QoS 1
    # will: from memory, nothing written to the log while the disk is low.
    dev = clients(b.port, version=5, client_id="dev", clean=False, properties={"SessionExpiryInterval": 300})
    subscribe(dev, "w/#", 1)
    dev.disconnect()
    dev.loop_stop()
    doomed, _ = raw_connect(raw_client, b.port, C.MQTT5, will=Will("w/gone", b"bye", qos=1))
    end = b.call(lambda: b.broker.store.next_offset)
    doomed.close()  # no DISCONNECT: the will goes
    assert wait_for(lambda: b.call(lambda: len(b.broker.router.sessions["dev"].queue)) == 1, timeout=5)
    assert b.call(lambda: b.broker.store.next_offset) == end
    back = clients(b.port, version=5, client_id="dev", clean=False, properties={"SessionExpiryInterval": 300})
    assert [m.payload for m in get_messages(back, 1)] == [b"bye"]
    b.stop()
    assert _logged(data, private=True) == []
