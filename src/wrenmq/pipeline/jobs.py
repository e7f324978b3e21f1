"""The pipeline jobs: streaming queries over the `wrenmq` source.

    archive       the log as a Parquet lake partitioned by date and first topic level(s)
    topic-stats   per topic and window: messages, bytes, publishers, min/mean/max of JSON fields
    device-state  the latest message per topic (device shadow), JSON payloads flattened
    usage         messages and bytes per client id per hour

Each `start_<job>(spark, opts)` starts a streaming query and returns it (the demo runs two at
once); `run(job, opts)` is what `wrenmq pipeline JOB` does: a session, the query, progress
until done (`once`: everything in the log now, then stop) or forever (`continuous`).
Output is exactly once for every reader (see sink.py); the checkpoint defaults to
`<output>/_wrenmq/checkpoint`.
"""

import json
import logging
import os
import re
import time
from dataclasses import dataclass, field

from .common import OptionError, check_log, data_dir_specs, parse_offsets_spec, parse_time_us, parse_topics
from .sink import AtomicParquetSink

log = logging.getLogger("wrenmq.pipeline")

JOBS = ("archive", "topic-stats", "device-state", "usage", "replay")

# Set by the replay job on every message it re-publishes.
REPLAY_OF = "wrenmq-replay-of"
ORIGINAL_TIMESTAMP = "wrenmq-original-timestamp"


@dataclass
class JobOptions:
    data_dir: str = "./data"
    # A running cluster instead: its nodes' admin listeners, HOST:PORT comma separated (any
    # one is enough), and how to reach them.
    brokers: str = None
    user: str = None
    password: str = None
    token: str = None
    cafile: str = None
    output: str = None
    checkpoint: str = None
    master: str = None
    once: bool = True
    trigger: str = "5 seconds"
    duration: float = None  # continuous: stop after this many seconds
    topics: str = None
    starting_offsets: str = None
    starting_timestamp: str = None
    max_records_per_trigger: int = None
    max_records_per_partition: int = None
    fail_on_data_loss: bool = True
    spark_conf: dict = field(default_factory=dict)
    ui: bool = False
    quiet: bool = False
    # archive
    topic_levels: int = 1
    # topic-stats / usage
    window: str = None
    watermark: str = None
    fields: list = field(default_factory=lambda: ["value"])
    publish: bool = False
    broker: str = "127.0.0.1:1883"
    publish_prefix: str = "$analytics/topic-stats"
    # device-state
    flatten: bool = True

    def source_path(self):
        """What the source loads: `wrenmq://` and the brokers, or the data dir(s)."""
        if self.brokers:
            return "wrenmq://" + self.brokers
        return ",".join(os.path.abspath(p) for p in data_dir_specs(self.data_dir))

    def output_dir(self, job):
        return os.path.abspath(self.output or os.path.join("lake", job))

    def checkpoint_dir(self, job):
        if self.checkpoint:
            return os.path.abspath(self.checkpoint)
        return os.path.join(self.output_dir(job), "_wrenmq", "checkpoint")


# --- the source ------------------------------------------------------------------------------------

def source_options(o):
    opts = {}
    if o.topics:
        opts["topics"] = o.topics
    if o.starting_offsets:
        opts["startingOffsets"] = o.starting_offsets
    if o.starting_timestamp:
        opts["startingTimestamp"] = o.starting_timestamp
    if o.max_records_per_trigger:
        opts["maxRecordsPerTrigger"] = str(o.max_records_per_trigger)
    if o.max_records_per_partition:
        opts["maxRecordsPerPartition"] = str(o.max_records_per_partition)
    opts["failOnDataLoss"] = "true" if o.fail_on_data_loss else "false"
    if o.brokers:
        for key, value in (("username", o.user), ("password", o.password), ("token", o.token),
                           ("cafile", os.path.abspath(o.cafile) if o.cafile else None)):
            if value is not None:
                opts[key] = value
    return opts


def read_stream(spark, o):
    r = spark.readStream.format("wrenmq")
    for k, v in source_options(o).items():
        r = r.option(k, v)
    return r.load(o.source_path())


def _start(df, o, job, func, name=None, mode="append"):
    w = (df.writeStream.queryName(name or job.replace("-", "_")).outputMode(mode)
         .option("checkpointLocation", o.checkpoint_dir(job)).foreachBatch(func))
    w = w.trigger(availableNow=True) if o.once else w.trigger(processingTime=o.trigger)
    return w.start()


