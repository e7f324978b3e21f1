"""The pipeline jobs (archive, topic-stats, usage, device-state, replay) and the atomic sink."""

import json
import os
import queue
import time

import pytest

pytest.importorskip("pyspark")

from .pipeline_helpers import T0, duckdb_counts, lake_offsets, subscribe, telemetry, write_log  # noqa: E402

from wrenmq.pipeline import jobs  # noqa: E402
from wrenmq.pipeline.sink import AtomicParquetSink  # noqa: E402

DAY_US = 86_400 * 1_000_000


def _opts(data_dir, out, **kw):
    kw.setdefault("quiet", True)
    return jobs.JobOptions(data_dir=data_dir, output=str(out), **kw)


def _every_reader_counts(path):
    """Rows of a Parquet folder as pyarrow, pandas and DuckDB see it (hive partitions)."""
    import pandas as pd
    import pyarrow.dataset as ds

    out = {"pyarrow": ds.dataset(path, format="parquet", partitioning="hive").count_rows(),
           "pandas": len(pd.read_parquet(path))}
    dd = duckdb_counts(path)
    if dd is not None:
        out["duckdb"] = dd[0]
    return out


def test_archive_lake_partitioned_by_date_and_prefix_exactly_once(spark, data_dir, tmp_path):
    recs = telemetry(3000, sites=("a", "b"))
    for i, r in enumerate(recs[1500:]):  # the second half on the next day, under other prefixes
        r["ts"] = T0 + DAY_US + i
        r["topic"] = ("c/" if i % 2 else "/") + r["topic"]
    write_log(data_dir, "n1", recs)
    write_log(data_dir, "n2", telemetry(500))
    out = tmp_path / "lake"
    assert jobs.run("archive", _opts(data_dir, out, max_records_per_trigger=1200), spark=spark) == 0
    parts = sorted(os.path.relpath(d, out) for d, _, fs in os.walk(out) if any(f.endswith(".parquet") for f in fs))
    assert parts == ["date=2023-11-14/prefix=a", "date=2023-11-14/prefix=b", "date=2023-11-15/prefix=_",
                     "date=2023-11-15/prefix=c"]
    got = lake_offsets(str(out))
    assert sorted(got) == sorted([("n1", o) for o in range(3000)] + [("n2", o) for o in range(500)])
    assert _every_reader_counts(str(out)) == {"pyarrow": 3500, "pandas": 3500, "duckdb": 3500}
    # the columns round-trip (payload bytes, properties struct, timestamps in UTC)
    import pyarrow.dataset as ds
    t = ds.dataset(str(out), format="parquet", partitioning="hive").to_table(filter=ds.field("offset") == 7)
    row = [r for r in t.to_pylist() if r["node"] == "n1"][0]
    assert row["payload"] == recs[7]["payload"].encode() and row["topic"] == recs[7]["topic"]
    assert int(row["timestamp"].timestamp() * 1e6) == recs[7]["ts"]
    # a re-run adds nothing; new records are added exactly once
    assert jobs.run("archive", _opts(data_dir, out), spark=spark) == 0
    assert len(lake_offsets(str(out))) == 3500
    write_log(data_dir, "n2", telemetry(100, start=500))
    jobs.run("archive", _opts(data_dir, out), spark=spark)
    got = lake_offsets(str(out))
    assert len(got) == len(set(got)) == 3600


def test_atomic_sink_rolls_a_committed_batch_forward_and_replaces_on_rerun(tmp_path):
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    out = tmp_path / "lake"
    sink = AtomicParquetSink(str(out), partition_by=["date"])

    def stage(batch_id, rows):
        d = os.path.join(sink.staging, f"{batch_id:020d}", "date=2024-01-01")
        os.makedirs(d, exist_ok=True)
        pq.write_table(pa.table({"x": rows}), os.path.join(d, "part-0-uuid.snappy.parquet"))
        return os.path.join(sink.staging, f"{batch_id:020d}")

    def count():
        return ds.dataset(str(out), format="parquet", partitioning="hive").count_rows()

    sink.commit_staged(stage(0, [1, 2, 3]), 0)
    assert count() == 3
    # crash 1: staged, never committed -> dropped on restart (Spark re-runs the batch)
    stage(1, [4, 5])
    assert count() == 3
    sink = AtomicParquetSink(str(out), partition_by=["date"])
    assert os.listdir(sink.staging) == [] and count() == 3
    # crash 2: committed (manifest written), not published -> rolled forward on restart
    st = stage(1, [4, 5])

    def crash(manifest):
        raise SystemExit("killed")

    sink._publish = crash
    with pytest.raises(SystemExit):
        sink.commit_staged(st, 1)
    assert count() == 3
    sink = AtomicParquetSink(str(out), partition_by=["date"])
    assert count() == 5
    # Spark re-runs batch 1 after all (its own commit was lost): replaced, never added
    sink.commit_staged(stage(1, [4, 5]), 1)
    assert count() == 5
    assert sorted(ds.dataset(str(out), partitioning="hive").to_table().column("x").to_pylist()) == [1, 2, 3, 4, 5]


