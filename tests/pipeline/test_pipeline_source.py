"""The `wrenmq` Spark data source: batch and streaming reads of the commit log.

A real broker (`wrenmq serve`), real paho clients and one real local SparkSession; logs with
controlled timestamps are written with the store's own CommitLog.
"""

import json
import os
import threading
import time

import pytest

pytest.importorskip("pyspark")

from .pipeline_helpers import T0, props_block, telemetry, wait_for, write_log  # noqa: E402

from wrenmq.pipeline.source import (SCHEMA, cap_offsets, properties_column, spark_arrow_schema,  # noqa: E402
                                    to_spark_batch)


def _publish_v5(port, msgs, client_id="pub"):
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    c.connect("127.0.0.1", port)
    c.loop_start()
    infos = []
    for m in msgs:
        p = None
        if m.get("props"):
            p = Properties(PacketTypes.PUBLISH)
            for k, v in m["props"].items():
                setattr(p, k, v)
        infos.append(c.publish(m["topic"], m["payload"], qos=m.get("qos", 1), retain=m.get("retain", False),
                               properties=p))
    for i in infos:
        i.wait_for_publish(10)
    c.disconnect()
    c.loop_stop()


def test_batch_read_of_a_real_broker_log(spark, serve_broker, tmp_path):
    b = serve_broker()
    msgs = [
        {"topic": "plant/line1/temp", "payload": b'{"value": 21.5}', "qos": 0},
        {"topic": "plant/line1/temp", "payload": b'{"value": 22}', "qos": 1, "retain": True,
         "props": {"ContentType": "application/json", "PayloadFormatIndicator": 1,
                   "UserProperty": [("unit", "C"), ("sensor", "t1")], "MessageExpiryInterval": 3600,
                   "ResponseTopic": "plant/reply", "CorrelationData": b"\x00\x01"}},
        {"topic": "plant/line2/pressure", "payload": b"\xff\xfe raw", "qos": 2},
    ]
    _publish_v5(b.port, msgs, client_id="publisher-1")
    b.stop()
    rows = (spark.read.format("wrenmq").load(str(tmp_path / "data")).orderBy("offset").collect())
    assert [r.offset for r in rows] == [0, 1, 2]
    assert len({r.node for r in rows}) == 1 and rows[0].node
    assert [r.topic for r in rows] == [m["topic"] for m in msgs]
    assert [r.qos for r in rows] == [0, 1, 2]
    assert [r.retain for r in rows] == [False, True, False]
    assert {r.client_id for r in rows} == {"publisher-1"}
    assert [bytes(r.payload) for r in rows] == [m["payload"] for m in msgs]
    assert rows[0].properties is None and rows[2].properties is None
    p = rows[1].properties
    assert p.content_type == "application/json"
    assert p.payload_format_indicator == 1
    assert p.message_expiry_interval == 3600
    assert p.response_topic == "plant/reply"
    assert bytes(p.correlation_data) == b"\x00\x01"
    assert [(u.key, u.value) for u in p.user_properties] == [("unit", "C"), ("sensor", "t1")]
    ts = [r.timestamp.timestamp() for r in rows]
    assert ts == sorted(ts) and abs(ts[0] - time.time()) < 120


def test_reads_only_records_the_broker_has_made_durable(spark, serve_broker, tmp_path):
    # Records written but not yet fsynced can be lost to a crash of the machine, and their
    # offsets then reused for other records: the source must not have read them. With an
    # fsync interval of a minute, acknowledged QoS 1 messages are in the log files and
    # not durable; a kill -9 and a restart make them durable (the broker syncs what it
    # recovers), and the source then reads them.
    from wrenmq.store.reader import LogReader

    conf = '[storage]\nfsync = "interval"\nfsync_interval_ms = 60000\n'
    b = serve_broker(conf)
    _publish_v5(b.port, [{"topic": f"d/{i}", "payload": b"%d" % i, "qos": 1} for i in range(5)])
    (part,) = (tmp_path / "data" / "log").iterdir()
    reader = LogReader(part)
    assert (reader.end_offset, reader.durable_end_offset) == (5, 0)
    load = lambda: spark.read.format("wrenmq").load(str(tmp_path / "data"))  # noqa: E731
    assert load().count() == 0
    b.kill()
    b.start()
    assert sorted(r.offset for r in load().collect()) == [0, 1, 2, 3, 4]
    b.stop()
    reader.close()