def _test_pause():
    """Fault-injection hook for the crash tests: a pause with a batch staged, not committed."""
    delay = os.environ.get("WRENMQ_PIPELINE_TEST_STAGE_DELAY")
    if delay:
        time.sleep(float(delay))


class _Sink(AtomicParquetSink):
    def commit_staged(self, stage, batch_id):
        _test_pause()
        return super().commit_staged(stage, batch_id)


# --- archive -------------------------------------------------------------------------------------

def topic_prefix_col(levels):
    from pyspark.sql import functions as F

    parts = F.split(F.col("topic"), "/", levels + 1 if levels > 0 else -1)
    prefix = F.array_join(F.slice(parts, 1, levels), "/")
    return F.when(prefix == "", F.lit("_")).otherwise(prefix)


def start_archive(spark, o):
    from pyspark.sql import functions as F

    out = o.output_dir("archive")
    sink = _Sink(out, partition_by=["date", "prefix"], sort_by=["node", "offset"])
    df = (read_stream(spark, o)
          .withColumn("date", F.date_format(F.col("timestamp"), "yyyy-MM-dd"))
          .withColumn("prefix", topic_prefix_col(o.topic_levels)))

    def batch(bdf, batch_id):
        sink.write_batch(bdf, batch_id)

    return _start(df, o, "archive", batch)


# --- topic-stats -------------------------------------------------------------------------------------

def _field_name(f):
    return re.sub(r"[^0-9A-Za-z_]", "_", f)


def _json_path(f):
    return "$." + ".".join(f"['{p}']" if not re.fullmatch(r"[A-Za-z_][0-9A-Za-z_]*", p) else p
                           for p in f.split(".")).replace(".[", "[")


def numeric_field_cols(fields):
    """Columns of the numeric JSON fields (null when the payload is no JSON or lacks them)."""
    from pyspark.sql import functions as F

    text = F.col("payload").cast("string")
    return [F.get_json_object(text, _json_path(f)).cast("double").alias(f"_f_{_field_name(f)}")
            for f in fields]


def topic_stats_frame(df, o):
    from pyspark.sql import functions as F

    fields = [f for f in (o.fields or []) if f]
    win = o.window or "1 minute"
    wm = o.watermark or "30 seconds"
    src = df.select("timestamp", "topic", "client_id", F.length("payload").alias("_bytes"),
                    *numeric_field_cols(fields))
    aggs = [F.count(F.lit(1)).alias("messages"), F.sum("_bytes").alias("bytes"),
            F.size(F.collect_set("client_id")).alias("publishers")]
    for f in fields:
        c = f"_f_{_field_name(f)}"
        n = _field_name(f)
        aggs += [F.min(c).alias(f"{n}_min"), F.avg(c).alias(f"{n}_mean"), F.max(c).alias(f"{n}_max")]
    agg = (src.withWatermark("timestamp", wm)
           .groupBy(F.window("timestamp", win).alias("w"), "topic").agg(*aggs))
    return agg.select(F.col("w.start").alias("window_start"), F.col("w.end").alias("window_end"),
                      F.date_format(F.col("w.start"), "yyyy-MM-dd").alias("date"),
                      "topic", *[c for c in agg.columns if c not in ("w", "topic")])


def stats_message(d, fields):
    """The JSON document published for one topic-stats row (a dict from Arrow: UTC datetimes)."""
    out = {"topic": d["topic"], "window_start": d["window_start"].isoformat(),
           "window_end": d["window_end"].isoformat(), "messages": d["messages"],
           "bytes": d["bytes"], "publishers": d["publishers"]}
    for f in fields:
        n = _field_name(f)
        if d.get(f"{n}_mean") is not None:
            out[f] = {"min": d[f"{n}_min"], "mean": round(d[f"{n}_mean"], 9), "max": d[f"{n}_max"]}
    return out


def publish_retained(broker, messages, qos=1, client_id=None, timeout=30.0):
    """Publish [(topic, payload bytes)] retained to host:port and wait for the acks."""
    import uuid

    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    if not messages:
        return 0
    host, _, port = broker.rpartition(":")
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id or f"wrenmq-pipeline-{uuid.uuid4().hex[:8]}",
                    protocol=mqtt.MQTTv5)
    c.max_inflight_messages_set(1000)
    c.max_queued_messages_set(0)
    c.connect(host or "127.0.0.1", int(port or 1883))
    c.loop_start()
    try:
        infos = [c.publish(t, p, qos=qos, retain=True) for t, p in messages]
        deadline = time.monotonic() + timeout
        for i in infos:
            i.wait_for_publish(max(0.1, deadline - time.monotonic()))
        return len(infos)
    finally:
        c.disconnect()
        c.loop_stop()


