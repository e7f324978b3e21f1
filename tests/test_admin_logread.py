"""The commit log served on the admin listener (admin/logread.py): partitions, offsets for a
time, and ranges of records as Arrow IPC streams, against a real `wrenmq serve` and real MQTT
clients; what the Spark source reads a cluster by (tests/pipeline/test_pipeline_standalone_network.py
reads it from a real Spark cluster)."""

import http.client
import socket

import pytest

from admin_helpers import PASSWORDS, AdminBroker, basic, call, make_token
from conftest import get_messages, paho_client, subscribe, wait_port
from mqtt_helpers import wait_for

pa = pytest.importorskip("pyarrow")

OPS = ("ops", PASSWORDS["ops"])
VIEWER = ("viewer", PASSWORDS["viewer"])


def _publish(port, n, prefix="lr", pad=0):
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="lr-pub", protocol=mqtt.MQTTv5)
    c.connect("127.0.0.1", port)
    c.loop_start()
    infos = []
    for i in range(n):
        props = None
        if i % 3 == 0:
            props = Properties(PacketTypes.PUBLISH)
            props.ContentType = "application/json"
            props.UserProperty = [("k", str(i)), ("k", "again")]
        infos.append(c.publish(f"{prefix}/{i % 4}/v", b'{"value": %d}' % i + b" " * pad, qos=1,
                               properties=props))
    for info in infos:
        info.wait_for_publish(10)
    c.disconnect()
    c.loop_stop()


def _get(port, path, auth=VIEWER, token=None, method="GET"):
    """(status, headers, body bytes) of one request."""
    h = {"Authorization": f"Bearer {token}" if token else basic(*auth)} if (auth or token) else {}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request(method, path, headers=h)
        r = conn.getresponse()
        return r.status, r.headers, r.read()
    finally:
        conn.close()


def _table(body):
    with pa.ipc.open_stream(body) as reader:
        batches, metas = [], []
        while True:
            try:
                rb, meta = reader.read_next_batch_with_custom_metadata()
            except StopIteration:
                break
            batches.append(rb)
            metas.append(dict(meta) if meta is not None else None)
    return pa.Table.from_batches(batches, schema=reader.schema), metas