def _stats_log(data_dir):
    """Two topics over three 10 s windows; JSON payloads with `value`, one non-JSON payload."""
    recs = []
    for w in range(3):
        for i in range(10):
            ts = T0 + w * 10_000_000 + i * 900_000
            recs.append({"topic": "s/temp", "client_id": f"c{i % (w + 1)}", "ts": ts,
                         "payload": json.dumps({"value": w * 10 + i, "nested": {"v": i}})})
            recs.append({"topic": "s/raw", "client_id": "r", "ts": ts, "payload": b"\x00not json"})
    recs.append({"topic": "s/temp", "client_id": "late", "ts": T0 + 40_000_000, "payload": "{}"})
    write_log(data_dir, "n1", recs, per_batch=7)


def test_topic_stats_windows_and_retained_publish(spark, data_dir, tmp_path, make_broker, clients):
    _stats_log(data_dir)
    b = make_broker()
    out = tmp_path / "stats"
    o = _opts(data_dir, out, window="10 seconds", watermark="0 seconds", fields=["value", "nested.v"],
              publish=True, broker=f"127.0.0.1:{b.port}", max_records_per_trigger=40)
    assert jobs.run("topic-stats", o, spark=spark) == 0
    import pyarrow.dataset as ds
    t = ds.dataset(str(out), format="parquet", partitioning="hive").to_table().to_pylist()
    t.sort(key=lambda r: (r["window_start"], r["topic"]))
    # windows 0..2 closed (the record at +40 s moved the watermark past them), window 4 still open
    assert [(r["topic"], r["messages"]) for r in t] == [("s/raw", 10), ("s/temp", 10)] * 3
    temp = [r for r in t if r["topic"] == "s/temp"]
    assert [r["publishers"] for r in temp] == [1, 2, 3]
    assert [(r["value_min"], r["value_mean"], r["value_max"]) for r in temp] == [
        (0, 4.5, 9), (10, 14.5, 19), (20, 24.5, 29)]
    assert temp[0]["nested_v_max"] == 9
    raw = [r for r in t if r["topic"] == "s/raw"]
    assert all(r["value_mean"] is None and r["bytes"] == 10 * 9 for r in raw)
    assert int(temp[1]["window_start"].timestamp()) == T0 // 1_000_000 + 10
    # the same rows, retained on the broker under $analytics/topic-stats/<topic>
    sub = clients(b.port)
    subscribe(sub, "$analytics/topic-stats/#", qos=1)
    got = {}
    for _ in range(2):
        m = sub.messages.get(timeout=10)
        assert m.retain
        got[m.topic] = json.loads(m.payload)
    last = got["$analytics/topic-stats/s/temp"]
    assert last["messages"] == 10 and last["publishers"] == 3 and last["value"] == {"min": 20, "mean": 24.5, "max": 29}
    assert last["window_start"].endswith("+00:00")
    # a re-run has nothing new to say
    assert jobs.run("topic-stats", o, spark=spark) == 0
    assert ds.dataset(str(out), format="parquet", partitioning="hive").count_rows() == 6