def start_topic_stats(spark, o):
    out = o.output_dir("topic-stats")
    fields = [f for f in (o.fields or []) if f]
    sink = _Sink(out, partition_by=["date"], sort_by=["window_start", "topic"])
    frame = topic_stats_frame(read_stream(spark, o), o)
    prefix = o.publish_prefix.rstrip("/")

    def batch(bdf, batch_id):
        bdf = bdf.persist()
        try:
            sink.write_batch(bdf, batch_id)
            if o.publish:
                rows = bdf.drop("date").toArrow().to_pylist()  # tz-aware UTC, unlike collect()
                msgs = [(f"{prefix}/{r['topic']}", json.dumps(stats_message(r, fields)).encode())
                        for r in sorted(rows, key=lambda r: (r["window_start"], r["topic"]))]
                publish_retained(o.broker, msgs)
        finally:
            bdf.unpersist()

    return _start(frame, o, "topic-stats", batch)


# --- usage ----------------------------------------------------------------------------------------------

def usage_frame(df, o):
    from pyspark.sql import functions as F

    win = o.window or "1 hour"
    wm = o.watermark or "10 minutes"
    agg = (df.select("timestamp", "client_id", F.length("payload").alias("_bytes"))
           .withWatermark("timestamp", wm)
           .groupBy(F.window("timestamp", win).alias("w"), "client_id")
           .agg(F.count(F.lit(1)).alias("messages"), F.sum("_bytes").alias("bytes")))
    return agg.select(F.col("w.start").alias("hour_start"), F.col("w.end").alias("hour_end"),
                      F.date_format(F.col("w.start"), "yyyy-MM-dd").alias("date"),
                      "client_id", "messages", "bytes")


def start_usage(spark, o):
    sink = _Sink(o.output_dir("usage"), partition_by=["date"], sort_by=["hour_start", "client_id"])

    def batch(bdf, batch_id):
        sink.write_batch(bdf, batch_id)

    return _start(usage_frame(read_stream(spark, o), o), o, "usage", batch)


# --- device-state ----------------------------------------------------------------------------------------

STATE_COLUMNS = ["topic", "event_time", "timestamp", "node", "offset", "client_id", "qos", "retain",
                 "payload", "content_type"]


def latest_per_topic(df):
    """The latest message of each topic in `df` (event time, then node and offset break ties).

    The event time is the log timestamp, or for a message the replay job re-published, the
    original message's (so replaying old data never overwrites a newer shadow).
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    orig = F.filter(F.col("properties.user_properties"), lambda p: p["key"] == ORIGINAL_TIMESTAMP)
    orig_ts = F.timestamp_micros(F.try_element_at(orig, F.lit(1))["value"].cast("long"))
    ev = F.coalesce(orig_ts, F.col("timestamp"))
    w = Window.partitionBy("topic").orderBy(F.col("event_time").desc(), F.col("node").desc(),
                                            F.col("offset").desc())
    return (df.withColumn("event_time", ev)
            .withColumn("content_type", F.col("properties.content_type"))
            .withColumn("_rn", F.row_number().over(w)).where("_rn = 1")
            .select(*STATE_COLUMNS))


def merge_state(old, new):
    """Latest row per topic of two pyarrow tables of STATE_COLUMNS (idempotent, order-free)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if old is None or old.num_rows == 0:
        both = new
    else:
        both = pa.concat_tables([old.select(STATE_COLUMNS).cast(new.schema), new])
    if both.num_rows == 0:
        return both
    both = both.sort_by([("topic", "ascending"), ("event_time", "descending"),
                         ("node", "descending"), ("offset", "descending")])
    topics = both.column("topic").combine_chunks()
    keep = np.ones(both.num_rows, dtype=bool)
    if both.num_rows > 1:
        keep[1:] = pc.not_equal(topics[1:], topics[:-1]).to_numpy(zero_copy_only=False)
    return both.filter(pa.array(keep))