def test_log_ranges_as_arrow_never_past_the_durable_end_for_read_only_callers(tmp_path):
    from wrenmq.store.arrow import SOURCE_SCHEMA, read_source
    from wrenmq.store.reader import LogReader

    # An fsync interval of a minute: acknowledged messages are written, not yet durable.
    b = AdminBroker(tmp_path, storage='fsync = "interval"\nfsync_interval_ms = 60000')
    try:
        _publish(b.port, 30)
        (part,) = (tmp_path / "data" / "log").iterdir()
        node = part.name
        listing = call(b.admin_port, "GET", "/api/v1/log/partitions", VIEWER)[2]
        (p,) = listing["partitions"]
        assert p["partition"] == node and (p["start_offset"], p["end_offset"]) == (0, 0)
        assert [s["admin"] for s in p["servers"]] == [f"http://127.0.0.1:{b.admin_port}"]
        base = f"/api/v1/log/partitions/{node}"
        status, headers, body = _get(b.admin_port, f"{base}/records?start=0&end=30")
        assert status == 416 and headers["X-Wrenmq-Offsets"] == "0-0", body
        assert call(b.admin_port, "GET", f"{base}/offset?timestamp=0", VIEWER)[2]["offset"] == 0
        # A kill -9 and a restart: the broker syncs what it recovers, now it is all durable.
        b.served.kill()
        b.served.start()
        wait_port(b.admin_port, proc=b.served.proc)
        (p,) = call(b.admin_port, "GET", "/api/v1/log/partitions", VIEWER)[2]["partitions"]
        assert (p["start_offset"], p["end_offset"]) == (0, 30)
        assert p["servers"][0]["first_timestamp_us"] <= p["servers"][0]["last_timestamp_us"]
        status, headers, body = _get(b.admin_port, f"{base}/records?start=0&end=30")
        assert status == 200 and headers["Content-Type"] == "application/vnd.apache.arrow.stream"
        got, metas = _table(body)
        assert got.schema.equals(SOURCE_SCHEMA)
        assert metas[-1] == {b"wrenmq.end": b"30"}  # a complete range ends with its marker
        # The same rows as the source reads from the files.
        reader = LogReader(part)
        want = pa.Table.from_batches(list(read_source(reader, node, 0, 30)), schema=SOURCE_SCHEMA)
        assert got.equals(want) and got.num_rows == 30
        assert got.column("properties")[3].as_py()["user_properties"] == [
            {"key": "k", "value": "3"}, {"key": "k", "value": "again"}]
        # A range from the middle, a topic filter (pushed down), compression, a read-only token.
        token = make_token(b.token_file, "spark", read_only=True)
        status, _, body = _get(b.admin_port, f"{base}/records?start=7&end=23&topics=lr/1/%2B,lr/2/v"
                                             "&compression=zstd&rows=3", auth=None, token=token)
        part_rows, _ = _table(body)
        assert status == 200
        assert part_rows.column("offset").to_pylist() == [o for o in range(7, 23) if o % 4 in (1, 2)]
        assert [rb.num_rows for rb in part_rows.to_batches()] == [3, 3, 2]
        ts = got.column("timestamp")[12].value
        assert call(b.admin_port, "GET", f"{base}/offset?timestamp={ts}", VIEWER)[2]["offset"] <= 12
        assert call(b.admin_port, "GET", f"{base}/offset?timestamp={ts * 2}", VIEWER)[2]["offset"] == 30
        # What is refused.
        assert _get(b.admin_port, f"{base}/records?start=0&end=30", auth=None)[0] == 401
        assert _get(b.admin_port, f"{base}/records?start=0&end=30", auth=("viewer", "wrong"))[0] == 401
        assert _get(b.admin_port, f"{base}/records?start=0&end=31")[0] == 416
        assert _get(b.admin_port, f"{base}/records?start=9&end=3")[0] == 400
        assert _get(b.admin_port, f"{base}/records?start=0&end=3&topics=a/%23/b")[0] == 400
        assert _get(b.admin_port, "/api/v1/log/partitions/nobody/records?start=0&end=3")[0] == 404
        assert _get(b.admin_port, f"{base}/records", method="POST", auth=OPS)[0] == 405
        reader.close()
    finally:
        b.stop()


def test_ranges_are_served_a_bounded_number_at_a_time_and_each_gives_its_slot_back(tmp_path):
    from wrenmq.admin.logread import MAX_STREAMS

    b = AdminBroker(tmp_path)
    try:
        _publish(b.port, 4000, pad=2000)  # 8 MB: more than the sockets between hold
        (part,) = (tmp_path / "data" / "log").iterdir()
        target = f"/api/v1/log/partitions/{part.name}/records?start=0&end=4000&rows=64"
        # HEAD answers the headers only: the stream is never read, and its slot comes back.
        for _ in range(MAX_STREAMS + 2):
            assert _get(b.admin_port, target, method="HEAD")[0] == 200
        # Readers that stop reading hold their slot (the server is a batch ahead at most);
        # past MAX_STREAMS a reader is told to come back.
        held = []
        for _ in range(MAX_STREAMS):
            s = socket.create_connection(("127.0.0.1", b.admin_port), timeout=10)
            s.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nAuthorization: {basic(*VIEWER)}\r\n\r\n".encode())
            assert s.recv(12) == b"HTTP/1.1 200"
            held.append(s)
        status, headers, _ = _get(b.admin_port, target)
        assert status == 503 and headers["Retry-After"] == "1"
        # Meanwhile the broker's message path is not held up by them.
        c = paho_client(b.port, client_id="lr-live")
        subscribe(c, "live/x", 1)
        c.publish("live/x", b"still here", qos=1)
        assert [m.payload for m in get_messages(c, 1)] == [b"still here"]
        c.disconnect()
        c.loop_stop()
        for s in held:
            s.close()
        assert wait_for(lambda: _get(b.admin_port, target)[0] == 200, timeout=10)
        status, _, body = _get(b.admin_port, target)
        table, _ = _table(body)
        assert table.num_rows == 4000
    finally:
        b.stop()