def test_usage_per_client_per_hour(spark, data_dir, tmp_path):
    hour = 3_600_000_000
    h0 = T0 - T0 % hour
    recs = []
    for h in range(3):
        for i in range(5 + h):
            recs.append({"topic": "u/x", "client_id": f"c{i % 2}", "ts": h0 + h * hour + i, "payload": b"12345"})
    recs.append({"topic": "u/x", "client_id": "tick", "ts": h0 + 5 * hour, "payload": b""})
    write_log(data_dir, "n1", recs)
    out = tmp_path / "usage"
    assert jobs.run("usage", _opts(data_dir, out, watermark="0 seconds"), spark=spark) == 0
    import pyarrow.dataset as ds
    t = sorted(ds.dataset(str(out), format="parquet", partitioning="hive").to_table().to_pylist(),
               key=lambda r: (r["hour_start"], r["client_id"]))
    assert [(int(r["hour_start"].timestamp() * 1e6 - h0) // hour, r["client_id"], r["messages"], r["bytes"])
            for r in t] == [(0, "c0", 3, 15), (0, "c1", 2, 10), (1, "c0", 3, 15), (1, "c1", 3, 15),
                            (2, "c0", 4, 20), (2, "c1", 3, 15)]


def test_device_state_latest_per_topic_flattened_and_replay_safe(spark, serve_broker, tmp_path, clients):
    import pyarrow.parquet as pq

    from wrenmq.pipeline.replay import ReplayOptions, replay

    b = serve_broker()
    data = str(tmp_path / "data")
    pub = clients(b.port)
    for i in range(3):
        for dev in ("d1", "d2"):
            pub.publish(f"fleet/{dev}/state", json.dumps({"temp": 20 + i, "gps": {"lat": 1.5, "lon": i},
                                                          "ok": True, "tag": dev}), qos=1).wait_for_publish(5)
    pub.publish("fleet/d3/state", b"not json", qos=1).wait_for_publish(5)
    out = tmp_path / "state"
    o = _opts(data, out)
    assert jobs.run("device-state", o, spark=spark) == 0
    t = pq.read_table(str(out / "device_state.parquet"))
    rows = {r["topic"]: r for r in t.to_pylist()}
    assert set(rows) == {"fleet/d1/state", "fleet/d2/state", "fleet/d3/state"}
    assert rows["fleet/d1/state"]["payload.temp"] == 22 and rows["fleet/d2/state"]["payload.gps.lon"] == 2
    assert rows["fleet/d1/state"]["payload.gps.lat"] == 1.5 and rows["fleet/d1/state"]["payload.ok"] is True
    assert rows["fleet/d3/state"]["payload.temp"] is None and rows["fleet/d3/state"]["payload"] == b"not json"
    assert t.schema.field("payload.temp").type == "int64"
    # replay the old values (same topics): the shadow keeps the newest by original time
    r = replay(ReplayOptions(data_dir=data, broker=f"127.0.0.1:{b.port}", to_offset="4", same_topics=True,
                             quiet=True))
    assert r["messages"] == 4
    pub.publish("fleet/d2/state", json.dumps({"temp": 99}), qos=1).wait_for_publish(5)
    assert jobs.run("device-state", o, spark=spark) == 0
    rows = {r["topic"]: r for r in pq.read_table(str(out / "device_state.parquet")).to_pylist()}
    assert rows["fleet/d1/state"]["payload.temp"] == 22  # not the replayed 20/21
    assert rows["fleet/d2/state"]["payload.temp"] == 99 and rows["fleet/d2/state"]["payload.gps.lat"] is None
    # a fresh checkpoint re-reading everything (a replay of the log) gives the same table
    o2 = _opts(data, out, checkpoint=str(tmp_path / "ckpt2"))
    before = pq.read_table(str(out / "device_state.parquet"))
    assert jobs.run("device-state", o2, spark=spark) == 0
    after = pq.read_table(str(out / "device_state.parquet"))
    assert after.equals(before)


def test_replay_stops_at_what_the_broker_has_made_durable(serve_broker, tmp_path, clients):
    # As the source: a replay must not re-publish records that a crash of the machine could
    # still take back. With an fsync interval of a minute, acknowledged QoS 1 messages are
    # written, not durable; after a kill -9 and a restart (the broker syncs what it
    # recovered) they are.
    from wrenmq.pipeline.replay import ReplayOptions, replay

    b = serve_broker('[storage]\nfsync = "interval"\nfsync_interval_ms = 60000\n')
    data = str(tmp_path / "data")
    pub = clients(b.port)
    for i in range(5):
        pub.publish(f"m/{i}", b"%d" % i, qos=1).wait_for_publish(5)
    pub.disconnect()
    again = lambda: replay(ReplayOptions(data_dir=data, broker=f"127.0.0.1:{b.port}", prefix="r/",  # noqa: E731
                                         quiet=True))["messages"]
    assert again() == 0
    b.kill()
    b.start()
    assert again() == 5


def test_replay_range_filter_prefix_rate_and_properties(serve_broker, tmp_path, clients):
    from wrenmq.pipeline.replay import ReplayOptions, replay

    b = serve_broker()
    data = str(tmp_path / "data")
    pub = clients(b.port)
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties
    p = Properties(PacketTypes.PUBLISH)
    p.ContentType = "text/plain"
    p.UserProperty = [("origin", "x")]
    for i in range(40):
        pub.publish(f"m/{i % 2}", str(i).encode(), qos=1, properties=p).wait_for_publish(5)
    sub = clients(b.port)
    subscribe(sub, "replay/#", qos=1)
    t0 = time.monotonic()
    r = replay(ReplayOptions(data_dir=data, broker=f"127.0.0.1:{b.port}", topics="m/0", from_offset="10",
                             to_offset="30", prefix="replay/", rate=40, quiet=True))
    took = time.monotonic() - t0
    assert r["messages"] == 10
    assert took >= 0.2  # 10 messages at 40/s
    got = []
    while True:
        try:
            got.append(sub.messages.get(timeout=3))
        except queue.Empty:
            break
    assert [m.topic for m in got] == ["replay/m/0"] * 10
    assert [int(m.payload) for m in got] == list(range(10, 30, 2))
    props = got[0].properties
    assert props.ContentType == "text/plain"
    ups = dict(props.UserProperty)
    assert ups["origin"] == "x" and ups["wrenmq-replay-of"].endswith(":10")
    assert int(ups["wrenmq-original-timestamp"]) > 0