def _flatten(obj, prefix, out):
    for k, v in obj.items():
        name = f"{prefix}.{k}"
        if isinstance(v, dict) and v:
            _flatten(v, name, out)
        else:
            out[name] = v


def flatten_payloads(state):
    """Add `payload.<path>` columns for the JSON object payloads of the state table."""
    import pyarrow as pa

    rows = []
    names = {}
    for p in state.column("payload").to_pylist():
        flat = {}
        if p:
            try:
                obj = json.loads(p)
            except (ValueError, UnicodeDecodeError):
                obj = None
            if isinstance(obj, dict):
                _flatten(obj, "payload", flat)
        rows.append(flat)
        for k in flat:
            names.setdefault(k, None)
    for name in names:
        vals = [r.get(name) for r in rows]
        state = state.append_column(name, _typed_array(pa, vals))
    return state


def _typed_array(pa, vals):
    present = [v for v in vals if v is not None]
    if present and all(isinstance(v, bool) for v in present):
        return pa.array(vals, pa.bool_())
    if present and all(isinstance(v, int) and not isinstance(v, bool) and -2**63 <= v < 2**63
                       for v in present):
        return pa.array(vals, pa.int64())
    if present and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        return pa.array([float(v) if v is not None else None for v in vals], pa.float64())
    if all(isinstance(v, str) for v in present):
        return pa.array(vals, pa.string())
    return pa.array([json.dumps(v) if v is not None else None for v in vals], pa.string())


def start_device_state(spark, o):
    import pyarrow.parquet as pq

    out = o.output_dir("device-state")
    sink = _Sink(out, mode="replace", table="device_state")
    table_path = os.path.join(out, "device_state.parquet")

    def batch(bdf, batch_id):
        new = latest_per_topic(bdf).toArrow()
        old = pq.read_table(table_path, columns=STATE_COLUMNS) if os.path.exists(table_path) else None
        if old is not None and new.num_rows == 0:
            return  # nothing new (an empty first batch still publishes the empty table)
        state = merge_state(old, new)
        state = state.sort_by("topic")
        if o.flatten:
            state = flatten_payloads(state)
        state = state.replace_schema_metadata({"wrenmq.batch_id": str(batch_id)})
        sink.write_arrow(state, batch_id)

    return _start(read_stream(spark, o), o, "device-state", batch)


STARTERS = {
    "archive": start_archive,
    "topic-stats": start_topic_stats,
    "device-state": start_device_state,
    "usage": start_usage,
}


# A Spark interval, as Spark parses one ("5 seconds", "1 hour 30 minutes", "interval 10 minutes").
_INTERVAL = re.compile(r"^\s*(interval\s+)?(\d+(\.\d+)?\s+(year|month|week|day|hour|minute|second|millisecond|"
                       r"microsecond)s?\s*)+$", re.I)


def _check_interval(flag, value, zero_ok=True):
    if value is None:
        return
    if not _INTERVAL.match(str(value)) or (not zero_ok and not re.search(r"[1-9]", str(value))):
        raise OptionError(f"{flag}: {value!r} is not a{'' if zero_ok else ' non-zero'} interval such as "
                          f"'5 seconds', '10 minutes', '1 hour 30 minutes'")


def _check_positive(flag, value, least=1):
    if value is not None and value < least:
        raise OptionError(f"{flag}: must be >= {least}, got {value}")