def test_arrow_batches_match_spark_schema_and_decode_properties_once_per_block(data_dir):
    import pyarrow as pa

    from wrenmq.store.arrow import read_arrow
    from wrenmq.store.reader import LogReader

    blk = props_block({"content_type": "text/plain", "user_property": [("k", "v")]})
    recs = [{"topic": f"t/{i}", "payload": b"x", "props": blk if i % 3 == 0 else b""} for i in range(10)]
    write_log(data_dir, "n1", recs, per_batch=4)
    r = LogReader(os.path.join(data_dir, "log", "n1"))
    batches = list(read_arrow(r, 0, None))
    r.close()
    from pyspark.sql.pandas.types import to_arrow_schema

    from wrenmq.store.arrow import SOURCE_SCHEMA
    assert spark_arrow_schema().equals(to_arrow_schema(SCHEMA, timezone="UTC"))
    # (what the admin listener serves, built without pyspark, is exactly what Spark wants)
    assert SOURCE_SCHEMA.equals(spark_arrow_schema(), check_metadata=True)
    out = [to_spark_batch(rb, "n1") for rb in batches]
    for rb in out:
        assert rb.schema.equals(spark_arrow_schema())
    props = pa.Table.from_batches(out).column("properties").to_pylist()
    assert [p is not None for p in props] == [i % 3 == 0 for i in range(10)]
    assert props[0] == {"payload_format_indicator": None, "message_expiry_interval": None,
                        "content_type": "text/plain", "response_topic": None, "correlation_data": None,
                        "user_properties": [{"key": "k", "value": "v"}]}
    # a column without any property block becomes nulls without decoding anything
    col = properties_column(pa.array([b""] * 5, pa.binary()), spark_arrow_schema().field("properties").type)
    assert col.null_count == 5
    # a malformed block gives null, not a failed job
    col = properties_column(pa.array([b"\x7f\x00", blk], pa.binary()), spark_arrow_schema().field("properties").type)
    assert col.to_pylist()[0] is None and col.to_pylist()[1]["content_type"] == "text/plain"


def test_batch_options_topics_offsets_times_partitions(spark, data_dir):
    write_log(data_dir, "n1", telemetry(3000))
    write_log(data_dir, "n2", telemetry(1000, t0=T0 + 500))
    def rd():  # a DataFrameReader keeps its options: a fresh one each time
        return spark.read.format("wrenmq")

    df = rd().load(data_dir)
    assert df.count() == 4000
    assert sorted(r["node"] for r in df.select("node").distinct().collect()) == ["n1", "n2"]
    # topic filters are pushed down to the log reader
    got = rd().option("topics", "a/#, b/dev1/t").load(data_dir).groupBy("topic").count().collect()
    assert {r["topic"] for r in got} == {"a/dev0/t", "a/dev2/t", "a/dev4/t", "a/dev6/t", "a/dev8/t", "b/dev1/t"}
    assert sum(r["count"] for r in got) == 2400
    # offsets per node (end exclusive); a node missing from startingOffsets starts at the earliest
    df = (rd().option("startingOffsets", json.dumps({"n1": 100})).option("endingOffsets", '{"n1": 200, "n2": 50}')
          .load(data_dir))
    got = {(r["node"], r["offset"]) for r in df.select("node", "offset").collect()}
    assert got == {("n1", o) for o in range(100, 200)} | {("n2", o) for o in range(50)}
    assert rd().option("startingOffsets", "latest").load(data_dir).count() == 0
    # timestamps (ms since the epoch, or ISO 8601)
    ms = (T0 + 2000 * 1000) // 1000
    df = rd().option("startingTimestamp", str(ms)).option("endingTimestamp", str(ms + 500)).load(data_dir)
    got = sorted((r["node"], r["offset"]) for r in df.select("node", "offset").collect())
    assert got == [("n1", o) for o in range(2000, 2500)]
    iso = "2023-11-14T22:13:22Z"  # T0 + 2 s
    assert rd().option("startingTimestamp", iso).load(data_dir).count() == 1000
    # maxRecordsPerPartition splits a partition's range into Spark partitions
    df = rd().option("maxRecordsPerPartition", "700").load(data_dir)
    assert df.rdd.getNumPartitions() == 5 + 2
    assert rd().load(data_dir).rdd.getNumPartitions() == 2  # default: 250000 records per partition
    assert df.count() == 4000 and df.select("node", "offset").distinct().count() == 4000
    # an empty or missing data dir reads nothing
    assert rd().load(os.path.join(data_dir, "nothing-here")).count() == 0


def test_cap_offsets_shares_the_budget_by_backlog():
    assert cap_offsets({"a": 0, "b": 0}, {"a": 10, "b": 10}, 100) == {"a": 10, "b": 10}
    assert cap_offsets({"a": 0, "b": 0}, {"a": 300, "b": 100}, 100) == {"a": 75, "b": 25}
    out = cap_offsets({"a": 5}, {"a": 6, "b": 1000, "c": 1000}, 7)
    assert sum(out[n] - {"a": 5}.get(n, 0) for n in out) == 7 and out["a"] <= 6
    assert cap_offsets({"a": 0, "b": 0}, {"a": 1, "b": 1}, 1) in ({"a": 1, "b": 0}, {"a": 0, "b": 1})


def _collecting_query(spark, data_dir, ckpt, seen, **opts):
    r = spark.readStream.format("wrenmq")
    trigger = opts.pop("trigger", {"availableNow": True})
    for k, v in opts.items():
        r = r.option(k, str(v))
    df = r.load(data_dir)

    def batch(bdf, batch_id):
        rows = bdf.select("node", "offset").collect()
        seen.append((batch_id, [(x["node"], x["offset"]) for x in rows]))

    return df.writeStream.foreachBatch(batch).option("checkpointLocation", ckpt).trigger(**trigger).start()


def test_stream_admission_control_available_now_and_restart(spark, data_dir, tmp_path):
    write_log(data_dir, "n1", telemetry(6000))
    write_log(data_dir, "n2", telemetry(2000))
    ckpt = str(tmp_path / "ckpt")
    seen = []
    q = _collecting_query(spark, data_dir, ckpt, seen, maxRecordsPerTrigger=2500)
    q.awaitTermination(120)
    assert q.exception() is None
    sizes = [len(rows) for _, rows in seen if rows]
    assert max(sizes) <= 2500 and len(sizes) >= 4
    got = [x for _, rows in seen for x in rows]
    assert sorted(got) == sorted([("n1", o) for o in range(6000)] + [("n2", o) for o in range(2000)])
    # more data, a new node; the same checkpoint goes on where it stopped
    write_log(data_dir, "n1", telemetry(500, start=6000))
    write_log(data_dir, "n3", telemetry(300))
    seen.clear()
    q = _collecting_query(spark, data_dir, ckpt, seen, maxRecordsPerTrigger=2500)
    q.awaitTermination(120)
    assert q.exception() is None
    got = sorted(x for _, rows in seen for x in rows)
    assert got == sorted([("n1", o) for o in range(6000, 6500)] + [("n3", o) for o in range(300)])
    # the offsets in the checkpoint are JSON per node with sorted keys
    offsets_dir = os.path.join(ckpt, "offsets")
    last = max(int(n) for n in os.listdir(offsets_dir) if n.isdigit())
    with open(os.path.join(offsets_dir, str(last))) as fh:
        line = fh.read().splitlines()[2]
    assert line == '{"n1": 6500, "n2": 2000, "n3": 300}'


def test_stream_follows_a_live_broker_exactly_once(spark, serve_broker, tmp_path):
    b = serve_broker()
    data = str(tmp_path / "data")
    wait_for(lambda: os.path.isdir(os.path.join(data, "log")), 10)
    seen = []
    q = _collecting_query(spark, data, str(tmp_path / "ckpt"), seen, trigger={"processingTime": "300 milliseconds"},
                          topics="live/#")
    total = 600
    n = total // 6
    assert wait_for(lambda: q.lastProgress is not None, 60), "the query did not start"

    def publish_round(k):
        _publish_v5(b.port, [{"topic": f"live/{k}", "payload": str(i).encode(), "qos": 1} for i in range(n)]
                    + [{"topic": "other/x", "payload": b"-", "qos": 0}], client_id=f"live-{k}")

    def publisher():
        for k in range(1, 6):
            publish_round(k)
            time.sleep(0.2)

    t = threading.Thread(target=publisher)
    try:
        publish_round(0)
        assert wait_for(lambda: sum(len(r) for _, r in seen) >= n, 60)
        t.start()  # the rest while the query runs
        assert wait_for(lambda: sum(len(r) for _, r in seen) >= total, 60), "the stream did not catch up"
        time.sleep(1.0)  # nothing more must come
    finally:
        if t.is_alive() or t.ident:
            t.join()
        q.stop()
    got = [x for _, rows in seen for x in rows]
    assert len(got) == total == len(set(got))
    offsets = sorted(o for _, o in got)
    assert len([o for o in range(offsets[-1] + 1) if o not in set(offsets)]) == 6  # the other/x records
    assert sum(1 for _, rows in seen if rows) >= 2  # it really streamed