def check_options(job, o):
    """Every error in a job's options that can be found without Spark, as an OptionError
    naming the command-line flag: a data dir without a commit log, offsets, times, topic
    filters, intervals, counts. `run` calls it before it starts a session, so a mistake
    costs no JVM start and leaves no checkpoint."""
    from ..mqtt.topics import TopicError, validate_topic_filter

    if job not in STARTERS:
        raise OptionError(f"unknown job {job!r} (jobs: {', '.join(STARTERS)})")
    nodes = check_source(o)
    try:
        spec = parse_offsets_spec(o.starting_offsets, "startingOffsets")
    except ValueError:
        raise OptionError(f"--starting-offsets: expected earliest, latest or a JSON object "
                          f"{{\"<node>\": <offset>, ...}}, got {o.starting_offsets!r}") from None
    if isinstance(spec, dict):
        unknown = sorted(set(spec) - set(nodes))
        if unknown:
            raise OptionError(f"--starting-offsets: no log partition {', '.join(map(repr, unknown))} in "
                              f"{o.brokers or o.data_dir} (there: {', '.join(nodes)})")
        bad = {n: v for n, v in spec.items() if v < -2}
        if bad:
            raise OptionError(f"--starting-offsets: offsets are >= 0 (or -2 earliest, -1 latest), got {bad}")
    try:
        parse_time_us(o.starting_timestamp)
    except (ValueError, OverflowError):
        raise OptionError(f"--starting-timestamp: expected milliseconds since the epoch or an ISO 8601 time "
                          f"(2026-01-31T12:00:00Z), got {o.starting_timestamp!r}") from None
    try:
        for flt in parse_topics(o.topics) or ():
            validate_topic_filter(flt)
    except (TopicError, ValueError) as e:
        raise OptionError(f"--topics: {o.topics!r}: {e}") from None
    if not o.once:
        _check_interval("--trigger", o.trigger)
    _check_interval("--window", o.window, zero_ok=False)
    _check_interval("--watermark", o.watermark)
    _check_positive("--max-records-per-trigger", o.max_records_per_trigger)
    _check_positive("--max-records-per-partition", o.max_records_per_partition)
    _check_positive("--topic-levels", o.topic_levels, 0)
    if o.duration is not None and o.duration <= 0:
        raise OptionError(f"--duration: must be > 0 seconds, got {o.duration:g}")
    if job == "topic-stats" and o.publish:
        host, sep, port = str(o.broker).rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise OptionError(f"--broker: expected HOST:PORT, got {o.broker!r}")
    for flag, path in (("--output", o.output_dir(job)), ("--checkpoint", o.checkpoint_dir(job))):
        if os.path.exists(path) and not os.path.isdir(path):
            raise OptionError(f"{flag}: {path} exists and is not a directory")


def check_source(o):
    """The log partitions the job will read ({node: where}), or OptionError: a data dir
    without a commit log, or brokers that cannot be reached, refuse the credentials, fail
    TLS or serve no partition (one request to them, a second or so: no Spark)."""
    if not o.brokers:
        return check_log(o.data_dir)
    from .netlog import AccessRefused, Net, NetError, list_partitions

    if o.cafile and not os.path.isfile(o.cafile):
        raise OptionError(f"--cafile: {o.cafile} is not a file")
    if o.password is not None and o.user is None:
        raise OptionError("--password: give --user too")
    if o.token and o.user is not None:
        raise OptionError("--token: give --user/--password or --token, not both")
    try:
        net = Net("wrenmq://" + o.brokers, o.user, o.password, o.token, o.cafile, request_timeout=10.0)
    except ValueError as e:
        raise OptionError(f"--brokers: {str(e).removeprefix('wrenmq source: ')} (expected HOST:PORT of the "
                          "nodes' admin listeners, comma separated)") from None
    try:
        listing = list_partitions(net)
    except AccessRefused as e:
        if e.status is None:  # (TLS)
            raise OptionError(f"--brokers: {e}") from None
        creds = "--token" if o.token else "--user/--password" if o.user is not None else \
            "no credentials were given: --user/--password or --token"
        raise OptionError(f"--brokers: {e} ({creds})") from None
    except NetError as e:
        raise OptionError(f"--brokers: {str(e).removeprefix('wrenmq source: ')}") from None
    if not listing:
        raise OptionError(f"--brokers {o.brokers}: the cluster serves no log partition (no node has a commit "
                          "log, or none answers)")
    return {p: tuple(s["admin"] for s in servers) for p, servers in listing.items()}


def run(job, o, spark=None, console=None):
    """Run one job to completion (`once`) or until interrupted (`continuous`); return 0 on
    success. Raises OptionError (before any Spark starts) for options that cannot work."""
    from .progress import Monitor

    if job == "replay":
        raise ValueError("replay runs through wrenmq.pipeline.replay")
    check_options(job, o)
    own = spark is None
    if own:
        from .spark import session
        spark = session(o.master, app_name=f"wrenmq-{job}", conf=o.spark_conf, ui=o.ui)
    try:
        q = STARTERS[job](spark, o)
        Monitor([(job, q)], o.source_path(), once=o.once, quiet=o.quiet, console=console,
                checkpoints={job: o.checkpoint_dir(job)}, source_opts=source_options(o),
                duration=None if o.once else o.duration).run()
        exc = q.exception()
        if exc is not None:
            raise exc
        return 0
    finally:
        if own:
            spark.stop()