def test_data_deleted_by_retention_fails_the_query_unless_allowed(spark, data_dir, tmp_path):
    from wrenmq.store.log import CommitLog

    write_log(data_dir, "n1", telemetry(2000), per_batch=50, segment_bytes=16 << 10)
    ckpt = str(tmp_path / "ckpt")
    seen = []
    q = _collecting_query(spark, data_dir, ckpt, seen, maxRecordsPerTrigger=1000)
    q.awaitTermination(120)
    assert sum(len(r) for _, r in seen) == 2000
    write_log(data_dir, "n1", telemetry(1000, start=2000), per_batch=50, segment_bytes=16 << 10)
    log = CommitLog(os.path.join(data_dir, "log", "n1"), segment_bytes=16 << 10)
    deleted, _ = log.enforce_retention(retention_bytes=40 << 10)
    start = log.start_offset
    log.close()
    assert deleted and start > 2000
    q = _collecting_query(spark, data_dir, ckpt, [], maxRecordsPerTrigger=100)
    with pytest.raises(Exception, match="deleted by retention"):
        q.awaitTermination(120)
    seen = []
    q = _collecting_query(spark, data_dir, ckpt, seen, failOnDataLoss="false")
    q.awaitTermination(120)
    assert q.exception() is None
    assert sorted(o for _, rows in seen for _, o in rows) == list(range(start, 3000))


def _private_log(data_dir):
    """Batches of 4 records where every 4th record (offset % 4 == 1) is private."""
    recs = [{"topic": f"p/{i}", "payload": str(i), "private": i % 4 == 1} for i in range(40)]
    write_log(data_dir, "n1", recs, per_batch=4)
    return [i for i in range(40) if i % 4 != 1]


def test_store_read_arrow_from_an_offset_inside_a_batch_with_private_records(data_dir):
    from wrenmq.store.arrow import read_arrow
    from wrenmq.store.reader import LogReader

    public = _private_log(data_dir)
    r = LogReader(os.path.join(data_dir, "log", "n1"))
    try:
        for start in (2, 3, 6, 7):
            got = [o for rb in read_arrow(r, start, None) for o in rb.column(0).to_pylist()]
            assert got == [o for o in public if o >= start], start
    finally:
        r.close()


def test_source_skips_private_records_and_reads_exact_ranges_around_them(spark, data_dir):
    public = _private_log(data_dir)
    df = spark.read.format("wrenmq").option("maxRecordsPerPartition", "3").load(data_dir)
    assert sorted(r["offset"] for r in df.select("offset").collect()) == public
    for start, end in ((2, 11), (3, 7), (6, 40)):
        df = (spark.read.format("wrenmq").option("startingOffsets", json.dumps({"n1": start}))
              .option("endingOffsets", json.dumps({"n1": end})).load(data_dir))
        assert sorted(r["offset"] for r in df.select("offset").collect()) == [o for o in public if start <= o < end]


@pytest.mark.parametrize("crc32", [True, False], ids=["WRN1-crc32", "WRN1-crc32c"])
def test_batch_read_of_a_log_an_older_version_began(spark, data_dir, crc32):
    """A log whose first batches an older wrenmq wrote (format WRN1, with CRC-32 or CRC-32C
    checksums) and the rest this one (WRN2) reads whole through the data source."""
    from log_helpers import rewrite_as_v1

    recs = telemetry(300)
    write_log(data_dir, "n1", recs[:200], per_batch=50)
    rewrite_as_v1(os.path.join(data_dir, "log", "n1"), crc32)
    write_log(data_dir, "n1", recs[200:], per_batch=50)
    rows = spark.read.format("wrenmq").load(data_dir).orderBy("offset").collect()
    assert [r.offset for r in rows] == list(range(300))
    assert [bytes(r.payload) for r in rows] == [r["payload"].encode() for r in recs]
